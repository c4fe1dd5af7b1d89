#!/usr/bin/env python3
"""Agreement of two prediction files (eval_hf.py --predictions or penumbra's).

Matches records by (id, turn) and prints JSON lines: the fraction of identical
predictions per (task, length) and overall ("same greedy answers"); then one
"paired" line: both files' accuracy on the common samples (exact answers, as
`penumbra eval` scores), the gap A - B in points, its paired standard error
(of the per-sample differences, in points) and the samples right in only one
of them. A gap within about two standard errors is not evidence that the two
differ.

  python3 ops/evalmodel/compare_predictions.py pred_hf.jsonl pred_penumbra.jsonl
"""

import collections
import json
import math
import sys


def paired(a, b, keys):
    """Accuracy of a and b over keys, the gap a - b and its standard error (points)."""
    ra = [int(bool(a[k].get("correct"))) for k in keys]
    rb = [int(bool(b[k].get("correct"))) for k in keys]
    d = [x - y for x, y in zip(ra, rb)]
    n = len(d)
    if n == 0:
        return {"paired": True, "n": 0}
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
    return {"paired": True, "n": n, "accuracy_a": round(100.0 * sum(ra) / n, 2),
            "accuracy_b": round(100.0 * sum(rb) / n, 2),
            "gap_points": round(100.0 * mean, 2), "se_points": round(100.0 * math.sqrt(var / n), 2),
            "right_only_a": sum(x > 0 for x in d), "right_only_b": sum(x < 0 for x in d)}


def load(path):
    out = {}
    for line in open(path, encoding="utf-8"):
        if line.strip():
            r = json.loads(line)
            out[(r["id"], r.get("turn", 0))] = r
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    a, b = load(argv[0]), load(argv[1])
    keys = sorted(set(a) & set(b))
    agg = collections.defaultdict(lambda: [0, 0])
    for k in keys:
        ra, rb = a[k], b[k]
        same = ra["prediction"] == rb["prediction"]
        for g in ((ra["task"], ra["length"]), ("all", ra["length"]), ("all", "all")):
            agg[g][0] += 1
            agg[g][1] += int(same)
    for (task, length), (n, s) in sorted(agg.items(), key=lambda kv: str(kv[0])):
        print(json.dumps({"task": task, "length": length, "n": n, "agreement": round(s / n, 4)}))
    print(json.dumps(paired(a, b, keys)))
    missing = len(set(a) ^ set(b))
    if missing:
        print(f"{missing} (id, turn) pairs present in only one file", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

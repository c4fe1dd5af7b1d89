#!/usr/bin/env python3
"""Agreement of two prediction files (eval_hf.py --predictions or penumbra's).

Matches records by (id, turn) and prints JSON lines: the fraction of identical
predictions per (task, length) and overall ("same greedy answers").

  python3 ops/evalmodel/compare_predictions.py pred_hf.jsonl pred_penumbra.jsonl
"""

import collections
import json
import sys


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
    missing = len(set(a) ^ set(b))
    if missing:
        print(f"{missing} (id, turn) pairs present in only one file", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Agreement of two prediction files (eval_hf.py --predictions or penumbra's).

Matches records by (id, turn) and prints JSON lines: the fraction of identical
predictions per (task, length) and overall ("same greedy answers"); then one
"paired" line: both files' accuracy on the common samples (exact answers, as
`penumbra eval` scores), the gap A - B in points, its paired standard error
(of the per-sample differences, in points) and the samples right in only one
of them, and per task both accuracies and the gap ("per_task"). A gap within
about two standard errors is not evidence that the two differ.

Either side may be several files, comma-separated: one run in pieces (e.g.
records 0-24, then 25-49 ... of a set made with tasks.py --first), read as
their concatenation. A sample (id, turn) twice on one side is an error.

  python3 ops/evalmodel/compare_predictions.py pred_hf.jsonl pred_penumbra.jsonl
  python3 ops/evalmodel/compare_predictions.py full-0.jsonl,full-25.jsonl skv-0.jsonl,skv-25.jsonl
"""

import collections
import json
import math
import sys


def paired(a, b, keys):
    """Accuracy of a and b over keys, the gap a - b and its standard error
    (points), and per task the two accuracies and the gap."""
    ra = [int(bool(a[k].get("correct"))) for k in keys]
    rb = [int(bool(b[k].get("correct"))) for k in keys]
    d = [x - y for x, y in zip(ra, rb)]
    n = len(d)
    if n == 0:
        return {"paired": True, "n": 0}
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
    tasks = collections.defaultdict(lambda: [0, 0, 0])  # n, right in a, right in b
    for k, x, y in zip(keys, ra, rb):
        t = tasks[a[k]["task"]]
        t[0] += 1
        t[1] += x
        t[2] += y
    per_task = {task: {"n": tn, "accuracy_a": round(100.0 * ta / tn, 2), "accuracy_b": round(100.0 * tb / tn, 2),
                       "gap_points": round(100.0 * (ta - tb) / tn, 2)}
                for task, (tn, ta, tb) in sorted(tasks.items())}
    return {"paired": True, "n": n, "accuracy_a": round(100.0 * sum(ra) / n, 2),
            "accuracy_b": round(100.0 * sum(rb) / n, 2),
            "gap_points": round(100.0 * mean, 2), "se_points": round(100.0 * math.sqrt(var / n), 2),
            "right_only_a": sum(x > 0 for x in d), "right_only_b": sum(x < 0 for x in d),
            "per_task": per_task}


class InputError(Exception):
    pass


RECORD_FIELDS = ("id", "prediction", "task", "length")  # what a prediction line must have


def load(paths):
    """The samples of one side: the files of a comma-separated list, in order."""
    out, where = {}, {}
    for path in paths.split(","):
        try:
            f = open(path, encoding="utf-8")
        except OSError as e:
            raise InputError(f"{path}: {e.strerror}")
        with f:
            for no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except ValueError as e:
                    raise InputError(f"{path}:{no}: not valid JSON ({e})")
                missing = [f for f in RECORD_FIELDS if not isinstance(r, dict) or f not in r]
                if missing:
                    raise InputError(f"{path}:{no}: not a prediction record (missing '{missing[0]}')")
                key = (r["id"], r.get("turn", 0))
                if key in out:
                    raise InputError(f"{path}:{no}: sample {key[0]} turn {key[1]} is also at {where[key]}")
                out[key] = r
                where[key] = f"{path}:{no}"
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        a, b = load(argv[0]), load(argv[1])
    except InputError as e:
        print(f"compare_predictions: {e}", file=sys.stderr)
        return 2
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

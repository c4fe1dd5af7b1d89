#!/usr/bin/env python3
"""ops/evalmodel/compare_predictions.py on two hand-made prediction files whose
agreement, gap and paired standard error are known."""
import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "ops", "evalmodel",
                      "compare_predictions.py")


def rec(i, correct, prediction, turn=0):
    return {"id": f"kv-16384-{i}", "task": "kv", "length": 16384, "turn": turn, "prediction": prediction,
            "answer": "x", "correct": correct, "partial": float(correct)}


class ComparePredictionsTest(unittest.TestCase):
    def run_on(self, a, b):
        paths = []
        try:
            for recs in (a, b):
                with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
                    for r in recs:
                        f.write(json.dumps(r) + "\n")
                    paths.append(f.name)
            p = subprocess.run([sys.executable, SCRIPT, *paths], capture_output=True, text=True)
        finally:
            for path in paths:
                os.unlink(path)
        self.assertEqual(p.returncode, 0, p.stderr)
        return [json.loads(line) for line in p.stdout.splitlines()]

    def test_paired_gap_and_standard_error(self):
        # 10 samples: A right on 6, B on 5; A alone on samples 0 and 1, B alone on 2.
        a_right = [1, 1, 0, 1, 1, 1, 1, 0, 0, 0]
        b_right = [0, 0, 1, 1, 1, 1, 1, 0, 0, 0]
        a = [rec(i, bool(c), "p%d" % i) for i, c in enumerate(a_right)]
        b = [rec(i, bool(c), "p%d" % i if i >= 3 else "q") for i, c in enumerate(b_right)]
        lines = self.run_on(a, b)
        overall = [l for l in lines if l.get("task") == "all" and l.get("length") == "all"][0]
        self.assertEqual(overall["agreement"], 0.7)  # samples 0, 1, 2 differ
        p = [l for l in lines if l.get("paired")][0]
        self.assertEqual((p["n"], p["accuracy_a"], p["accuracy_b"]), (10, 60.0, 50.0))
        self.assertEqual((p["right_only_a"], p["right_only_b"]), (2, 1))
        d = [x - y for x, y in zip(a_right, b_right)]
        mean = sum(d) / 10
        se = 100 * math.sqrt(sum((x - mean) ** 2 for x in d) / 9 / 10)
        self.assertAlmostEqual(p["gap_points"], 10.0)
        self.assertAlmostEqual(p["se_points"], round(se, 2))

    def test_identical_files_have_no_gap(self):
        a = [rec(i, i % 2 == 0, "p%d" % i) for i in range(6)]
        p = [l for l in self.run_on(a, a) if l.get("paired")][0]
        self.assertEqual((p["gap_points"], p["se_points"], p["right_only_a"], p["right_only_b"]), (0.0, 0.0, 0, 0))


if __name__ == "__main__":
    unittest.main()

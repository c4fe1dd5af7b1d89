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
    def run_raw(self, a, b):
        """a, b: each a list of records (one file) or a list of such lists (pieces, comma-joined)."""
        paths, args = [], []
        try:
            for side in (a, b):
                pieces = side if side and isinstance(side[0], list) else [side]
                names = []
                for recs in pieces:
                    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
                        for r in recs:
                            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
                        paths.append(f.name)
                        names.append(f.name)
                args.append(",".join(names))
            return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)
        finally:
            for path in paths:
                os.unlink(path)

    def run_on(self, a, b):
        p = self.run_raw(a, b)
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

    def test_per_task_accuracy_and_gap(self):
        a = [rec(i, i < 3, "p") for i in range(4)] + [dict(rec(i, True, "p"), id=f"vt-16384-{i}", task="vt")
                                                     for i in range(2)]
        b = [rec(i, i < 1, "p") for i in range(4)] + [dict(rec(i, i == 0, "p"), id=f"vt-16384-{i}", task="vt")
                                                     for i in range(2)]
        p = [l for l in self.run_on(a, b) if l.get("paired")][0]
        self.assertEqual(p["per_task"]["kv"], {"n": 4, "accuracy_a": 75.0, "accuracy_b": 25.0, "gap_points": 50.0})
        self.assertEqual(p["per_task"]["vt"], {"n": 2, "accuracy_a": 100.0, "accuracy_b": 50.0, "gap_points": 50.0})

    def test_a_run_in_pieces_reads_as_their_concatenation(self):
        a = [rec(i, i % 3 == 0, "p%d" % i) for i in range(9)]
        b = [rec(i, i % 2 == 0, "p%d" % (i % 4)) for i in range(9)]
        whole = self.run_on(a, b)
        self.assertEqual(self.run_on([a[:2], a[2:5], a[5:]], [b[:7], b[7:]]), whole)

    def test_a_sample_twice_on_one_side_is_an_error(self):
        a = [rec(i, True, "p") for i in range(3)]
        p = self.run_raw([a, a[1:2]], a)
        self.assertEqual(p.returncode, 2)
        self.assertIn("sample kv-16384-1 turn 0 is also at", p.stderr)
        self.assertEqual(p.stdout, "")

    def test_bad_lines_name_their_file_and_line(self):
        good = rec(0, True, "p")
        p = self.run_raw([good, "{not json"], [good])
        self.assertEqual(p.returncode, 2)
        self.assertRegex(p.stderr, r"\.jsonl:2: not valid JSON")
        p = self.run_raw([good, {"id": "kv-1", "turn": 0}], [good])
        self.assertEqual(p.returncode, 2)
        self.assertRegex(p.stderr, r"\.jsonl:2: not a prediction record \(missing 'prediction'\)")
        p = self.run_raw([good], [good])
        self.assertEqual(p.returncode, 0)
        missing = subprocess.run([sys.executable, SCRIPT, "/nonexistent/a.jsonl", "/nonexistent/b.jsonl"],
                                 capture_output=True, text=True)
        self.assertEqual(missing.returncode, 2)
        self.assertIn("/nonexistent/a.jsonl: No such file or directory", missing.stderr)


if __name__ == "__main__":
    unittest.main()

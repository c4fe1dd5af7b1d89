#!/usr/bin/env python3
"""ops/trace_summary.py on a hand-made trace whose answers are known."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "ops", "trace_summary.py")

US = 1000  # ns


def rec(name, start_us, end_us, stream, kind="kernel"):
    return {"kind": kind, "name": name, "start_ns": start_us * US, "end_ns": end_us * US, "stream": stream}


class TraceSummaryTest(unittest.TestCase):
    def summarize(self, records, *args):
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
            path = f.name
        try:
            p = subprocess.run([sys.executable, SCRIPT, path, *args], capture_output=True, text=True)
        finally:
            os.unlink(path)
        return p

    def test_known_timeline(self):
        # stream 1 computes A [0,100], B [150,200], C [230,260]; stream 2
        # fetches [100,140] and [220,300].
        recs = [rec("A", 0, 100, 1), rec("B", 150, 200, 1), rec("C", 230, 260, 1),
                rec("ns::FetchVKernel", 100, 140, 2), rec("ns::FetchVKernel", 220, 300, 2)]
        p = self.summarize(recs, "--steps", "1", "--json")
        self.assertEqual(p.returncode, 0, p.stderr)
        out = json.loads(p.stdout)
        ms = 1e-3  # one microsecond in ms
        self.assertAlmostEqual(out["window_ms_per_step"], 300 * ms)
        self.assertAlmostEqual(out["gpu_busy_ms_per_step"], (140 + 50 + 80) * ms)
        self.assertAlmostEqual(out["link_busy_ms_per_step"], 120 * ms)
        self.assertEqual(out["fetches_per_step"], 2)
        self.assertAlmostEqual(out["link_idle_between_fetches_ms_per_step"], 80 * ms)
        # The second fetch began after B, the last kernel to end before it.
        self.assertEqual(list(out["link_idle_before_fetch_after_ms_per_step"]), ["B"])
        self.assertAlmostEqual(out["compute_beside_fetch_ms_per_step"], 30 * ms)  # C inside [220,300]
        s1 = out["streams"]["1"]
        self.assertEqual(s1["role"], "compute")
        self.assertAlmostEqual(s1["busy_ms_per_step"], 180 * ms)
        self.assertAlmostEqual(s1["idle_ms_per_step"], 80 * ms)  # 50 before B, 30 before C
        self.assertAlmostEqual(s1["idle_before_ms_per_step"]["B"], 50 * ms)
        self.assertEqual(out["streams"]["2"]["role"], "fetch")
        self.assertEqual(out["fetch_to_next_fetch_us"]["2"]["p50"], 80)

    def test_per_step_scaling_and_text(self):
        recs = [rec("A", 0, 100, 1), rec("FetchVKernel", 100, 300, 2)]
        p = self.summarize(recs, "--steps", "2", "--json")
        self.assertAlmostEqual(json.loads(p.stdout)["link_busy_ms_per_step"], 0.1)
        p = self.summarize(recs, "--steps", "2")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("link_busy_ms_per_step: 0.100", p.stdout)
        two = recs + [rec("FetchVKernel", 400, 450, 2)]
        p = self.summarize(two, "--steps", "1")
        self.assertIn("fetch_to_next_fetch_us (stream 2): p10 100.0, p50 100.0, p90 100.0", p.stdout)

    def test_chain_sample(self):
        recs = [rec("A", 0, 100, 1), rec("B", 150, 200, 1), rec("C", 230, 260, 1),
                rec("FetchVKernel", 100, 140, 2), rec("FetchVKernel", 220, 300, 2), rec("D", 310, 320, 1)]
        p = self.summarize(recs, "--steps", "1", "--chain", "--json")
        self.assertEqual(p.returncode, 0, p.stderr)
        chain = json.loads(p.stdout)["chain_sample_us"]
        self.assertEqual([r["name"] for r in chain], ["FetchVKernel", "B", "FetchVKernel", "C"])
        self.assertEqual((chain[1]["start"], chain[1]["end"]), (50, 100))
        p = self.summarize(recs, "--steps", "1", "--chain")
        self.assertIn("      50.0    100.0    50.0 s1 B", p.stdout)

    def test_bad_input_names_the_line(self):
        p = self.summarize([rec("A", 0, 1, 1), {"kind": "kernel"}], "--steps", "1")
        self.assertNotEqual(p.returncode, 0)
        self.assertIn(":2: not a trace record", p.stderr)


if __name__ == "__main__":
    unittest.main()

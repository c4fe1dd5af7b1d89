#!/usr/bin/env python3
"""The benchmark record: every row of bench/results/*.jsonl follows the schema
of bench/record.py, MANIFEST.json lists every file as it is, docs/benchmarks.md
is what bench/gen_benchmarks_md.py makes of them, and the full-attention peer's
command line parses without PyTorch."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
RESULTS = os.path.join(ROOT, "bench", "results")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import gen_benchmarks_md  # noqa: E402
import record  # noqa: E402


def result_files():
    return sorted(n for n in os.listdir(RESULTS) if n.endswith(".jsonl"))


class RecordSchemaTest(unittest.TestCase):
    def test_every_row_is_valid(self):
        names = result_files()
        self.assertTrue(names)
        for name in names:
            rows = record.read_rows(os.path.join(RESULTS, name))
            self.assertTrue(rows, name)
            for line, row in rows:
                self.assertEqual(record.validate(row), [], f"{name}:{line}")

    def test_validate_finds_problems(self):
        row = {"commit": "abc", "date": "yesterday", "device": "cpu", "device_count": 0, "command": "x",
               "suite": "s", "bench": "b", "units": {}, "tokens_per_s": 1.5}
        problems = record.validate(row)
        self.assertTrue(any("commit" in p for p in problems), problems)
        self.assertTrue(any("date" in p for p in problems), problems)
        self.assertTrue(any("tokens_per_s" in p for p in problems), problems)
        self.assertIn("missing commit", record.validate({}))

    def test_tag_fills_the_schema(self):
        row = record.tag({"peer": "pytorch-sdpa", "mode": "decode", "context": 124928, "tokens_per_s": 129.8},
                         "shadowkv", "python3 .device/full_attention_peer.py decode --graph --context 124928",
                         commit="0123456789abcdef0123456789abcdef01234567", date="2026-11-27T00:00:00+00:00",
                         device="NVIDIA H100 80GB HBM3", device_count=1)
        self.assertEqual(record.validate(row), [])
        self.assertEqual(row["bench"], "peer")
        self.assertEqual(row["units"]["tokens_per_s"], "tokens/s")
        self.assertEqual(row["units"]["context"], "tokens")
        self.assertEqual(row["tokens_per_s"], 129.8)

    def test_tag_command_line(self):
        env = dict(os.environ, PENUMBRA_COMMIT="0123456789abcdef0123456789abcdef01234567")
        p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "record.py"), "tag", "--suite", "ttft",
                            "--command", "penumbra-bench ttft", "--device", "cpu", "--device-count", "0"],
                           input='log line\n{"mode": "ttft", "ttft_ms": 22.5}\n', capture_output=True, text=True,
                           env=env, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        rows = [json.loads(line) for line in p.stdout.splitlines()]
        self.assertEqual(len(rows), 1)
        self.assertEqual(record.validate(rows[0]), [])
        self.assertEqual(rows[0]["commit"], env["PENUMBRA_COMMIT"])
        self.assertEqual(rows[0]["suite"], "ttft")


class ManifestTest(unittest.TestCase):
    def test_lists_every_file_as_it_is(self):
        m = gen_benchmarks_md.load_manifest()
        listed = {e["path"]: e for e in m["files"]}
        on_disk = set(result_files()) | {n + "/" for n in os.listdir(RESULTS)
                                         if os.path.isdir(os.path.join(RESULTS, n)) and n != "archive"}
        self.assertEqual(set(listed), on_disk)
        ids = {c["id"] for c in gen_benchmarks_md.CAPABILITIES}
        for path, e in listed.items():
            self.assertIn(e["kind"], ("rows", "raw"), path)
            self.assertTrue(e.get("what"), path)
            self.assertLessEqual(set(e["backs"]), ids, path)
            if e["kind"] == "rows":
                for k, v in gen_benchmarks_md.derived(path).items():
                    self.assertEqual(e.get(k), v, f"{path}: {k} (python3 bench/gen_benchmarks_md.py --update-manifest)")
        backed = {b for e in listed.values() for b in e["backs"]}
        self.assertEqual(ids - backed, set(), "capabilities that no file backs")


class BenchmarksMdTest(unittest.TestCase):
    def test_doc_is_generated_from_the_record(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "benchmarks.md")
            p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gen_benchmarks_md.py"), "--out", out],
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(out) as f:
                made = f.read()
        with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
            committed = f.read()
        self.assertEqual(made, committed, "docs/benchmarks.md is stale: run python3 bench/gen_benchmarks_md.py")
        self.assertIn("python3 bench/gen_benchmarks_md.py", committed.split("\n## ")[0])


class PeerCliTest(unittest.TestCase):
    def test_help_runs_without_torch(self):
        peer = os.path.join(ROOT, "bench", "peer", "full_attention_peer.py")
        with tempfile.TemporaryDirectory() as d:
            # a torch that fails on import: --help must not import it
            os.mkdir(os.path.join(d, "torch"))
            with open(os.path.join(d, "torch", "__init__.py"), "w") as f:
                f.write("raise ImportError('no torch in this test')\n")
            env = dict(os.environ, PYTHONPATH=d)
            p = subprocess.run([sys.executable, peer, "--help"], capture_output=True, text=True, env=env, timeout=60)
            self.assertEqual(p.returncode, 0, p.stderr)
            for flag in ("--graph", "--shared-prefix", "--context", "--batch", "--steps", "--suffix"):
                self.assertIn(flag, p.stdout)
            code = ("import sys; sys.path.insert(0, sys.argv[1]); import full_attention_peer as p; "
                    "a = p.parse_args(['decode', '--shared-prefix', '--graph', '--batch', '64', '--context', "
                    "'124928', '--steps', '20']); print(a.mode, a.shared_prefix, a.graph, a.batch, a.context, a.steps)")
            p = subprocess.run([sys.executable, "-c", code, os.path.dirname(peer)], capture_output=True, text=True,
                               env=env, timeout=60)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertEqual(p.stdout.split(), ["decode", "True", "True", "64", "[124928]", "20"])


if __name__ == "__main__":
    unittest.main()

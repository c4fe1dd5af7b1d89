#!/usr/bin/env python3
"""ops/fairness.py's pure parts: the tenants.yaml writer, key hashing and the
summaries (no processes, no service)."""
import collections
import hashlib
import os
import re
import sys
import unittest

OPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "ops")
sys.path.insert(0, OPS)
import fairness  # noqa: E402
import loadtest  # noqa: E402


class HashTest(unittest.TestCase):
    def test_matches_the_example_config(self):
        # configs/tenants.yaml: research-dev-key-0001's documented hash.
        self.assertEqual(fairness.hash_api_key("research-dev-key-0001"),
                         "sha256:4d553ad482ec4b0abc39e78e3645032631fb3dfc007d7022bb23062e9bd21ea2")

    def test_short_key_refused(self):
        with self.assertRaises(ValueError):
            fairness.hash_api_key("x" * 15)
        fairness.hash_api_key("x" * 16)

    def test_new_keys_are_long_and_distinct(self):
        a, b = fairness.new_api_key("flood"), fairness.new_api_key("flood")
        self.assertNotEqual(a, b)
        self.assertGreaterEqual(len(a.encode()), fairness.MIN_API_KEY_BYTES)
        self.assertTrue(a.startswith("flood-"))


class TenantsYamlTest(unittest.TestCase):
    def test_two_tenants(self):
        text = fairness.tenants_yaml([
            {"name": "flood", "api_keys": ["flood-key-0123456789"], "weight": 1.0, "max_concurrent_sequences": 4},
            {"name": "steady", "api_keys": ["steady-key-0123456789"], "weight": 2},
        ])
        h = lambda k: "sha256:" + hashlib.sha256(k.encode()).hexdigest()  # noqa: E731
        self.assertEqual(text.splitlines()[1:], [
            "tenants:",
            "  - name: flood",
            "    api_keys:",
            "      - " + h("flood-key-0123456789"),
            "    quotas:",
            "      max_concurrent_sequences: 4",
            "    weight: 1.0",
            "  - name: steady",
            "    api_keys:",
            "      - " + h("steady-key-0123456789"),
            "    weight: 2.0",
        ])
        self.assertNotIn("flood-key-0123456789", text)  # only hashes are written
        self.assertTrue(text.startswith("#"))

    def test_unlimited_quota_is_absent(self):
        text = fairness.tenants_yaml([{"name": "a", "api_keys": ["k" * 16], "max_concurrent_sequences": None}])
        self.assertNotIn("quotas", text)
        self.assertIn("    weight: 1.0\n", text)

    def test_refusals(self):
        ok = {"name": "a", "api_keys": ["k" * 16]}
        bad = [
            [dict(ok, name="A")],
            [dict(ok, name="")],
            [ok, dict(ok, api_keys=["j" * 16])],  # repeated name
            [dict(ok, api_keys=[])],
            [dict(ok, api_keys=["short"])],
            [dict(ok, weight=0)],
            [dict(ok, weight=2e6)],
            [dict(ok, max_concurrent_sequences=0)],
            [dict(ok, max_concurrent_sequences=1.5)],
        ]
        for tenants in bad:
            with self.subTest(tenants=tenants), self.assertRaises(ValueError):
                fairness.tenants_yaml(tenants)

    def test_hashes_are_well_formed(self):
        text = fairness.tenants_yaml([{"name": "a", "api_keys": ["k" * 16, "m" * 20]}])
        hashes = re.findall(r"^      - (\S+)$", text, re.M)
        self.assertEqual(len(hashes), 2)
        for x in hashes:
            self.assertRegex(x, r"^sha256:[0-9a-f]{64}$")


class SummaryTest(unittest.TestCase):
    def test_phase_summary(self):
        r = loadtest.Results()
        r.requests = 3
        r.ttft = [0.1, 0.2, 0.3]
        r.generated_tokens = 30
        r.errors = collections.Counter({"RESOURCE_EXHAUSTED": 2})
        s = fairness.phase_summary(r, 10.0)
        self.assertEqual(s["requests"], 3)
        self.assertAlmostEqual(s["ttft_p50_s"], 0.2)
        self.assertAlmostEqual(s["ttft_p99_s"], 0.298)
        self.assertEqual(s["tokens_per_s"], 3.0)
        self.assertEqual(s["errors"], 2)
        self.assertEqual(s["errors_by_code"], {"RESOURCE_EXHAUSTED": 2})
        self.assertIsNone(s["token_latency_p50_s"])

    def test_empty_phase(self):
        s = fairness.phase_summary(loadtest.Results(), 0.0)
        self.assertIsNone(s["ttft_p99_s"])
        self.assertIsNone(s["tokens_per_s"])

    def test_ratio(self):
        self.assertEqual(fairness.ttft_ratio(0.3, 0.2), 1.5)
        self.assertIsNone(fairness.ttft_ratio(None, 0.2))
        self.assertIsNone(fairness.ttft_ratio(0.3, None))
        self.assertIsNone(fairness.ttft_ratio(0.3, 0.0))


if __name__ == "__main__":
    unittest.main()

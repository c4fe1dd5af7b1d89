#!/usr/bin/env python3
"""tests/tools/gtest_completeness.py on synthetic inputs: it names a case no CTest runs."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gtest_completeness as gc  # noqa: E402

SOURCE = """
TEST(Plain, One) {}
TEST_F(Fixture, Two) { int x; (void)x; }
  TEST_P(Param, Three) {}
TEST(Plain, DISABLED_Off) {}
INSTANTIATE_TEST_SUITE_P(Values, Param, ::testing::Values(1, 2));
"""

# What the binary a_test lists with --gtest_list_tests.
LISTING = """Plain.
  One
  DISABLED_Off
Fixture.
  Two
Values/Param.
  Three/0  # GetParam() = 1
  Three/1  # GetParam() = 2
"""


def fake_lister(exe):
    """--gtest_list_tests of a binary holding LISTING."""
    return gc.parse_gtest_list(LISTING)


def ctest_json(*tests):
    return {"tests": [{"name": name, "command": cmd, "properties": [{"name": "LABELS", "value": labels}]}
                      for name, cmd, labels in tests]}


class Completeness(unittest.TestCase):
    def test_parse_listing(self):
        self.assertEqual(gc.parse_gtest_list(LISTING),
                         ["Plain.One", "Plain.DISABLED_Off", "Fixture.Two", "Values/Param.Three/0", "Values/Param.Three/1"])

    def test_filters(self):
        self.assertTrue(gc.filter_matches(None, "A.b"))
        self.assertTrue(gc.filter_matches("A.b", "A.b"))
        self.assertFalse(gc.filter_matches("A.b", "A.bc"))
        self.assertTrue(gc.filter_matches("*/P.c/*", "V/P.c/0"))
        self.assertTrue(gc.filter_matches("X.*:A.*", "A.b"))
        self.assertFalse(gc.filter_matches("A.*-A.b", "A.b"))
        self.assertTrue(gc.filter_matches("-A.b", "A.c"))

    def test_defined_skips_disabled(self):
        self.assertEqual(gc.defined_cases(SOURCE),
                         [("TEST", "Plain", "One"), ("TEST_F", "Fixture", "Two"), ("TEST_P", "Param", "Three")])

    def test_one_ctest_per_binary_covers_every_case(self):
        runs = gc.gtest_runs(ctest_json(("a_test", ["/b/a_test"], ["unit"])))
        self.assertEqual(gc.missing_cases({"tests/x/a_test.cc": SOURCE}, runs, fake_lister), [])

    def test_one_ctest_per_case_covers_every_case(self):
        runs = gc.gtest_runs(ctest_json(
            ("a_One", ["/b/a_test", "--gtest_filter=Plain.One"], ["service"]),
            ("a_Two", ["/b/a_test", "--gtest_filter=Fixture.Two"], ["service"]),
            ("a_Three", ["/b/a_test", "--gtest_filter=*/Param.Three/*"], ["service"])))
        self.assertEqual(gc.missing_cases({"tests/x/a_test.cc": SOURCE}, runs, fake_lister), [])

    def test_an_unregistered_case_is_named(self):
        runs = gc.gtest_runs(ctest_json(
            ("a_One", ["/b/a_test", "--gtest_filter=Plain.One"], ["service"]),
            ("a_Three", ["/b/a_test", "--gtest_filter=*/Param.Three/*"], ["service"])))
        self.assertEqual(gc.missing_cases({"tests/x/a_test.cc": SOURCE}, runs, fake_lister),
                         ["tests/x/a_test.cc: Fixture.Two (no CTest of a_test runs it)"])

    def test_an_unregistered_binary_is_named(self):
        runs = gc.gtest_runs(ctest_json(("other", ["/b/other_test"], ["unit"])))
        missing = gc.missing_cases({"tests/x/a_test.cc": SOURCE}, runs, fake_lister)
        self.assertEqual(len(missing), 3)
        self.assertIn("tests/x/a_test.cc: Plain.One (no CTest runs the binary a_test)", missing)

    def test_a_disabled_ctest_runs_nothing(self):
        j = ctest_json(("a_test", ["/b/a_test"], ["unit"]))
        j["tests"][0]["properties"].append({"name": "DISABLED", "value": True})
        self.assertEqual(len(gc.missing_cases({"tests/x/a_test.cc": SOURCE}, gc.gtest_runs(j), fake_lister)), 3)

    def test_scripts_are_not_gtest_runs(self):
        self.assertEqual(gc.gtest_runs(ctest_json(("py", ["/usr/bin/python3", "x_test.py"], ["unit"]))), [])

    def test_cost_labels(self):
        j = ctest_json(("ok", ["x"], ["unit", "faults"]), ("none", ["x"], ["faults"]),
                       ("two", ["x"], ["unit", "service"]), ("str", ["x"], "service;security"))
        problems = gc.label_problems(j)
        self.assertEqual(len(problems), 2)
        self.assertTrue(problems[0].startswith("none: cost labels none"))
        self.assertTrue(problems[1].startswith("two: cost labels ['unit', 'service']"))


if __name__ == "__main__":
    unittest.main()

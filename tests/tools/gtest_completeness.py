#!/usr/bin/env python3
"""Every gtest case defined in tests/ runs in some CTest; every test has one cost label.

  gtest_completeness.py --source tests --build build [--ctest ctest] [--no-gpu]

Defined: each TEST/TEST_F/TEST_P(Suite, Case) in tests/**/*_test.cc (cases
named DISABLED_ are skipped). The binary of tests/x/NAME_test.cc is NAME_test.
Run: for every CTest whose command is a *_test binary (from
`ctest --show-only=json-v1`, DISABLED tests left out), the cases that binary
lists with `--gtest_list_tests` that the test's own --gtest_filter selects. A case
defined but run by no CTest is printed and the check fails. With --no-gpu
(a build without CUDA) the *_gpu_test.cc files are not built and not checked.

Cost labels: every CTest carries exactly one of unit, integration, service,
gpu (tests/README.md).
"""
import argparse
import fnmatch
import json
import os
import re
import subprocess
import sys

COST_LABELS = ("unit", "integration", "service", "gpu")
_TEST_RE = re.compile(r"^[ \t]*(TEST|TEST_F|TEST_P)\([ \t]*(\w+)[ \t]*,[ \t]*(\w+)[ \t]*\)", re.M)


def defined_cases(text):
    """[(kind, suite, case)] of the gtest cases a source defines."""
    out = []
    for kind, suite, case in _TEST_RE.findall(text):
        if suite.startswith("DISABLED_") or case.startswith("DISABLED_"):
            continue
        out.append((kind, suite, case))
    return out


def case_matches(kind, suite, case, full_name):
    """Whether a name --gtest_list_tests prints is (an instance of) the case."""
    if kind == "TEST_P":  # Instantiation/Suite.Case/Param
        return re.fullmatch(r"[^/]+/" + re.escape(suite) + r"\." + re.escape(case) + r"/.+", full_name) is not None
    return full_name == f"{suite}.{case}"


def parse_gtest_list(text):
    """The full names ('Suite.Case') in the output of --gtest_list_tests."""
    names, suite = [], None
    for line in text.splitlines():
        if not line.strip() or line.startswith("Running main()"):
            continue
        if not line.startswith(" "):
            suite = line.split("#")[0].strip()
        elif suite is not None:
            names.append(suite + line.split("#")[0].strip())
    return names


def gtest_runs(ctest_json):
    """[(executable, filter or None)] of the enabled CTests that run a *_test binary."""
    runs = []
    for t in ctest_json.get("tests", []):
        cmd = t.get("command") or []
        if not cmd or not os.path.basename(cmd[0]).endswith("_test"):
            continue
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        if props.get("DISABLED"):
            continue
        flt = None
        for arg in cmd[1:]:
            if arg.startswith("--gtest_filter="):
                flt = arg[len("--gtest_filter="):]
        runs.append((cmd[0], flt))
    return runs


def label_problems(ctest_json):
    """One line per test without exactly one cost label."""
    out = []
    for t in ctest_json.get("tests", []):
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        labels = props.get("LABELS", [])
        if isinstance(labels, str):
            labels = labels.split(";")
        cost = [l for l in labels if l in COST_LABELS]
        if len(cost) != 1:
            out.append(f"{t['name']}: cost labels {cost or 'none'} (want exactly one of {', '.join(COST_LABELS)})")
    return out


def filter_matches(flt, name):
    """gtest's --gtest_filter: 'POS[:POS...][-NEG[:NEG...]]' with * and ? wildcards."""
    if flt is None:
        return True
    pos, _, neg = flt.partition("-")
    def any_of(patterns):
        return any(fnmatch.fnmatchcase(name, p) for p in patterns.split(":") if p)
    return (not pos or any_of(pos)) and not any_of(neg)


def missing_cases(sources, runs, list_cases):
    """Cases defined in `sources` ({path: text}) that no run covers.

    runs: [(executable, filter)]; list_cases(executable) -> [full names] (each
    binary is listed once). Returns ["path: Suite.Case (binary NAME ...)"].
    """
    listed = {}
    covered = {}  # binary name -> set of full names some CTest runs
    for exe, flt in runs:
        if exe not in listed:
            listed[exe] = list_cases(exe)
        covered.setdefault(os.path.basename(exe), set()).update(n for n in listed[exe] if filter_matches(flt, n))
    out = []
    for path, text in sorted(sources.items()):
        binary = os.path.splitext(os.path.basename(path))[0]
        names = covered.get(binary)
        for kind, suite, case in defined_cases(text):
            if names is None:
                out.append(f"{path}: {suite}.{case} (no CTest runs the binary {binary})")
            elif not any(case_matches(kind, suite, case, n) for n in names):
                out.append(f"{path}: {suite}.{case} (no CTest of {binary} runs it)")
    return out


def run_list_cases(exe):
    cmd = [exe, "--gtest_list_tests"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()}")
    return parse_gtest_list(r.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", required=True, help="the tests/ folder")
    ap.add_argument("--build", required=True, help="the build folder")
    ap.add_argument("--ctest", default="ctest")
    ap.add_argument("--no-gpu", action="store_true", help="*_gpu_test.cc files are not built")
    a = ap.parse_args()

    r = subprocess.run([a.ctest, "--show-only=json-v1"], cwd=a.build, capture_output=True, text=True, check=True)
    ctest_json = json.loads(r.stdout)
    sources = {}
    for root, _, files in os.walk(a.source):
        for f in files:
            if not f.endswith("_test.cc") or (a.no_gpu and f.endswith("_gpu_test.cc")):
                continue
            path = os.path.join(root, f)
            with open(path, encoding="utf-8") as fh:
                sources[os.path.relpath(path, os.path.dirname(os.path.abspath(a.source)))] = fh.read()
    runs = gtest_runs(ctest_json)
    missing = missing_cases(sources, runs, run_list_cases)
    labels = label_problems(ctest_json)
    n = sum(len(defined_cases(t)) for t in sources.values())
    for line in missing:
        print("defined but run by no CTest:", line)
    for line in labels:
        print("label:", line)
    if missing or labels:
        print(f"FAIL: {len(missing)} of {n} cases not run, {len(labels)} tests without one cost label")
        return 1
    print(f"ok: {n} gtest cases in {len(sources)} files, each run by a CTest "
          f"({len(runs)} CTests run gtest binaries, {len(ctest_json.get('tests', []))} CTests in all, "
          f"each with one cost label)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

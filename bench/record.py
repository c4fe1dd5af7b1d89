#!/usr/bin/env python3
"""The benchmark record's row schema: a check and a writer (stdlib only).

Every line of every `bench/results/*.jsonl` file is one JSON object (a row):
one measurement, with the measurement's own fields (`tokens_per_s`,
`ms_per_step`, `context`, ...) and these fields that every row carries:

  commit      the git commit the measured build came from (hex, 7-40 chars)
  date        when it was measured (ISO 8601: 2026-11-25 or 2026-11-25T13:08:17+00:00)
  device      the device's name: "NVIDIA H100 80GB HBM3", "NVIDIA H200", "cpu"
  device_count  the GPUs of the machine the row was measured on (0 for cpu)
  command     the command line that produced the row
  suite       the suite of ops/device/bench.sh that ran it (or, for runs outside
              it, the tool's name: "cpu-service", "kernel-bench", ...)
  bench       what the row measures: the mode (decode, prefill, ttft, shared,
              cp-decode, ...), "peer" for the full-attention peer's rows, or the
              row's own "bench" name (service-ttft, store-gather, ...)
  units       {field: unit} for every numeric top-level field of the row

and, optionally, `command_reconstructed: true` where the command was not
recorded with the row but rebuilt from its suite and fields.

  validate(row) -> list of problems (empty when the row is valid)
  tag(row, suite, command, ...) -> the row with every schema field filled in

Command line (ops/device/bench.sh tags every JSON line of a run this way):

  CMD | python3 bench/record.py tag --suite SUITE --command "CMD"   # JSON lines in, tagged rows out
  python3 bench/record.py validate FILE...                          # exit 1 on any invalid row
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys

REQUIRED = ("commit", "date", "device", "device_count", "command", "suite", "bench", "units")

_HEX = re.compile(r"^[0-9a-f]{7,40}$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?)?$")

# Unit of a numeric field, by its name: the first rule that matches wins.
_UNIT_RULES = (
    (r"tokens_per_s$|tok_per_s$", "tokens/s"),
    (r"requests_per_s$", "requests/s"),
    (r"tflop_per_s$", "TFLOP/s"),
    (r"gbps$|gb_per_s$", "GB/s"),
    (r"(^|_)ratio$|^speedup$", "ratio"),
    (r"(^|_)bytes(_|$)", "bytes"),
    (r"_ms$|^ms_|_ms_", "ms"),
    (r"(^|_)s$|^seconds$|_seconds$", "s"),
    (r"fraction$|^accuracy$|^partial$|hit_rate|^budget_fraction$", "fraction"),
    (r"^load_avg", "load average"),
    (r"cores$", "cores"),
    (r"^context$|tokens$|^length$|^question$|^suffix$|^keys$|^shard_tokens$|^local_window$|^min_prompt$"
     r"|^chunk_size$|^prefill_chunk$", "tokens"),
    (r"^batch|^built_batch$|^max_batch$", "sequences"),
    (r"^(hq|hkv)$", "heads"),
    (r"^window$|^pool$|^codebook_block$", "tokens"),
    (r"^merge_window$", "codebook entries"),
    (r"threshold$", "cosine similarity"),
    (r"^nq$", "tokens"),
    (r"^head_dim$|^in$|^out$", "elements"),
    (r"steps$", "steps"),
    (r"chunks$|^landmarks_per_chunk$", "chunks"),
    (r"blocks$", "blocks"),
    (r"threads$", "threads"),
    (r"^(gpus|workers|rank)$", "GPUs/ranks"),
    (r"clients$", "clients"),
    (r"(^|_)(n|items|records|errors|requests|pairs|pair|round|documents|outliers|turns|promotions"
     r"|answers_equal|failed_items|kernel_trace_records|micro_batches|lanes|job_status)$", "count"),
    (r"^session|_call$", "label"),
)


def is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def unit_of(field):
    """The unit of a numeric field named `field` ("count" when no rule names it)."""
    for pattern, unit in _UNIT_RULES:
        if re.search(pattern, field):
            return unit
    return "count"


def units_for(row):
    """{field: unit} for every numeric top-level field of `row` (schema fields aside)."""
    return {k: unit_of(k) for k, v in row.items() if is_number(v) and k not in REQUIRED}


def validate(row):
    """Problems with `row` against the schema: an empty list when it is valid."""
    if not isinstance(row, dict):
        return ["a row is a JSON object"]
    problems = [f"missing {k}" for k in REQUIRED if k not in row]
    c = row.get("commit")
    if "commit" in row and not (isinstance(c, str) and _HEX.match(c)):
        problems.append(f"commit {c!r} is not a git sha")
    d = row.get("date")
    if "date" in row and not (isinstance(d, str) and _DATE.match(d)):
        problems.append(f"date {d!r} is not ISO 8601")
    for k in ("device", "command", "suite", "bench"):
        if k in row and not (isinstance(row[k], str) and row[k]):
            problems.append(f"{k} is not a non-empty string")
    n = row.get("device_count")
    if "device_count" in row and not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
        problems.append("device_count is not a count")
    if "command_reconstructed" in row and not isinstance(row["command_reconstructed"], bool):
        problems.append("command_reconstructed is not a boolean")
    u = row.get("units")
    if "units" in row:
        if not isinstance(u, dict) or not all(isinstance(v, str) for v in u.values()):
            problems.append("units is not an object of strings")
        else:
            missing = sorted(k for k, v in row.items() if is_number(v) and k not in REQUIRED and k not in u)
            if missing:
                problems.append("no unit for " + ", ".join(missing))
    return problems


def current_commit(repo="."):
    """$PENUMBRA_COMMIT, else `git rev-parse HEAD`, else .device/COMMIT (written by
    ops/device/pack.sh for a copy that is not a git checkout), else None."""
    c = os.environ.get("PENUMBRA_COMMIT", "").strip()
    if c:
        return c
    try:
        out = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and _HEX.match(out.stdout.strip()):
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open(os.path.join(repo, ".device", "COMMIT")) as f:
            c = f.read().strip()
            return c or None
    except OSError:
        return None


def current_device():
    """(name, count) of this machine's GPUs from nvidia-smi, ("cpu", 0) without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
        if out.returncode == 0 and names:
            return names[0], len(names)
    except (OSError, subprocess.SubprocessError):
        pass
    return "cpu", 0


def bench_of(row, suite):
    """The row's bench: its own "bench", "peer" for the peer, else its mode, else the suite."""
    if isinstance(row.get("bench"), str) and row["bench"]:
        return row["bench"]
    if "peer" in row:
        return "peer"
    if isinstance(row.get("mode"), str) and row["mode"]:
        return row["mode"]
    return suite


def tag(row, suite, command, commit=None, date=None, device=None, device_count=None):
    """`row` with every schema field filled in: the suite is set, the other fields
    are kept where the row has them. commit, date, device default to this
    checkout's commit (current_commit), now (UTC) and nvidia-smi's GPUs."""
    out = dict(row)
    out["suite"] = suite
    out.setdefault("command", command)
    if "commit" not in out:
        out["commit"] = commit or current_commit() or "unknown"
    if "date" not in out:
        out["date"] = date or datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    if "device" not in out or "device_count" not in out:
        if device is None:
            device, device_count = current_device()
        out.setdefault("device", device)
        out.setdefault("device_count", device_count if device_count is not None else (0 if device == "cpu" else 1))
    out["bench"] = bench_of(out, suite)
    units = dict(out.get("units") or {})
    for k, v in units_for(out).items():
        units.setdefault(k, v)
    out["units"] = units
    return out


def read_rows(path):
    """The rows of a .jsonl file, as (line number, row) pairs (blank lines skipped)."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                rows.append((i, json.loads(line)))
    return rows


def _cmd_tag(a):
    # The commit and device are looked up once for the whole stream.
    commit = a.commit or current_commit() or "unknown"
    device, count = current_device() if a.device is None else (a.device, a.device_count)
    for line in sys.stdin:
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict):
            continue
        print(json.dumps(tag(row, a.suite, a.command, commit=commit, device=device, device_count=count)), flush=True)
    return 0


def _cmd_validate(a):
    bad = 0
    for path in a.files:
        for i, row in read_rows(path):
            for p in validate(row):
                print(f"{path}:{i}: {p}")
                bad += 1
    return 1 if bad else 0


def main(argv=None):
    p = argparse.ArgumentParser(description="The benchmark record's rows: tag new ones, validate files.")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tag", help="tag the JSON lines on stdin with the schema's fields")
    t.add_argument("--suite", required=True)
    t.add_argument("--command", required=True, help="the command line that produced the lines")
    t.add_argument("--commit", help="default: $PENUMBRA_COMMIT, git rev-parse HEAD, .device/COMMIT")
    t.add_argument("--device", help="default: nvidia-smi's first GPU, or cpu")
    t.add_argument("--device-count", type=int, default=1)
    v = sub.add_parser("validate", help="check every row of the given .jsonl files")
    v.add_argument("files", nargs="+")
    a = p.parse_args(argv)
    return _cmd_tag(a) if a.cmd == "tag" else _cmd_validate(a)


if __name__ == "__main__":
    sys.exit(main())

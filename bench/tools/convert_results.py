#!/usr/bin/env python3
"""One-off: gives every row of bench/results/*.jsonl the schema of bench/record.py
and writes bench/results/MANIFEST.json. Run once from the repository root on the
tree before the conversion (it reads each row's commit from `git blame`: the
commit that added the row; a sha that the row's own "build" names wins)."""
import collections, json, os, re, subprocess, sys
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import record  # noqa: E402

R = "bench/results"

# file -> (default suite, capabilities it backs, what it measured)
DEC = "decode-shadowkv"
FILES = {
    "2026-11-21-h200.jsonl": ("full", ["decode-full", "prefill", DEC, "shadowkv-1m"], "first GPU measurements: full and ShadowKV decode, prefill, beside the peer"),
    "2026-11-21-h200-decode-mma.jsonl": ("full", ["decode-full"], "decode attention on tensor cores (mma)"),
    "2026-11-21-h200-lanes-wide-fetch.jsonl": ("shadowkv", [], "ablation: ShadowKV lanes with wide value fetch"),
    "2026-11-21-h200-lanes.jsonl": ("shadowkv", ["decode-full"], "ablation: ShadowKV decode lanes"),
    "2026-11-21-h200-decode-merge.jsonl": ("full", ["decode-full"], "full decode with the split-KV merge"),
    "2026-11-21-h200-score-mma.jsonl": ("shadowkv", [], "ablation: ShadowKV landmark scoring on tensor cores"),
    "2026-11-21-h200-micro.jsonl": ("shadowkv", [], "ablation: ShadowKV micro-batches"),
    "2026-11-21-h200-prefill-wgmma.jsonl": ("full", ["prefill"], "prefill attention on wgmma"),
    "2026-11-21-h200-side-priority.jsonl": ("shadowkv", [], "ablation: side-stream priority"),
    "2026-11-21-h200-decode-profile.jsonl": ("shadowkv", [], "decode step breakdown (--profile)"),
    "2026-11-21-h200-prek-table.jsonl": ("shadowkv", [], "ablation: pre-RoPE key table"),
    "2026-11-21-h200-compress-batched.jsonl": ("shadowkv", [], "ablation: batched compression"),
    "2026-11-21-h200-fetch-timeline.jsonl": ("shadowkv", [], "value-fetch timeline"),
    "2026-11-21-h200-fetch-turns.jsonl": ("shadowkv", [], "ablation: value fetch in turns"),
    "2026-11-21-h200-skinny-linear.jsonl": ("kernel-bench", ["skinny-linear"], "skinny (few-row) linear kernel vs cuBLAS"),
    "2026-11-21-h200-sweep.jsonl": ("sweep", ["shadowkv-sweep", "shadowkv-1m"], "ShadowKV context/batch sweep"),
    "2026-11-21-h200-micro-lanes3.jsonl": ("shadowkv", [], "ablation: three lanes with micro-batches"),
    "2026-11-21-h200-fetch-blocks.jsonl": ("shadowkv", [], "ablation: value-fetch block count"),
    "2026-11-21-h200-kernel-trace.jsonl": ("trace", ["decode-full"], "decode under --kernel-trace"),
    "2026-11-21-h200-fused-select.jsonl": ("shadowkv", [], "fused score + top-k selection"),
    "2026-11-21-h200-chained.jsonl": ("shadowkv", [], "chained kernel launches"),
    "2026-11-21-h200-swiglu.jsonl": ("shadowkv", ["decode-full", "shadowkv-1m"], "fused SwiGLU; full and ShadowKV decode, 1M tokens"),
    "2026-11-24-h100-ttft.jsonl": ("ttft", ["ttft"], "time to first token, cold and cached in memory"),
    "2026-11-24-h100-ttft-shadowkv.jsonl": ("ttft", ["ttft"], "time to first token of ShadowKV prefixes, memory and disk"),
    "2026-11-24-h100-shared-document.jsonl": ("shared", ["shared-document", "attention-kernels"], "64 questions over one shared document vs the peer's cascade"),
    "2026-11-24-h100-ttft-cascade.jsonl": ("ttft", ["ttft"], "time to first token with cascade attention over the cached prefix"),
    "2026-11-24-h100-shadowkv-decode.jsonl": ("shadowkv", [DEC], "ShadowKV decode beside the peer on the H100"),
    "2026-11-24-h100-attention-kernels.jsonl": ("kernel-bench", ["attention-kernels"], "prefill and prefix attention kernels"),
    "2026-11-25-h100-service.jsonl": ("service", ["service"], "the service through its API beside penumbra-bench and the peer"),
    "2026-11-25-cpu-service-load.jsonl": ("cpu-service", ["service-load-cpu"], "bounded load test on loopback (CPU)"),
    "2026-11-25-h100-ttft-disk-lazy.jsonl": ("ttft_disk", ["ttft-disk"], "time to first token from disk with lazy values"),
    "2026-11-25-cpu-eval-segmented.jsonl": ("cpu-eval", ["eval-segmented-cpu"], "accuracy of the segmented continuations (CPU)"),
    "2026-11-25-cpu-service-fairness.jsonl": ("cpu-service", ["fairness-cpu"], "a flooding tenant vs a steady one (CPU)"),
    "2026-11-25-h100-jobs.jsonl": ("jobs", ["jobs"], "a batch job vs the same questions one at a time"),
    "2026-11-25-h100-tier0.jsonl": ("tier0", ["tier0"], "tier 0: a hot document's values on the GPU"),
    "2026-11-25-h100-host-store-node.jsonl": ("store", ["store-node"], "value-store node gather bandwidth over UCX"),
    "2026-11-25-h100x2-dp-scaling.jsonl": ("dp", ["data-parallel"], "data-parallel scaling on two GPUs"),
    "2026-11-25-h100x2-context-parallel.jsonl": ("cp", ["context-parallel"], "one sequence across two H100s"),
    "2026-11-25-h200x2-context-parallel.jsonl": ("cp", ["context-parallel"], "one sequence across two H200s"),
    "2026-11-25-h200x2-global-selection.jsonl": ("cp", ["context-parallel", "attention-kernels"], "the shards' global top-k"),
    "2026-11-25-h100-chunk-size-throughput.jsonl": ("variants", [], "ablation: ShadowKV chunk size 8 vs 4"),
    "2026-11-26-h200-landmarks-throughput.jsonl": ("variants", [], "ablation: landmarks per chunk 1/2/4"),
    "2026-11-26-h200-default-landmarks-throughput.jsonl": ("variants", [], "the four-landmark default beside one landmark"),
    "2026-11-26-h100-fp8-landmarks-throughput.jsonl": ("variants", [], "fp8 landmarks"),
    "2026-11-26-h100-defaults-vs-s1-replicate.jsonl": ("variants", [DEC], "ShadowKV with the defaults beside the peer (replicate)"),
    "2026-11-26-h100-score-chunk-max-ab.jsonl": ("variants", [], "ablation: chunk-max scoring A/B"),
    "2026-11-26-h100-eval-64k-100records.jsonl": ("eval", ["eval-accuracy"], "64K accuracy, paired comparisons at 25 and 100 records per task (copied from the folder's compare.jsonl)"),
    "2026-11-27-cpu-tls-overhead-pairs.jsonl": ("cpu-service", ["tls-overhead-cpu"], "TLS on vs off through the service (CPU)"),
}
FOLDERS = {
    "2026-11-21-chained": "raw logs, trace and reference check beside 2026-11-21-h200-chained.jsonl",
    "2026-11-21-evalmodel": "accuracy of the first evaluation model (predictions, sweeps, training loss)",
    "2026-11-21-fused-select": "raw logs beside 2026-11-21-h200-fused-select.jsonl",
    "2026-11-21-kernel-trace": "kernel-trace summaries beside 2026-11-21-h200-kernel-trace.jsonl",
    "2026-11-21-swiglu": "raw logs, trace and test logs beside 2026-11-21-h200-swiglu.jsonl",
    "2026-11-25-h100-eval-chunk-ablation": "accuracy predictions of the chunk-size ablation",
    "2026-11-25-h100-service-logs": "worker logs beside 2026-11-25-h100-service.jsonl",
    "2026-11-26-h100-eval-64k-100records": "64K predictions at 100 records per task and their paired comparisons",
    "2026-11-26-h100-eval-fp8-landmarks": "accuracy predictions with fp8 landmarks",
    "2026-11-26-h200-eval-landmarks": "accuracy predictions for landmarks per chunk",
    "2026-11-26-paper-model": "the paper-shaped evaluation model: card, training, accuracy",
}
FOLDER_BACKS = {"2026-11-26-h100-eval-64k-100records": ["eval-accuracy"], "2026-11-26-h100-eval-fp8-landmarks": ["eval-accuracy"],
                "2026-11-26-paper-model": ["eval-accuracy"], "2026-11-26-h200-eval-landmarks": ["eval-accuracy"]}

DEVICES = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200"}


def git(*a):
    return subprocess.run(["git", *a], capture_output=True, text=True, check=True).stdout


def full_sha(s):
    try:
        return git("rev-parse", "--verify", "--quiet", s + "^{commit}").strip() or None
    except subprocess.CalledProcessError:
        return None


def blame(path):
    """[(sha, committer unix time)] per line of path."""
    out, cur, meta = [], None, {}
    for line in git("blame", "--line-porcelain", "--", path).splitlines():
        m = re.match(r"^([0-9a-f]{40}) \d+ \d+", line)
        if m:
            cur = m.group(1)
        elif line.startswith("committer-time "):
            meta[cur] = int(line.split()[1])
        elif line.startswith("\t"):
            out.append((cur, meta.get(cur, 0)))
    return out


def fmt(v):
    return str(v)


def reconstruct(r, suite):
    """A command line for a row that recorded none, from its suite and fields."""
    if "peer" in r:
        a = ["python3 .device/peer_full_attention.py", r.get("mode", "decode")]
        if "shared-prefix" in r["peer"]:
            a.append("--shared-prefix")
        if "cudagraph" in r["peer"]:
            a.append("--graph")
        if "shared-prefix" in r["peer"] or r.get("mode") == "prefill":
            a += ["--batch", fmt(r.get("batch", 1))] if "shared-prefix" in r["peer"] else []
        a += ["--context", fmt(r["context"])]
        return " ".join(a)
    if r.get("bench") == "skinny_linear":
        return "PENUMBRA_KERNEL_BENCH=1 linear_skinny_gpu_test"
    mode = r.get("mode")
    if mode in ("decode", "prefill", "ttft", "shared", "cp-decode"):
        a = ["penumbra-bench", mode, "--kv-policy", r.get("kv_policy", "full")]
        if r.get("prefill_chunk"):
            a += ["--prefill-chunk", fmt(r["prefill_chunk"])]
        if r.get("lanes"):
            a += ["--lanes", fmt(r["lanes"])]
        a += ["--context", fmt(r["context"])]
        if r.get("batch_limit") == "requested" or mode != "decode":
            a += ["--batch", fmt(r.get("batch", 1))]
        if r.get("steps"):
            a += ["--steps", fmt(r["steps"])]
        if "force_hit_rate" in r and mode == "decode":
            h = r["force_hit_rate"]
            a += ["--hit-rates", "natural" if h < 0 else fmt(h)]
        return " ".join(a)
    return f"bash ops/device/bench.sh {suite}"


def convert(name):
    path = f"{R}/{name}"
    suite0, backs, what = FILES[name]
    fdate = name[:10]
    dev = "cpu" if "-cpu-" in name else DEVICES[re.search(r"-(h100|h200)", name).group(1)]
    count = 0 if dev == "cpu" else (2 if re.search(r"-h[12]00x2-", name) else 1)
    lines = open(path).read().splitlines()
    bl = blame(path)
    rows = []
    for (sha, t), line in zip(bl, lines):
        if not line.strip():
            continue
        r = json.loads(line)
        commit = None
        if isinstance(r.get("commit"), str) and full_sha(r["commit"]):
            commit = full_sha(r["commit"])
        b = r.get("build")
        if not commit and isinstance(b, str):
            m = re.match(r"^([0-9a-f]{7,40})\b", b)
            if m:
                commit = full_sha(m.group(1))
        commit = commit or sha
        suite = r.get("suite") or suite0
        if "peer" not in r and suite0 in ("full", "shadowkv") and r.get("kv_policy") in ("full", "shadowkv") and r.get("mode") == "decode":
            suite = r.get("suite") or r["kv_policy"]
        cmd = r.get("command") or r.get("bench_command") if "peer" not in r else r.get("command")
        if name.startswith("2026-11-26-h100-eval-64k"):
            cmd = r.get("made_by")
        head = {"commit": commit,
                "date": r.get("date") if isinstance(r.get("date"), str) else fdate,
                "device": dev, "device_count": count}
        g = r.get("gpu") if isinstance(r.get("gpu"), str) else None
        if g:
            head["device"] = re.sub(r"^cuda:\d+ ", "", g)
        if isinstance(r.get("device"), str):
            head["device"] = re.sub(r"^cuda:\d+ ", "", r["device"])
        if head["device"] == "cpu":
            head["device_count"] = 0
        rest = {k: v for k, v in r.items() if k not in head}
        if cmd:
            head["command"] = cmd
        else:
            head["command"] = reconstruct(r, suite)
            head["command_reconstructed"] = True
        rest.pop("command", None)
        out = record.tag(dict(head, **rest), suite, head["command"], commit=commit, date=head["date"],
                         device=head["device"], device_count=head["device_count"])
        # schema fields first, then the row's own fields in their order
        order = ["commit", "date", "device", "device_count", "suite", "bench", "command", "command_reconstructed"]
        row = {k: out[k] for k in order if k in out}
        row.update({k: v for k, v in out.items() if k not in row and k != "units"})
        row["units"] = out["units"]
        assert not record.validate(row), (name, record.validate(row))
        rows.append((row, t))
    with open(path, "w") as f:
        for row, _ in rows:
            f.write(json.dumps(row) + "\n")
    return {"path": name, "kind": "rows", "rows": len(rows),
            "suites": sorted({r["suite"] for r, _ in rows}),
            "device": sorted({r["device"] for r, _ in rows if "peer" not in r or True}),
            "device_count": max(r["device_count"] for r, _ in rows),
            "commits": sorted({r["commit"] for r, _ in rows}),
            "dates": sorted({r["date"][:10] for r, _ in rows}),
            "recorded": max(t for _, t in rows),
            "backs": backs, "what": what}


def main():
    # the 64K comparisons: a top-level copy of the folder's compare.jsonl (made by
    # ops/evalmodel/compare_predictions.py), so that the record carries them as rows
    src = f"{R}/2026-11-26-h100-eval-64k-100records/compare.jsonl"
    dst = f"{R}/2026-11-26-h100-eval-64k-100records.jsonl"
    if not os.path.exists(dst):
        sha = blame(src)[0][0]
        with open(dst, "w") as f:
            for line in open(src):
                if line.strip():
                    r = json.loads(line)
                    f.write(json.dumps(dict({"commit": sha}, **r)) + "\n")
        subprocess.run(["git", "add", dst], check=True)
        subprocess.run(["git", "commit", "-q", "-m", "bench/results: the 64K paired comparisons as top-level rows (a copy of the folder's compare.jsonl)"], check=True)
    names = sorted(n for n in os.listdir(R) if n.endswith(".jsonl"))
    missing = set(names) ^ set(FILES)
    assert not missing, missing
    files = [convert(n) for n in names]
    for d in sorted(n for n in os.listdir(R) if os.path.isdir(f"{R}/{n}") and n != "archive"):
        log = git("log", "--format=%H %ct", "--", f"{R}/{d}").split()
        files.append({"path": d + "/", "kind": "raw", "files": sum(len(fs) for _, _, fs in os.walk(f"{R}/{d}")),
                      "commits": [log[0]], "dates": [d[:10]], "recorded": int(log[1]),
                      "device": ["cpu" if "-cpu-" in d else DEVICES.get((re.search(r"-(h100|h200)", d) or [None, "h200"])[1], "NVIDIA H200")],
                      "backs": FOLDER_BACKS.get(d, []), "what": FOLDERS[d]})
    with open(f"{R}/MANIFEST.json", "w") as f:
        json.dump({"about": "Every file under bench/results: its suites, device, commits, dates, and the "
                            "capabilities (docs/benchmarks.md sections) it backs. 'recorded' is the unix time "
                            "of the newest commit that wrote it (orders files of one date). kind 'rows': JSON "
                            "lines in the schema of bench/record.py; 'raw': a folder of logs and predictions.",
                   "files": files}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Summarize a penumbra-bench --kernel-trace file (JSON lines of kernels and
copies with GPU start/end times, see worker/bench/kernel_trace.h).

  python3 ops/trace_summary.py TRACE.jsonl --steps N [--fetch FetchV] [--chain] [--json]

Per decode step it reports: how long the GPU ran anything, each stream's busy
time and top kernels, how long the host link was busy (the union of the value
fetch kernels, any stream), the link's idle gaps attributed to what the next
fetch waited for (the kernel that ended last before it began), and per lane
(fetch stream) the time from the end of one fetch to the start of the next.
With --chain it also lists one sample of a lane's chain: every record between
the start of a fetch (one from the middle of the first fetch stream's) and the
end of that stream's next fetch, in microseconds from that fetch's start. Only
the standard library is used, so it runs on the GPU machine as well as here.
"""
import argparse
import collections
import json
import sys


def union(intervals):
    """Total length of the union of [start, end) intervals."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def merged(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, required=True, help="decode steps the trace covers (the bench's --steps)")
    ap.add_argument("--fetch", default="FetchV",
                    help="substring naming the value fetch kernels (FetchVKernel, FetchVWarpKernel, FetchVFp8Kernel)")
    ap.add_argument("--chain", action="store_true", help="also list one sample of a lane's chain between two fetches")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = ap.parse_args()

    recs = []
    with open(args.trace) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
                recs.append((int(r["start_ns"]), int(r["end_ns"]), int(r["stream"]), r["kind"], r["name"]))
            except (ValueError, KeyError, TypeError) as e:
                sys.exit(f"{args.trace}:{n}: not a trace record ({e})")
    if not recs or args.steps < 1:
        sys.exit("empty trace or --steps < 1")
    recs.sort()
    t0 = recs[0][0]
    t1 = max(r[1] for r in recs)
    per = 1e6 * args.steps  # ns -> ms per step
    out = {"records": len(recs), "window_ms_per_step": (t1 - t0) / per}
    out["gpu_busy_ms_per_step"] = union([(s, e) for s, e, *_ in recs]) / per

    fetch = [(s, e, st) for s, e, st, k, n in recs if args.fetch in n]
    fetch_streams = sorted({st for _, _, st in fetch})
    out["fetches_per_step"] = len(fetch) / args.steps
    out["link_busy_ms_per_step"] = union([(s, e) for s, e, _ in fetch]) / per
    out["fetch_kernel_ms_per_step"] = sum(e - s for s, e, _ in fetch) / per
    if fetch:
        d = sorted((e - s) / 1e3 for s, e, _ in fetch)
        out["fetch_us"] = {"p10": d[len(d) // 10], "p50": d[len(d) // 2], "p90": d[9 * len(d) // 10]}

    # Per fetch stream (one lane's side stream): from the end of one fetch to
    # the start of the lane's next one, the lane's own chain (its attention,
    # MLP, next layer's projections, scoring, top-k) plus any wait for its turn.
    out["fetch_to_next_fetch_us"] = {}
    for st in fetch_streams:
        own = sorted((s, e) for s, e, x in fetch if x == st)
        d = sorted((b[0] - a[1]) / 1e3 for a, b in zip(own, own[1:]))
        if d:
            out["fetch_to_next_fetch_us"][str(st)] = {"p10": d[len(d) // 10], "p50": d[len(d) // 2],
                                                      "p90": d[9 * len(d) // 10]}

    # Streams: busy time and what runs there.
    streams = collections.defaultdict(list)
    for s, e, st, k, n in recs:
        streams[st].append((s, e, n))
    out["streams"] = {}
    for st, rs in sorted(streams.items()):
        by = collections.Counter()
        for s, e, n in rs:
            by[n] += e - s
        gaps = collections.Counter()  # idle before a kernel, by that kernel
        for (s0, e0, _), (s1, e1, n1) in zip(rs, rs[1:]):
            if s1 > e0:
                gaps[n1] += s1 - e0
        out["streams"][str(st)] = {
            "role": "fetch" if st in fetch_streams else "compute",
            "kernels_per_step": len(rs) / args.steps,
            "busy_ms_per_step": union([(s, e) for s, e, _ in rs]) / per,
            "idle_ms_per_step": sum(gaps.values()) / per,
            "top_kernels_ms_per_step": {n: v / per for n, v in by.most_common(8)},
            "idle_before_ms_per_step": {n: v / per for n, v in gaps.most_common(6)},
        }

    # Link idle gaps: between the end of one merged fetch interval and the
    # start of the next, attributed to the kernel (on any non-fetch-kernel
    # record) that ended last before the next fetch began: what it waited for.
    m = merged([(s, e) for s, e, _ in fetch])
    ends = sorted((e, n) for s, e, st, k, n in recs if args.fetch not in n)
    import bisect
    end_times = [e for e, _ in ends]
    waited = collections.Counter()
    gap_total = 0
    for (s0, e0), (s1, e1) in zip(m, m[1:]):
        g = s1 - e0
        gap_total += g
        i = bisect.bisect_right(end_times, s1) - 1
        waited[ends[i][1] if i >= 0 else "?"] += g
    out["link_idle_between_fetches_ms_per_step"] = gap_total / per
    out["link_idle_before_fetch_after_ms_per_step"] = {n: v / per for n, v in waited.most_common(8)}
    # While the link is busy, how much of the GPU's other work runs beside it.
    other = merged([(s, e) for s, e, st, k, n in recs if args.fetch not in n])
    both = 0
    j = 0
    for s, e in m:
        while j < len(other) and other[j][1] <= s:
            j += 1
        k = j
        while k < len(other) and other[k][0] < e:
            both += max(0, min(e, other[k][1]) - max(s, other[k][0]))
            k += 1
    out["compute_beside_fetch_ms_per_step"] = both / per
    out["compute_busy_ms_per_step"] = union([(s, e) for s, e in other]) / per

    if args.chain and fetch_streams:
        own = sorted((s, e) for s, e, x in fetch if x == fetch_streams[0])
        if len(own) >= 2:
            i = (len(own) - 2) // 2
            lo, hi = own[i][0], own[i + 1][1]
            out["chain_sample_us"] = [
                {"start": (s - lo) / 1e3, "end": (e - lo) / 1e3, "stream": st, "name": n}
                for s, e, st, k, n in recs if e > lo and s < hi]

    if args.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        if k == "streams":
            for st, d in v.items():
                print(f"stream {st} ({d['role']}): {d['kernels_per_step']:.0f} kernels/step, busy {d['busy_ms_per_step']:.2f} ms, "
                      f"idle {d['idle_ms_per_step']:.2f} ms per step")
                for n, ms in d["top_kernels_ms_per_step"].items():
                    print(f"    {ms:7.3f} ms  {n[:110]}")
                for n, ms in d["idle_before_ms_per_step"].items():
                    print(f"    idle {ms:7.3f} ms before {n[:100]}")
        elif k == "chain_sample_us":
            print("chain sample (us from the fetch's start: start, end, duration, stream, name):")
            for r in v:
                print(f"  {r['start']:8.1f} {r['end']:8.1f} {r['end'] - r['start']:7.1f} s{r['stream']} {r['name'][:90]}")
        elif k == "fetch_to_next_fetch_us":
            for st, q in v.items():
                print(f"{k} (stream {st}): p10 {q['p10']:.1f}, p50 {q['p50']:.1f}, p90 {q['p90']:.1f}")
        elif isinstance(v, dict):
            print(f"{k}:")
            for n, ms in v.items():
                print(f"    {ms:9.3f}  {n[:110]}")
        else:
            print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")


if __name__ == "__main__":
    main()

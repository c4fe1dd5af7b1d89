#!/usr/bin/env python3
"""Compares an engine's ShadowKV results with the independent reference.

  compare_shadowkv.py --inputs in.safetensors --ours ours.safetensors
                      [--tol-bf16] [--json summary.json] [--ref-device cpu]

Each stage is checked given the engine's own decisions of the stage before, so
one near-tie does not cascade: the reference is rerun with the engine's
outlier chunks and selected chunks, and the engine's scores and output are
compared with that conditioned reference. The decisions themselves are checked
against the reference's own ones, tolerating only differences at near-ties.
See README.md for the file format and the tolerances.

The engine's mode (metadata "mode": direct, attached, cp2) is reported; a
context-parallel run's "shards" (token bounds) make the reference the
sharded one (each shard factored alone, its share of the outliers) and the
outlier check per shard.
"""

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shadowkv_reference as ref_lib  # noqa: E402


@dataclasses.dataclass
class Tolerances:
    landmarks: float     # max over non-outlier chunks of ||ours - ref|| / ||ref|| per landmark row
    outlier_band: float  # differing outlier chunks must have |min_cos - cut| <= this (absolute)
    scores: float        # max |ours - ref| / (|ref| + 1e-3 * max of the row) over non-outlier chunks
    select_band: float   # differing selected chunks must have |score - kth| <= this * kth
    out: float           # ||ours - ref|| / ||ref|| over all steps and query heads


TOLERANCES = {
    "f32": Tolerances(landmarks=1e-5, outlier_band=1e-6, scores=1e-4, select_band=1e-5, out=1e-4),
    "bf16": Tolerances(landmarks=1e-2, outlier_band=5e-3, scores=5e-2, select_band=2e-2, out=2e-2),
}
# Slack for "the selection is the top-k of the engine's own scores".
SELF_TOPK_SLACK = 1e-6

EXPECTED = {  # name -> (dtype, shape as a function of the inputs)
    "landmarks": (torch.float32, lambda i: (i.hkv, i.n_chunks, i.d)),
    "outliers": (torch.int32, lambda i: (i.hkv, i.outliers)),
    "selected": (torch.int32, lambda i: (i.steps, i.hkv, i.kslots)),
    "out": (torch.float32, lambda i: (i.steps, i.hq, i.d)),
    "scores": (torch.float32, lambda i: (i.steps, i.hkv, i.n_chunks)),
}


def check_structure(inp, ours):
    """Names, dtypes, shapes, index ranges and order. Returns a list of problems."""
    problems = []
    for name, (dtype, shape) in EXPECTED.items():
        if name not in ours:
            problems.append(f"missing tensor '{name}'")
        elif ours[name].dtype != dtype or tuple(ours[name].shape) != shape(inp):
            problems.append(f"'{name}' is {ours[name].dtype} {tuple(ours[name].shape)}, "
                            f"want {dtype} {shape(inp)}")
    if problems:
        return problems

    def index_rows(name, rows, where):
        for idx, row in rows:
            r = row.tolist()
            if any(c < 0 or c >= inp.n_chunks for c in r):
                problems.append(f"'{name}'{where(idx)}: chunk id out of [0, {inp.n_chunks})")
            elif any(a >= b for a, b in zip(r, r[1:])):
                problems.append(f"'{name}'{where(idx)}: not strictly ascending")

    index_rows("outliers", enumerate(ours["outliers"]), lambda h: f"[{h}]")
    sel = ours["selected"]
    index_rows("selected", [((i, h), sel[i, h]) for i in range(inp.steps) for h in range(inp.hkv)],
               lambda ih: f"[{ih[0]}, {ih[1]}]")
    for i in range(inp.steps):
        for h in range(inp.hkv):
            both = set(sel[i, h].tolist()) & set(ours["outliers"][h].tolist())
            if both:
                problems.append(f"'selected'[{i}, {h}] contains outlier chunks {sorted(both)[:4]}")
    for name in ("landmarks", "out"):
        if not torch.isfinite(ours[name]).all():
            problems.append(f"'{name}' has non-finite values at "
                            f"{(~torch.isfinite(ours[name])).nonzero()[0].tolist()}")
    return problems[:20]


def valid_mask(inp, outliers):
    """[hkv, n_chunks] True where the chunk is not an outlier."""
    valid = torch.ones(inp.hkv, inp.n_chunks, dtype=torch.bool)
    valid[torch.arange(inp.hkv)[:, None], outliers.long()] = False
    return valid


def near_tie_diff(ours_idx, ref_idx, values, cut, relative):
    """Chunks in one set but not the other, and the worst distance of their
    reference values from the cut value (relative to |cut| if asked)."""
    diff = set(ours_idx.tolist()) ^ set(ref_idx.tolist())
    denom = max(abs(cut), 1e-300) if relative else 1.0
    worst = max((abs(values[c].item() - cut) / denom for c in diff), default=0.0)
    return len(diff), worst


def parse_shards(inp, meta):
    """The shards' token bounds from ours' metadata (None: one sequence), or a problem."""
    text = meta.get("shards")
    if not text:
        return None, None
    try:
        return ref_lib.check_shards(inp, [int(b) for b in text.split(",")]), None
    except ValueError as e:
        return None, f"metadata 'shards' = '{text}': {e}"


def compare(inp, ours_path, bf16=False, ref_device="cpu", quiet=False, tol=None):
    ours, meta = ref_lib.read_safetensors(ours_path)
    bf16 = bf16 or meta.get("dtype") == "bf16"
    mode = "bf16" if bf16 else "f32"
    tol = tol or TOLERANCES[mode]
    shards, bad_shards = parse_shards(inp, meta)
    summary = {"pass": False, "mode": mode, "engine_mode": meta.get("mode", "direct"), "shards": shards,
               "ours": ours_path, "tolerances": dataclasses.asdict(tol), "checks": {}, "info": {}}
    checks = summary["checks"]

    problems = check_structure(inp, ours) + ([bad_shards] if bad_shards else [])
    checks["structure"] = {"ok": not problems, "problems": problems}
    if problems:
        _report(summary, quiet)
        return summary

    # The reference with its own decisions, and conditioned on the engine's.
    dev_inp = dataclasses.replace(inp, k_pre=inp.k_pre.to(ref_device), v=inp.v.to(ref_device),
                                  q=inp.q.to(ref_device), inv_freq=inp.inv_freq.to(ref_device))
    own = ref_lib.run_reference(dev_inp, shards=shards)
    cond = ref_lib.run_reference(dev_inp, outliers=ours["outliers"].long().to(ref_device),
                                 selected=ours["selected"].long().to(ref_device), pre=own.pre)
    cpu = lambda t: t.detach().to("cpu", torch.float64)
    valid = valid_mask(inp, ours["outliers"])

    # Landmarks (rows of the engine's outlier chunks are not used and not checked).
    ref_lm, our_lm = cpu(own.pre.landmarks), ours["landmarks"].double()
    row_err = (our_lm - ref_lm).norm(dim=-1) / ref_lm.norm(dim=-1)
    worst = row_err.masked_fill(~valid, 0).max()
    at = (row_err.masked_fill(~valid, 0) == worst).nonzero()[0].tolist()
    checks["landmarks"] = {"ok": worst.item() <= tol.landmarks, "max_row_rel_err": worst.item(),
                           "worst_at_head_chunk": at,
                           "max_abs_diff": (our_lm - ref_lm).abs().masked_fill(~valid[..., None], 0).max().item()}

    # Outlier chunks: equal sets, up to near-ties of the reference's min-cos
    # (per shard: each shard's count and cut are its own).
    min_cos = cpu(own.pre.min_cos)
    heads_differ, n_diff, worst, counts_ok = 0, 0, 0.0, True
    bounds = shards or [0, inp.seq]
    for h in range(inp.hkv):
        differs = False
        for b0, b1 in zip(bounds, bounds[1:]):
            c0, c1 = b0 // inp.chunk, min(b1 // inp.chunk, inp.n_chunks)
            mine = ours["outliers"][h][(ours["outliers"][h] >= c0) & (ours["outliers"][h] < c1)]
            ref = own.pre.outliers[h].cpu()
            ref = ref[(ref >= c0) & (ref < c1)]
            if len(mine) != len(ref):
                counts_ok, differs = False, True
                continue
            if len(ref) == 0:
                continue
            cut = min_cos[h, ref].max().item()
            n, w = near_tie_diff(mine, ref, min_cos[h], cut, relative=False)
            differs = differs or n > 0
            n_diff += n
            worst = max(worst, w)
        heads_differ += differs
    checks["outliers"] = {"ok": counts_ok and worst <= tol.outlier_band, "heads_differing": heads_differ,
                          "chunks_differing": n_diff, "worst_min_cos_dist_from_cut": worst,
                          "counts_per_shard_equal": counts_ok}

    # Scores, against the reference given the engine's outliers.
    ref_sc, our_sc = cpu(cond.scores), ours["scores"].double()
    v3 = valid.expand_as(ref_sc)
    row_max = ref_sc.masked_fill(~v3, 0).amax(dim=-1, keepdim=True)
    err = ((our_sc - ref_sc).abs() / (ref_sc.abs() + 1e-3 * row_max)).masked_fill(~v3, 0)
    err = torch.nan_to_num(err, nan=float("inf"))
    outlier_entries = our_sc[~v3]
    outliers_ok = bool(((outlier_entries == 0) | (outlier_entries == float("-inf"))).all())
    finite_ok = bool(torch.isfinite(our_sc[v3]).all())
    checks["scores"] = {"ok": finite_ok and outliers_ok and err.max().item() <= tol.scores,
                        "max_rel_err": err.max().item(),
                        "worst_at_step_head_chunk": (err == err.max()).nonzero()[0].tolist(),
                        "outlier_entries_zero_or_neg_inf": outliers_ok, "finite": finite_ok}

    # The engine's selection is the top-k of its own scores.
    violations, worst_short = 0, 0.0
    for i in range(inp.steps):
        for h in range(inp.hkv):
            s = our_sc[i, h]
            chosen = torch.zeros(inp.n_chunks, dtype=torch.bool)
            chosen[ours["selected"][i, h].long()] = True
            rest = valid[h] & ~chosen
            if rest.any():
                low, high = s[chosen].min().item(), s[rest].max().item()
                if low < high - SELF_TOPK_SLACK * abs(high):
                    violations += 1
                    worst_short = max(worst_short, (high - low) / max(abs(high), 1e-300))
    checks["selection_is_own_topk"] = {"ok": violations == 0, "violations": violations,
                                       "worst_rel_shortfall": worst_short}

    # The engine's selection against the reference's top-k (given the engine's outliers).
    rows_differ, n_diff, worst = 0, 0, 0.0
    for i in range(inp.steps):
        for h in range(inp.hkv):
            kth = ref_sc[i, h, cond.topk[i, h].cpu()].min().item()
            n, w = near_tie_diff(ours["selected"][i, h], cond.topk[i, h].cpu(), ref_sc[i, h], kth, relative=True)
            rows_differ += n > 0
            n_diff += n
            worst = max(worst, w)
    checks["selection"] = {"ok": worst <= tol.select_band, "step_heads_differing": rows_differ,
                           "chunks_differing": n_diff, "worst_rel_score_dist_from_kth": worst}

    # Attention output, against the reference given the engine's outliers and selection.
    ref_out, our_out = cpu(cond.out), ours["out"].double()
    rel = ref_lib.rel_err(our_out, ref_out)
    per_step = [ref_lib.rel_err(our_out[i], ref_out[i]) for i in range(inp.steps)]
    checks["out"] = {"ok": rel <= tol.out, "rel_err": rel, "max_step_rel_err": max(per_step),
                     "max_abs_diff": (our_out - ref_out).abs().max().item()}

    summary["info"] = {
        "ours_vs_reference_own_decisions_rel_err": ref_lib.rel_err(our_out, cpu(own.out)),
        "ours_vs_full_attention_rel_err": ref_lib.rel_err(our_out, cpu(own.full)),
        "reference_sparse_vs_full_rel_err": ref_lib.rel_err(cpu(own.out), cpu(own.full)),
        "reference_coverage_mean": own.coverage.mean().item(),
        **ref_lib.margins(inp, own),
        **ref_lib.cut_conditioning(inp, own.pre),
    }
    summary["pass"] = all(c["ok"] for c in checks.values())
    _report(summary, quiet)
    return summary


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3e}"
    return str(v)


def _report(summary, quiet):
    if quiet:
        return
    print(f"shadowkv check ({summary['mode']} tolerances, engine mode {summary['engine_mode']}"
          f"{', shards ' + ','.join(map(str, summary['shards'])) if summary['shards'] else ''}): "
          f"{'PASS' if summary['pass'] else 'FAIL'}")
    for name, c in summary["checks"].items():
        rest = ", ".join(f"{k}={_fmt(v)}" for k, v in c.items() if k != "ok")
        print(f"  {name:22s} {'ok  ' if c['ok'] else 'FAIL'} {rest}")
    if summary["info"]:
        print("  info: " + ", ".join(f"{k}={_fmt(v)}" for k, v in summary["info"].items()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", required=True, help="inputs file (shadowkv_reference.py make-inputs)")
    ap.add_argument("--ours", required=True, help="the engine's results")
    ap.add_argument("--tol-bf16", action="store_true",
                    help="bf16 tolerances (also chosen when ours' metadata has dtype=bf16)")
    ap.add_argument("--json", help="write a one-line JSON summary here")
    ap.add_argument("--ref-device", default="cpu", help="device for the float64 reference")
    ap.add_argument("--tol", action="append", default=[], metavar="NAME=VALUE",
                    help="override one tolerance (landmarks, outlier_band, scores, select_band, out)")
    args = ap.parse_args(argv)

    try:
        inp = ref_lib.load_inputs(args.inputs)
        _, meta = ref_lib.read_safetensors(args.ours)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mode = "bf16" if args.tol_bf16 or meta.get("dtype") == "bf16" else "f32"
    tol = TOLERANCES[mode]
    for item in args.tol:
        name, value = item.split("=", 1)
        tol = dataclasses.replace(tol, **{name: float(value)})
    summary = compare(inp, args.ours, bf16=mode == "bf16", ref_device=args.ref_device, tol=tol)
    summary["inputs"] = args.inputs
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(summary) + "\n")
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

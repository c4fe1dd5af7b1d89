#!/usr/bin/env python3
"""Plots the ShadowKV budget and rank sweeps (like the paper's Figures 8-9).

Reads the `penumbra eval --json` outputs named eval_sweep_b<fraction>.jsonl,
eval_sweep_r<rank>.jsonl, eval_sweep_base.jsonl (budget 1.56%, rank 40) and
eval_sweep_full.jsonl (full attention) from a results folder; writes a PNG.

  python3 ops/evalmodel/plot_sweeps.py bench/results/2026-11-21-evalmodel docs/img/evalmodel_sweeps.png
"""
import glob
import json
import os
import sys


def load(path):
    lines = [json.loads(l) for l in open(path) if l.strip()]
    acc = next(l["accuracy"] for l in lines if l.get("task") == "all")
    summ = next(l for l in lines if l.get("summary"))
    return acc, summ


def main(argv):
    folder, png = argv
    full, _ = load(os.path.join(folder, "eval_sweep_full.jsonl"))
    base, bs = load(os.path.join(folder, "eval_sweep_base.jsonl"))
    budgets = [(bs["budget_fraction"], base)]
    ranks = [(bs["rank"], base)]
    for p in glob.glob(os.path.join(folder, "eval_sweep_b0*.jsonl")):
        a, s = load(p)
        budgets.append((s["budget_fraction"], a))
    for p in glob.glob(os.path.join(folder, "eval_sweep_r*.jsonl")):
        a, s = load(p)
        ranks.append((s["rank"], a))
    budgets.sort()
    ranks.sort()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    ax[0].plot([100 * b for b, _ in budgets], [100 * a for _, a in budgets], "o-", label="ShadowKV, rank 40")
    ax[0].set_xscale("log")
    ax[0].set_xlabel("sparse budget (% of the 16K context)")
    ax[1].plot([r for r, _ in ranks], [100 * a for _, a in ranks], "o-", label="ShadowKV, budget 1.56%")
    ax[1].set_xscale("log", base=2)
    ax[1].set_xlabel("rank of the pre-RoPE key factors (of h_kv*d = 256)")
    ax[0].set_ylabel("accuracy over the 8 tasks (%)")
    for a in ax:
        a.axhline(100 * full, color="k", ls="--", lw=1, label="full attention")
        a.grid(alpha=0.3)
        a.legend(loc="lower right")
        a.set_ylim(0, 100)
    fig.suptitle("penumbra-eval, 16K tokens, 10 records per task (110 answers), bf16 on an H200")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(json.dumps({"full": full, "budgets": budgets, "ranks": ranks}))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""Singular-value decay of pre-RoPE vs post-RoPE keys (ShadowKV paper, Figure 2).

Runs held-out natural text through the model (Hugging Face transformers, the
independent reference), captures every layer's key projection output (the
pre-RoPE keys, all KV heads side by side: [S, hkv*d]), applies the model's own
RoPE at the true positions to get the post-RoPE keys, and computes the
singular values of both matrices in float32.

Writes one JSON object (per layer: normalized singular values, the energy kept
by the paper's relative ranks and the relative reconstruction error at those
ranks) and, when matplotlib is present, a PNG like the paper's Figure 2.

  python3 ops/evalmodel/analyze_keys.py --model build-evalmodel/run/model \\
      --corpus build-evalmodel/data/corpus-heldout.txt.xz --tokens 16384 \\
      --out build-evalmodel/keys.json --png build-evalmodel/keys.png
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import tasks  # noqa: E402  (corpus reader)


def rope(x, inv_freq, positions):
    """Rotate-half RoPE (Hugging Face Llama) of x [S, heads, d] at positions [S]."""
    import torch

    ang = positions.float()[:, None] * inv_freq.float()[None, :]  # [S, d/2]
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rot * sin


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--corpus", required=True, help="held-out text (.txt or .txt.xz)")
    ap.add_argument("--tokens", type=int, default=16384, help="sequence length")
    ap.add_argument("--samples", type=int, default=2, help="independent text windows (averaged)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--ranks", default="0.0625,0.125,0.16,0.25,0.5",
                    help="ranks to report, as fractions of hkv*d")
    ap.add_argument("--out", required=True)
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)

    import random

    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model = model.cuda().eval()
    cfg = model.config
    hkv = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inv_freq = model.model.rotary_emb.inv_freq.detach().float().cuda()
    D = hkv * d
    ranks = [max(1, round(float(f) * D)) for f in args.ranks.split(",")]

    text = tasks.load_text(args.corpus)
    rng = random.Random(args.seed)
    captured = {}

    def hook(layer):
        def f(_mod, _inp, out):
            captured[layer] = out.detach()[0].float()  # [S, hkv*d]
        return f

    handles = [l.self_attn.k_proj.register_forward_hook(hook(i)) for i, l in enumerate(model.model.layers)]
    per_layer = {i: {"pre": [], "post": []} for i in range(len(model.model.layers))}
    for _ in range(args.samples):
        # A window of natural text long enough for --tokens tokens.
        off = rng.randrange(0, max(1, len(text) - args.tokens * 8))
        ids = tok.encode(text[off:off + args.tokens * 8]).ids[:args.tokens]
        if len(ids) < args.tokens:
            sys.exit(f"held-out text too short for {args.tokens} tokens")
        with torch.inference_mode():
            t = torch.tensor([ids], device="cuda")
            try:
                model(input_ids=t, use_cache=False, logits_to_keep=1)
            except TypeError:
                model(input_ids=t, use_cache=False)
            pos = torch.arange(args.tokens, device="cuda")
            for i, k in captured.items():
                post = rope(k.view(args.tokens, hkv, d), inv_freq, pos).reshape(args.tokens, D)
                per_layer[i]["pre"].append(torch.linalg.svdvals(k).cpu())
                per_layer[i]["post"].append(torch.linalg.svdvals(post).cpu())
    for h in handles:
        h.remove()

    def summary(svs):
        s = torch.stack(svs).mean(0)
        e = (s ** 2).cumsum(0) / (s ** 2).sum()
        return {
            "normalized": [round(float(x), 6) for x in (s / s[0])],
            "energy_at_rank": {str(r): round(float(e[r - 1]), 6) for r in ranks},
            # Relative Frobenius error of the best rank-r approximation.
            "rel_error_at_rank": {str(r): round(float(((s[r:] ** 2).sum() / (s ** 2).sum()).sqrt()), 6)
                                  for r in ranks},
        }

    result = {"model": os.path.abspath(args.model), "tokens": args.tokens, "samples": args.samples,
              "hkv": hkv, "head_dim": d, "ranks": ranks, "layers": []}
    for i in sorted(per_layer):
        result["layers"].append({"layer": i, "pre_rope": summary(per_layer[i]["pre"]),
                                 "post_rope": summary(per_layer[i]["post"])})
    for key in ("pre_rope", "post_rope"):
        result[f"mean_{key}_energy_at_rank"] = {
            str(r): round(sum(l[key]["energy_at_rank"][str(r)] for l in result["layers"]) / len(result["layers"]), 6)
            for r in ranks}
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({k: v for k, v in result.items() if k.startswith("mean_") or k in ("tokens", "ranks")}))

    if args.png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not present: no PNG", file=sys.stderr)
            return 0
        fig, ax = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for a, key, title in ((ax[0], "pre_rope", "pre-RoPE keys"), (ax[1], "post_rope", "post-RoPE keys")):
            for l in result["layers"]:
                a.plot(l[key]["normalized"], label=f"layer {l['layer']}", lw=1)
            a.set_yscale("log")
            a.set_xlabel("singular value index")
            a.set_title(title)
            a.grid(alpha=0.3)
        ax[0].set_ylabel("singular value / largest")
        ax[1].legend(fontsize=7, ncol=2)
        fig.suptitle(f"Key singular values, {args.tokens} held-out tokens (hkv*d = {D})")
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())

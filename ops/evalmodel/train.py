#!/usr/bin/env python3
"""Trains Penumbra's long-context evaluation model (issue 4) on the GPU machine.

A small Llama (transformers LlamaForCausalLM, from scratch) with a byte-level
BPE tokenizer trained on the Debian text corpus, mixed with synthetic
long-context tasks from tasks.py, with a sequence-length curriculum up to 16K.

The run is a pure function of (--seed, arguments, corpus): the tokenizer, the
token cache and every batch (a function of the step number only) are
deterministic, so a run can be stopped and resumed across device calls:

  python3 ops/evalmodel/train.py --corpus build-evalmodel/data/corpus-train.txt.xz \\
      --out build-evalmodel/run --max-minutes 9

  # repeat the same command until it prints "done"; then the model is in
  # build-evalmodel/run/model (config.json, model*.safetensors, tokenizer.json).

State kept in --out (must persist between calls; ignored by git):
  tokenizer.json       trained once
  corpus_tokens.npy    the tokenized corpus (uint16), made once
  state.pt             model + optimizer + step (saved every --save-minutes and
                       at the end of each call)
  loss.csv             one line per step
  loss.png             loss curves (written at the end)
  model/               the exported Hugging Face model (at the last step)

--estimate runs a few steps at every curriculum length and prints the
projected minutes for --total-steps, without touching the state.
"""

import argparse
import csv
import json
import math
import multiprocessing as mp
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import tasks  # noqa: E402  (our generator; pure Python)

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"


# Model shapes. "eval" is the first evaluation model (models/penumbra-eval,
# issue 4); "paper" is the second (issue 20), of the shape ShadowKV was
# designed for: 8 KV heads x head_dim 128 (1024 key dimensions per layer),
# GQA 4 (32 query heads), about 109M parameters, trained to 32K. Its hidden
# size (1024) is narrower than its query width (4096): the parameter count
# stays near 100M while the attention keeps the paper's geometry.
PRESETS = {
    "eval": {},
    "paper": dict(hidden=1024, layers=6, heads=32, kv_heads=8, head_dim=128, intermediate=2048,
                  max_positions=65536, lr=1e-3, warmup=200,
                  curriculum="0:1024,0.12:2048,0.25:4096,0.42:8192,0.62:16384,0.8:32768"),
}


def parse_args(argv=None):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(PRESETS), default="eval")
    preset = pre.parse_known_args(argv)[0].preset
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="eval",
                    help="model shape and schedule defaults (explicit flags still win)")
    ap.add_argument("--corpus", required=True, help="corpus-train.txt.xz from prepare_corpus.sh")
    ap.add_argument("--out", required=True, help="state/output directory (persistent)")
    ap.add_argument("--seed", type=int, default=1234)
    # Tokenizer.
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--tokenizer-train-chars", type=int, default=30_000_000)
    ap.add_argument("--tokenizer", default="",
                    help="use this tokenizer.json instead of training one (e.g. the first model's, "
                         "so that both models read the same task sets)")
    # Resuming from exported weights (another session's machine: the optimizer
    # state does not travel, see --init-from).
    ap.add_argument("--init-from", default="",
                    help="when --out has no state: start from this exported model directory "
                         "(its training_state.json names the step and the schedule), with fresh "
                         "optimizer moments")
    ap.add_argument("--rewarmup", type=int, default=100,
                    help="after --init-from, steps over which the LR ramps back up to the schedule's")
    # Model.
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=1280)
    ap.add_argument("--rope-theta", type=float, default=1_000_000.0)
    ap.add_argument("--max-positions", type=int, default=32768)
    ap.add_argument("--untie", action="store_true", help="separate lm_head (default: tied)")
    # Optimization.
    ap.add_argument("--total-steps", type=int, default=1800)
    ap.add_argument("--tokens-per-step", type=int, default=131072)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--task-weight", type=float, default=1.0,
                    help="weight of the answer-token loss relative to the LM loss")
    ap.add_argument("--task-frac", type=float, default=0.8,
                    help="fraction of sequences that start with a synthetic task sample")
    ap.add_argument("--curriculum", default="0:1024,0.25:2048,0.45:4096,0.65:8192,0.82:16384",
                    help="comma list of start_fraction:seq_len")
    # Running.
    ap.add_argument("--max-minutes", type=float, default=9.0,
                    help="wall budget of this call; saves and exits before it")
    ap.add_argument("--save-minutes", type=float, default=3.0)
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--prefetch", type=int, default=24)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--max-shard-size", default="15MB",
                    help="safetensors shard size (device file transfers allow 16 MiB a file)")
    ap.add_argument("--auto-minutes", type=float, default=0.0,
                    help="on a fresh run, time a few steps at every curriculum length and set "
                         "--total-steps so that training takes about this many minutes; the choice "
                         "is kept in --out/schedule.json and reused by every later call")
    ap.add_argument("--export-at-deadline", action="store_true",
                    help="if this call ends before the last step, export the current weights "
                         "anyway (training_args.json records the step); for the last call of a budget")
    ap.add_argument("--prepare-only", action="store_true",
                    help="train the tokenizer and build the token cache, then exit")
    ap.add_argument("--estimate", action="store_true",
                    help="time a few steps per curriculum length, print projection, exit")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model and steps, for checking the pipeline (uses --out as is)")
    ap.set_defaults(**PRESETS[preset])
    args = ap.parse_args(argv)
    if args.smoke:
        # head_dim 64 as in the real model, so the smoke export runs through
        # the same engine kernels.
        args.hidden, args.layers, args.intermediate = 256, 2, 512
        args.heads, args.kv_heads, args.head_dim = 4, 2, 64
        args.total_steps, args.tokens_per_step = 40, 16384
        args.curriculum = "0:1024,0.5:4096"
        args.tokenizer_train_chars = 3_000_000
        args.warmup = 5
    return args


def curriculum(args):
    out = []
    for part in args.curriculum.split(","):
        f, L = part.split(":")
        out.append((float(f), int(L)))
    out.sort()
    return out


def seq_len_at(args, step):
    L = curriculum(args)[0][1]
    for f, l in curriculum(args):
        if step >= int(f * args.total_steps):
            L = l
    return L


def lr_at(args, step):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = (step - args.warmup) / max(1, args.total_steps - args.warmup)
    p = min(1.0, p)
    m = args.min_lr_frac
    lr = args.lr * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p)))
    # After --init-from the Adam moments start from zero: ramp back up.
    r0 = getattr(args, "rewarm_from", None)
    if r0 is not None and args.rewarmup > 0 and r0 <= step < r0 + args.rewarmup:
        lr *= (step - r0 + 1) / args.rewarmup
    return lr


# --------------------------------------------------------------------------
# Corpus, tokenizer, token cache.


def load_docs(path):
    text = tasks.load_text(path)
    return [d for d in text.split("\n\x1e\n") if d.strip()]


def train_tokenizer(args, docs, path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # Deterministic subsample: every k-th document up to the char budget.
    total = sum(len(d) for d in docs)
    stride = max(1, int(math.ceil(total / args.tokenizer_train_chars)))
    sample = docs[::stride]
    tok.train_from_iterator(sample, trainer=trainer, length=len(sample))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    tok.save(path)
    print(f"tokenizer: vocab={tok.get_vocab_size()} trained on {len(sample)} docs", flush=True)


def build_token_cache(tok, docs, path):
    import numpy as np

    sep = tok.encode("\n\n", add_special_tokens=False).ids
    parts = []
    B = 256
    for i in range(0, len(docs), B):
        for enc in tok.encode_batch(docs[i:i + B], add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.uint16))
            parts.append(np.asarray(sep, dtype=np.uint16))
    arr = np.concatenate(parts)
    np.save(path, arr)
    print(f"token cache: {arr.size:,d} tokens", flush=True)


# --------------------------------------------------------------------------
# Batches (worker processes; each batch is a function of the step only).

_W = {}


def _worker_init(tok_path, corpus_text, tokens_path):
    import numpy as np
    from tokenizers import Tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _W["tok"] = Tokenizer.from_file(tok_path)
    _W["counter"] = tasks.HFTokenCounter(tok_path)
    _W["hay"] = tasks.Haystack(corpus_text)
    _W["tokens"] = np.load(tokens_path, mmap_mode="r")
    _W["bos"] = _W["tok"].token_to_id(BOS)
    _W["pad"] = _W["tok"].token_to_id(PAD)


def build_batch(args, step):
    import numpy as np

    t_gen0 = time.time()
    tok, counter, hay, corpus = _W["tok"], _W["counter"], _W["hay"], _W["tokens"]
    L = seq_len_at(args, step)
    B = max(1, args.tokens_per_step // L)
    rng = random.Random(f"{args.seed}:batch:{step}")
    ids = np.full((B, L), _W["pad"], dtype=np.int64)
    lm = np.zeros((B, L), dtype=np.bool_)    # LM loss on predicting this token
    ans = np.zeros((B, L), dtype=np.bool_)   # task loss on predicting this token
    kinds = {}
    for b in range(B):
        pos = 0
        if rng.random() < args.task_frac:
            # Task lengths: half full-length, half spread over shorter ones.
            if rng.random() < 0.5:
                tl = L
            else:
                tl = rng.randint(min(L, 512), L)
            text, spans, kind = tasks.make_train_sample(rng, hay, counter, tl)
            kinds[kind] = kinds.get(kind, 0) + 1
            enc = tok.encode(text)  # BOS + text
            enc_ids = enc.ids            # (each property access converts the whole list:
            offs = np.asarray(enc.offsets, dtype=np.int64)  # read them once)
            n = min(len(enc_ids), L)
            ids[b, :n] = enc_ids[:n]
            # A token is an answer token when its characters overlap an answer span.
            in_ans = np.zeros(n, dtype=np.bool_)
            for a0, a1 in spans:
                in_ans |= (offs[:n, 0] < a1) & (offs[:n, 1] > a0)
            in_ans[0] = False  # BOS
            ans[b, 1:n] = in_ans[1:n]
            if kind in ("niah", "vt"):  # natural-text haystacks also train the LM
                lm[b, 1:n] = ~in_ans[1:n]
            pos = n
        if pos < L:
            need = L - pos - 1
            off = rng.randrange(0, max(1, corpus.shape[0] - need - 1))
            ids[b, pos] = _W["bos"]
            ids[b, pos + 1:L] = corpus[off:off + need]
            lm[b, pos + 1:L] = True
    kinds["_gen_s"] = round(time.time() - t_gen0, 3)
    return step, ids, lm, ans, kinds


class Batches:
    """Ordered, prefetched batches for steps [start, end) from a process pool."""

    def __init__(self, args, tok_path, corpus_text, tokens_path, start, end):
        ctx = mp.get_context("fork")
        self.pool = ctx.Pool(args.workers, initializer=_worker_init,
                             initargs=(tok_path, corpus_text, tokens_path))
        self.args, self.next_submit, self.end = args, start, end
        self.pending = {}
        for _ in range(args.prefetch):
            self._submit()

    def _submit(self):
        if self.next_submit < self.end:
            s = self.next_submit
            self.pending[s] = self.pool.apply_async(build_batch, (self.args, s))
            self.next_submit += 1

    def get(self, step):
        r = self.pending.pop(step).get()
        self._submit()
        return r

    def close(self):
        self.pool.terminate()
        self.pool.join()


# --------------------------------------------------------------------------
# Model.


def make_config(args, tok):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_positions,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=not args.untie,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
        initializer_range=0.02,
    )
    import inspect

    params = inspect.signature(LlamaConfig.__init__).parameters
    if "rope_parameters" in params:  # transformers >= 5
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": args.rope_theta}
    else:
        kw["rope_theta"] = args.rope_theta
    cfg = LlamaConfig(**kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def rope_theta_of(cfg):
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        return rp["rope_theta"]
    return getattr(cfg, "rope_theta", None)


def param_groups(model, wd):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "embed" not in n else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def compute_loss(model, ids, lm, ans, task_weight):
    import torch
    import torch.nn.functional as F

    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=ids, use_cache=False).logits
    logits = logits[:, :-1].float()
    tgt = ids[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1),
                         reduction="none").view_as(tgt)
    lm_m = lm[:, 1:].float()
    an_m = ans[:, 1:].float()
    n_lm = lm_m.sum().clamp(min=1)
    n_an = an_m.sum().clamp(min=1)
    lm_loss = (ce * lm_m).sum() / n_lm
    an_loss = (ce * an_m).sum() / n_an
    with torch.no_grad():
        hit = (logits.argmax(-1) == tgt).float()
        an_acc = (hit * an_m).sum() / n_an
    loss = lm_loss + task_weight * an_loss if an_m.sum() > 0 else lm_loss
    return loss, lm_loss.detach(), an_loss.detach(), an_acc, int(an_m.sum().item())


# --------------------------------------------------------------------------
# Export and plot.


def export(args, model, tok_path, out_dir, step):
    import torch
    from transformers import AutoConfig, PreTrainedTokenizerFast

    os.makedirs(out_dir, exist_ok=True)
    m = model._orig_mod if hasattr(model, "_orig_mod") else model
    m = m.to(torch.bfloat16)
    m.config.use_cache = True
    m.save_pretrained(out_dir, safe_serialization=True, max_shard_size=args.max_shard_size)
    m.to(torch.float32)
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=tok_path, bos_token=BOS, eos_token=EOS,
                                     pad_token=PAD)
    hf_tok.save_pretrained(out_dir)
    # Readers other than transformers (our C++ loader) look for a top-level
    # rope_theta; keep it next to transformers 5's rope_parameters if the
    # reloaded config still agrees.
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if "rope_theta" not in cfg:
        cfg2 = dict(cfg, rope_theta=args.rope_theta)
        with open(cfg_path, "w") as f:
            json.dump(cfg2, f, indent=2, sort_keys=True)
        try:
            back = AutoConfig.from_pretrained(out_dir)
            ok = abs(float(rope_theta_of(back)) - args.rope_theta) < 1e-3
        except Exception as e:  # noqa: BLE001
            print(f"config reload failed with rope_theta added: {e}", flush=True)
            ok = False
        if not ok:
            with open(cfg_path, "w") as f:
                json.dump(cfg, f, indent=2, sort_keys=True)
    with open(os.path.join(out_dir, "training_args.json"), "w") as f:
        json.dump(vars(args), f, indent=2, sort_keys=True)
    # What --init-from needs to continue on another machine.
    with open(os.path.join(out_dir, "training_state.json"), "w") as f:
        json.dump({"step": step, "total_steps": args.total_steps,
                   "auto_minutes": args.auto_minutes, "preset": args.preset}, f, indent=2)
    csv_path = os.path.join(args.out, "loss.csv")
    if os.path.exists(csv_path):
        import shutil

        shutil.copyfile(csv_path, os.path.join(out_dir, "loss.csv"))
    print(f"exported to {out_dir}: " + ", ".join(sorted(os.listdir(out_dir))), flush=True)


def plot(args, csv_path, png_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(csv_path)))
    if not rows:
        return
    step = [int(r["step"]) for r in rows]

    def smooth(xs, k=25):
        out, acc, q = [], 0.0, []
        for x in xs:
            q.append(x)
            acc += x
            if len(q) > k:
                acc -= q.pop(0)
            out.append(acc / len(q))
        return out

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    lm = [float(r["lm_loss"]) for r in rows]
    an = [float(r["task_loss"]) for r in rows]
    acc = [float(r["task_acc"]) for r in rows]
    ax[0].plot(step, smooth(lm), label="LM loss (natural text)")
    ax[0].plot(step, smooth(an), label="task answer loss")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("cross-entropy (nats/token)")
    ax[0].set_yscale("log")
    ax[1].plot(step, smooth(acc), color="C2", label="answer token accuracy")
    ax[1].set_xlabel("step")
    ax[1].set_ylim(0, 1)
    for a in ax:
        for f, L in curriculum(args)[1:]:
            a.axvline(int(f * args.total_steps), color="grey", lw=0.6, ls="--")
            a.text(int(f * args.total_steps), a.get_ylim()[1], f" {L // 1024}K",
                   va="top", fontsize=8, color="grey")
        a.legend(loc="best")
        a.grid(alpha=0.3)
    fig.suptitle("Penumbra evaluation model: training curves (smoothed over 25 steps)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    print(f"wrote {png_path}", flush=True)


# --------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    deadline = t_start + args.max_minutes * 60
    os.makedirs(args.out, exist_ok=True)
    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    tok_path = os.path.join(args.out, "tokenizer.json")
    tokens_path = os.path.join(args.out, "corpus_tokens.npy")
    state_path = os.path.join(args.out, "state.pt")
    csv_path = os.path.join(args.out, "loss.csv")

    docs = load_docs(args.corpus)
    print(f"corpus: {len(docs)} docs, {sum(len(d) for d in docs):,d} chars "
          f"({time.time() - t_start:.0f}s)", flush=True)
    if not os.path.exists(tok_path) and args.tokenizer:
        import shutil

        shutil.copyfile(args.tokenizer, tok_path)
        print(f"tokenizer: {args.tokenizer}", flush=True)
    if not os.path.exists(tok_path):
        train_tokenizer(args, docs, tok_path)
        print(f"tokenizer trained ({time.time() - t_start:.0f}s)", flush=True)
    tok = Tokenizer.from_file(tok_path)
    if not os.path.exists(tokens_path):
        build_token_cache(tok, docs, tokens_path)
        print(f"token cache built ({time.time() - t_start:.0f}s)", flush=True)
    if args.prepare_only:
        return
    corpus_text = "\n\n".join(docs)
    del docs

    # Worker processes are forked before CUDA is initialized in this process.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    start, st = 0, None
    if os.path.exists(state_path) and not args.estimate:
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        start = st["step"]
    sched_path = os.path.join(args.out, "schedule.json")
    init = None
    if st is None and args.init_from and not args.estimate:
        # Another machine's export: weights (bf16), step and schedule; the
        # optimizer moments restart (with --rewarmup).
        with open(os.path.join(args.init_from, "training_state.json")) as f:
            init = json.load(f)
        start = int(init["step"])
        with open(sched_path, "w") as f:
            json.dump({"total_steps": int(init["total_steps"]), "auto_minutes": init.get("auto_minutes"),
                       "rewarm_from": start}, f)
        csv_src = os.path.join(args.init_from, "loss.csv")
        if os.path.exists(csv_src) and not os.path.exists(csv_path):
            import shutil

            shutil.copyfile(csv_src, csv_path)
    auto = False
    if os.path.exists(sched_path) and not args.estimate:
        with open(sched_path) as f:
            sched = json.load(f)
        args.total_steps = int(sched["total_steps"])
        if sched.get("rewarm_from") is not None:
            args.rewarm_from = int(sched["rewarm_from"])
        print(f"schedule: {args.total_steps} steps (from {sched_path})", flush=True)
    elif args.auto_minutes > 0 and not args.estimate:
        if st is not None:
            sys.exit(f"{state_path} exists but {sched_path} does not: cannot resume an auto schedule")
        auto = True
    # Batches for timing are made before CUDA is initialized in this process.
    pre = pregenerate_for_estimate(args, tok_path, corpus_text, tokens_path) if (args.estimate or auto) else None

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed % (2**32))
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = torch.device("cuda")

    cfg = make_config(args, tok)
    model = LlamaForCausalLM(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M params, rope_theta={rope_theta_of(model.config)}, "
          f"attn={getattr(model.config, '_attn_implementation', '?')}", flush=True)
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr,
                            betas=(0.9, 0.95), eps=1e-8, fused=True)
    if st is not None:
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        del st
        print(f"resumed at step {start}", flush=True)
    elif init is not None:
        src = LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
        # A tied lm_head is not in the files; anything else missing is an error.
        missing = [k for k in missing if not (k == "lm_head.weight" and not args.untie)]
        if missing or unexpected:
            sys.exit(f"{args.init_from}: weights do not match the model: missing {missing}, "
                     f"unexpected {unexpected}")
        del src
        print(f"initialized from {args.init_from} at step {start} (optimizer moments fresh, "
              f"LR re-warmed over {args.rewarmup} steps)", flush=True)
    fwd = torch.compile(model) if args.compile else model

    if args.estimate:
        return estimate(args, fwd, opt, pre)
    if auto:
        args.total_steps = auto_total_steps(args, fwd, opt, pre)
        with open(sched_path, "w") as f:
            json.dump({"total_steps": args.total_steps, "auto_minutes": args.auto_minutes}, f)
        del pre
    # Workers fork from a process that already holds CUDA; they never touch it.
    batches = Batches(args, tok_path, corpus_text, tokens_path, start, args.total_steps)

    if start >= args.total_steps:
        print("already at the last step", flush=True)
    # Drop CSV rows from steps that will be redone after a resume.
    if os.path.exists(csv_path):
        rows = [r for r in csv.DictReader(open(csv_path)) if int(r["step"]) < start]
    else:
        rows = []
    fields = ["step", "seq_len", "lr", "loss", "lm_loss", "task_loss", "task_acc",
              "answer_tokens", "tok_per_s", "elapsed_s"]
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    csv_f = open(csv_path, "a", newline="")
    csv_w = csv.DictWriter(csv_f, fieldnames=fields)

    def save(step):
        tmp = state_path + ".tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "args": vars(args)}, tmp)
        os.replace(tmp, state_path)
        csv_f.flush()
        print(f"saved state at step {step} ({time.time() - t_start:.0f}s)", flush=True)

    step = start
    last_save = time.time()
    step_time = 2.0
    model.train()
    try:
        while step < args.total_steps:
            # Leave room for one more step and the save.
            if time.time() + 2.5 * step_time + 15 > deadline:
                break
            t0 = time.time()
            _, ids, lm, ans, kinds = batches.get(step)
            ids_t = torch.from_numpy(ids).to(dev, non_blocking=True)
            lm_t = torch.from_numpy(lm).to(dev, non_blocking=True)
            an_t = torch.from_numpy(ans).to(dev, non_blocking=True)
            lr = lr_at(args, step)
            for g in opt.param_groups:
                g["lr"] = lr
            loss, lm_loss, an_loss, an_acc, n_ans = compute_loss(fwd, ids_t, lm_t, an_t,
                                                                 args.task_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            vals = torch.stack([loss.detach(), lm_loss, an_loss, an_acc]).tolist()
            dt = time.time() - t0
            step_time = 0.8 * step_time + 0.2 * dt if step > start else dt
            row = {"step": step, "seq_len": ids.shape[1], "lr": f"{lr:.6g}",
                   "loss": f"{vals[0]:.5f}", "lm_loss": f"{vals[1]:.5f}",
                   "task_loss": f"{vals[2]:.5f}", "task_acc": f"{vals[3]:.4f}",
                   "answer_tokens": n_ans, "tok_per_s": int(ids.size / max(dt, 1e-6)),
                   "elapsed_s": f"{time.time() - t_start:.1f}"}
            csv_w.writerow(row)
            if step % 25 == 0 or step == args.total_steps - 1:
                print(f"step {step} L={ids.shape[1]} lr={lr:.2e} loss={vals[0]:.4f} "
                      f"lm={vals[1]:.4f} task={vals[2]:.4f} acc={vals[3]:.3f} "
                      f"{ids.size / max(dt, 1e-6) / 1e3:.0f}K tok/s kinds={kinds}", flush=True)
            step += 1
            if time.time() - last_save > args.save_minutes * 60 and step < args.total_steps:
                save(step)
                last_save = time.time()
    finally:
        batches.close()
    save(step)
    csv_f.close()
    finished = step >= args.total_steps
    if finished or args.export_at_deadline:
        if not finished:
            args.stopped_at_step = step
            print(f"exporting at step {step}/{args.total_steps} (--export-at-deadline)", flush=True)
        export(args, model, tok_path, os.path.join(args.out, "model"), step)
        try:
            plot(args, csv_path, os.path.join(args.out, "loss.png"))
        except Exception as e:  # noqa: BLE001  (a missing plotting library must not lose the model)
            print(f"plot failed: {e}", flush=True)
    if finished:
        print("done", flush=True)
    else:
        print(f"stopped at step {step}/{args.total_steps}: run again to resume", flush=True)


def pregenerate_for_estimate(args, tok_path, corpus_text, tokens_path):
    """{seq_len: (n_steps_in_phase, wall_seconds_per_batch, [batches])}: the first few
    batches of every curriculum phase, made by one worker pool."""
    lens = sorted({L for _, L in curriculum(args)})
    steps_at = {L: 0 for L in lens}
    for s in range(args.total_steps):
        steps_at[seq_len_at(args, s)] += 1
    ctx = mp.get_context("fork")
    pool = ctx.Pool(args.workers, initializer=_worker_init, initargs=(tok_path, corpus_text, tokens_path))
    t0 = time.time()
    pending = {}
    for L in lens:
        if steps_at[L] == 0:
            continue
        first = next(s for s in range(args.total_steps) if seq_len_at(args, s) == L)
        n = min(4, steps_at[L])
        pending[L] = [pool.apply_async(build_batch, (args, first + i)) for i in range(n)]
    out = {}
    for L, rs in pending.items():
        got = [r.get() for r in rs]
        out[L] = (steps_at[L], (time.time() - t0) / len(got), got)
    pool.terminate()
    pool.join()
    print(f"timing batches made in {time.time() - t0:.0f}s", flush=True)
    return out


def _time_fwd_bwd(args, model, opt, got):
    import torch

    dev = torch.device("cuda")
    times = []
    for _, ids, lm, ans, _ in got:
        torch.cuda.synchronize()
        t0 = time.time()
        loss, *_ = compute_loss(model, torch.from_numpy(ids).to(dev), torch.from_numpy(lm).to(dev),
                                torch.from_numpy(ans).to(dev), args.task_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.cuda.synchronize()
        times.append(time.time() - t0)
    opt.zero_grad(set_to_none=True)
    rest = times[1:] or times  # the first call pays one-time costs
    return sorted(rest)[len(rest) // 2]


def auto_total_steps(args, model, opt, pre):
    """Steps that fit --auto-minutes: per curriculum length, a step costs the larger of
    the GPU's forward+backward (+5% for the optimizer and logging) and the batch
    generation time divided by the workers."""
    per_len = {}
    for L, (_, _, got) in sorted(pre.items()):
        t_gpu = _time_fwd_bwd(args, model, opt, got) * 1.05
        gens = [k.get("_gen_s", 0.0) for *_, k in got]
        t_gen = (sum(gens) / max(1, len(gens))) / max(1, args.workers)
        per_len[L] = max(t_gpu, t_gen)
        print(f"auto: L={L}: {t_gpu:.3f} s/step on the GPU, {t_gen:.3f} s/step of batch generation",
              flush=True)
    cur = curriculum(args) + [(1.0, None)]
    per_step = sum((cur[i + 1][0] - cur[i][0]) * per_len[cur[i][1]] for i in range(len(cur) - 1))
    n = max(args.warmup + 10, int(args.auto_minutes * 60 / per_step))
    print(f"auto: {n} steps ({n * args.tokens_per_step / 1e6:.0f}M tokens) for "
          f"{args.auto_minutes:.1f} min at {per_step:.3f} s/step on average", flush=True)
    return n


def estimate(args, model, opt, pre):
    import torch

    dev = torch.device("cuda")
    total = 0.0
    for L, (n_steps, t_gen, got) in sorted(pre.items()):
        times = []
        for _, ids, lm, ans, _ in got:
            torch.cuda.synchronize()
            t0 = time.time()
            ids_t = torch.from_numpy(ids).to(dev)
            loss, *_ = compute_loss(model, ids_t, torch.from_numpy(lm).to(dev),
                                    torch.from_numpy(ans).to(dev), args.task_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.cuda.synchronize()
            times.append(time.time() - t0)
        t = sorted(times[1:] or times)[len(times[1:] or times) // 2]
        total += max(t, t_gen) * n_steps
        mem = torch.cuda.max_memory_allocated() / 2**30
        print(f"L={L}: {t:.3f} s/step fwd+bwd, batch generation {t_gen:.3f} s/batch "
              f"({args.workers} workers, incl. pool start), {n_steps} steps, "
              f"peak mem {mem:.1f} GiB", flush=True)
    print(f"projected training time: {total / 60:.1f} min for {args.total_steps} steps "
          f"(+ tokenizer/cache on a fresh machine)", flush=True)


if __name__ == "__main__":
    main()

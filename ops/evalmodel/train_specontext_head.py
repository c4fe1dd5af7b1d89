#!/usr/bin/env python3
"""Distills the SpeContext retrieval head of the evaluation model on the GPU machine.

SpeContext ("speculative context sparsity") chooses, before a decode step, the
tokens that every layer of the target model attends to, with a cheap
"retrieval head": the attention of a distilled language model (DLM) of one
decoder layer. This script trains that DLM against the target model (the
teacher, models/penumbra-eval) and exports its head.

  student   LlamaForCausalLM with the teacher's config but one decoder layer,
            initialized from the teacher: embedding, layer 0 (all of it),
            final norm, lm_head (tied to the embedding). The embedding and
            lm_head are frozen: the head reads the target model's own
            embedding table at inference, so they must not move (checked
            bit for bit at the export).
  loss      KL(teacher || student) of the next-token distributions at every
            position (teacher: a no-grad bf16 forward; student: bf16
            autocast; the KL in f32), plus --ce-weight times the student's
            next-token cross-entropy (default 0: pure distillation).
  data      train.py's mix: --task-frac of the sequences start with a
            synthetic long-context sample from tasks.py (needles, variable
            tracking, key-value, common words), the rest of every sequence is
            plain text after a BOS. The plain text and the needle haystacks are
            the source files of Python's standard library (path order; the
            same on every machine with the same Python version), tokenized
            with the teacher's tokenizer; every --holdout-every-th file is kept
            for the evaluation. The evaluation haystack
            tests/data/evaltasks/haystack_kjv.txt is never read. 2048-token,
            then 4096-token sequences (--curriculum, by fraction of the planned
            steps), about 64K tokens a step. A batch is a function of
            (--seed, step, sequence length), made by worker processes.
  schedule  AdamW, linear warmup then cosine decay over the planned steps. The
            plan is --steps, unless timing the first --calib-steps steps says
            they do not fit in --max-minutes; then as many as fit (train.json
            records the plan: the same --steps and enough minutes repeat the
            run). A run that still reaches the deadline stops early.
  eval      after the export, on --eval-samples held-out task records of
            --eval-len tokens (BOS + the prompt up to the first "A:"): for
            every teacher layer, the attention weights of the last position's
            queries over all tokens (softmax per query head, then the max over
            the query heads of each KV group: [kv_heads, T]); the same for the
            exported head, read back from head.safetensors and run on the
            teacher's embedding table. Reported per budget B (--eval-budgets):
            the recall of the teacher's top-B tokens (per KV head) within the
            head's top-B, averaged over layers, KV heads and samples, and the
            share of the teacher's attention mass on the head's top-B
            ("oracle_mass": on the teacher's own top-B). Besides "head" (plain
            RoPE, as trained): "head_yarn", the same head with the positions
            scaled by YaRN at the factor the engine gives a sequence of the
            model's whole context (max_position_embeddings over
            trained_context; the engine scales each sequence by its own length
            over trained_context, so the records here, of the trained length,
            run at "head"'s plain RoPE): what that scaling costs a head on
            positions it knows; and two baselines: "recent", the B
            most recent tokens, and "untrained_head", the teacher's own layer 0
            (the student's starting point; it reads the embedding too, and
            scores 1 on layer 0 by construction).

  python3 ops/evalmodel/train_specontext_head.py --teacher models/penumbra-eval \\
      --out build-evalmodel/specontext [--max-minutes 6] [--seed 7]

  # pipeline check (a few short steps, under a minute; --cpu-ok allows a run
  # without a GPU):
  python3 ops/evalmodel/train_specontext_head.py --teacher models/penumbra-eval \\
      --out /tmp/specontext-smoke --smoke

--max-minutes bounds the whole call (setup, training, export, evaluation).
Outputs in --out: head.safetensors, train.json (arguments, steps, final loss,
minutes), eval.json (the JSON line printed at the end), loss.csv (per step).

head.safetensors is the contract with the C++ engine: bf16 tensors
`norm.weight` [hidden] (the layer's input RMSNorm weight), `q_proj.weight`
[num_heads*head_dim, hidden], `k_proj.weight` [num_kv_heads*head_dim, hidden],
and string metadata format="penumbra-specontext-head v1", hidden_size,
num_heads, num_kv_heads, head_dim, rope_theta, rms_norm_eps, vocab_size,
trained_context (the longest training sequence), embedding="target" (the head
has no embedding of its own: it reads the target model's table), teacher (the
teacher's name and config hash), steps, seed. For a token t at position p:
x = embed[t]; n = x * rsqrt(mean(x^2) + rms_norm_eps) * norm.weight;
q = RoPE_p(q_proj n), k = RoPE_p(k_proj n) (Hugging Face Llama rotate-half
RoPE with rope_theta); query head h belongs to KV head h / (num_heads /
num_kv_heads); scores are q.k / sqrt(head_dim).
"""

import argparse
import copy
import csv
import hashlib
import json
import math
import multiprocessing as mp
import os
import random
import sys
import sysconfig
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import tasks  # noqa: E402  (our generator; pure Python)

HEAD_FORMAT = "penumbra-specontext-head v1"

# Directories under the standard library's path that are not the standard
# library (installed packages: they differ between machines) or are test data
# (odd encodings, generated text).
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", required=True,
                    help="the target model: a Hugging Face Llama directory with tokenizer.json")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-minutes", type=float, default=6.0,
                    help="wall budget of the whole call (setup, training, export, evaluation)")
    # Optimization.
    ap.add_argument("--steps", type=int, default=2000,
                    help="training steps at most (fewer when they do not fit in --max-minutes)")
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--curriculum", default="0:2048,0.5:4096",
                    help="comma list of start_fraction:seq_len (fractions of the planned steps)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.0,
                    help="AdamW decay of the matrices (the run starts from the teacher's weights)")
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--ce-weight", type=float, default=0.0,
                    help="weight of the student's next-token cross-entropy added to the KL")
    # Data.
    ap.add_argument("--task-frac", type=float, default=0.8,
                    help="fraction of sequences that start with a synthetic task sample")
    ap.add_argument("--holdout-every", type=int, default=10,
                    help="every N-th standard-library file is kept out of training, for the evaluation")
    ap.add_argument("--corpus-chars", type=int, default=0,
                    help="cap on the training text in characters (0: all of it)")
    # Running.
    ap.add_argument("--calib-steps", type=int, default=30,
                    help="steps timed to fit the plan into --max-minutes (0: keep --steps)")
    ap.add_argument("--reserve-s", type=float, default=30.0,
                    help="seconds of --max-minutes kept for the export and the evaluation")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--prefetch", type=int, default=16)
    ap.add_argument("--log-every", type=int, default=20)
    # Evaluation.
    ap.add_argument("--eval-samples", type=int, default=20)
    ap.add_argument("--eval-len", type=int, default=4096)
    ap.add_argument("--eval-budgets", default="256,1024")
    ap.add_argument("--smoke", action="store_true",
                    help="a few steps on short sequences and a small evaluation, to check the pipeline")
    ap.add_argument("--cpu-ok", action="store_true",
                    help="with --smoke: run on the CPU when CUDA is not available")
    args = ap.parse_args(argv)
    if args.cpu_ok and not args.smoke:
        ap.error("--cpu-ok only goes with --smoke")
    if args.smoke:
        args.steps, args.tokens_per_step, args.curriculum = 8, 8192, "0:512,0.5:1024"
        args.warmup, args.calib_steps, args.log_every = 2, 0, 1
        args.eval_samples, args.eval_len, args.eval_budgets = 4, 1024, "64,256"
        args.corpus_chars = args.corpus_chars or 3_000_000
        args.workers = min(args.workers, 4)
        args.prefetch = min(args.prefetch, 8)
    return args


def curriculum(args):
    out = []
    for part in args.curriculum.split(","):
        f, L = part.split(":")
        out.append((float(f), int(L)))
    out.sort()
    return out


def seq_len_at(args, step, total):
    L = curriculum(args)[0][1]
    for f, l in curriculum(args):
        if step >= int(f * total):
            L = l
    return L


def lr_at(args, step, total):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    m = args.min_lr_frac
    return args.lr * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p)))


def rope_theta_of(cfg):
    rp = getattr(cfg, "rope_parameters", None)  # transformers >= 5
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    return float(cfg.rope_theta)


def rope_type_of(cfg):
    for attr in ("rope_parameters", "rope_scaling"):
        rp = getattr(cfg, attr, None)
        if isinstance(rp, dict):
            return rp.get("rope_type", rp.get("type", "default"))
    return "default"


# --------------------------------------------------------------------------
# Corpus: the standard library's Python sources.


def stdlib_files():
    """(root, sorted relative paths of the standard library's .py files)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for fn in filenames:
            if fn.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, fn), root))
    return root, sorted(out)


def load_corpus(args):
    """(train_texts, heldout_texts, info). Files that are not UTF-8 or hold NULs
    are skipped; file i (in path order) is held out when i % holdout_every is
    holdout_every - 1; --corpus-chars caps the training part."""
    root, files = stdlib_files()
    train, held = [], []
    n_train = 0
    for i, rel in enumerate(files):
        try:
            with open(os.path.join(root, rel), "rb") as f:
                text = f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if "\x00" in text or not text.strip():
            continue
        if i % args.holdout_every == args.holdout_every - 1:
            held.append(text)
        elif not args.corpus_chars or n_train < args.corpus_chars:
            train.append(text)
            n_train += len(text)
    info = {"source": "python stdlib .py files", "python": sys.version.split()[0], "root": root,
            "files_listed": len(files), "train_files": len(train), "heldout_files": len(held),
            "train_chars": n_train, "heldout_chars": sum(len(t) for t in held)}
    return train, held, info


def tokenize_corpus(tok, texts):
    """One uint16 token array: every file, then "\\n\\n" (as train.py's token cache)."""
    import numpy as np

    sep = np.asarray(tok.encode("\n\n", add_special_tokens=False).ids, dtype=np.uint16)
    parts = []
    for i in range(0, len(texts), 256):
        for enc in tok.encode_batch(texts[i:i + 256], add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.uint16))
            parts.append(sep)
    return np.concatenate(parts)


# --------------------------------------------------------------------------
# Batches and evaluation records (worker processes).

_W = {}


def _worker_init(tok_path, train_text, heldout_text, corpus_tokens, bos_id):
    from tokenizers import Tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _W["tok"] = Tokenizer.from_file(tok_path)
    _W["counter"] = tasks.HFTokenCounter(tok_path)
    _W["hay"] = tasks.Haystack(train_text)
    _W["eval_hay"] = tasks.Haystack(heldout_text)
    _W["tokens"] = corpus_tokens  # inherited from the parent by fork, not copied
    _W["bos"] = bos_id


def build_batch(args, step, L):
    """[B, L] token ids for `step` (B = tokens_per_step // L): a task sample
    (BOS + text) at the start of --task-frac of the rows, then BOS + plain text
    to the end of the row."""
    import numpy as np

    t0 = time.time()
    tok, counter, hay, corpus = _W["tok"], _W["counter"], _W["hay"], _W["tokens"]
    B = max(1, args.tokens_per_step // L)
    rng = random.Random(f"{args.seed}:specontext:{step}:{L}")
    ids = np.full((B, L), _W["bos"], dtype=np.int64)
    kinds = {}
    for b in range(B):
        pos = 0
        if rng.random() < args.task_frac:
            # Task lengths as in train.py: half full-length, half shorter.
            tl = L if rng.random() < 0.5 else rng.randint(min(L, 512), L)
            text, _spans, kind = tasks.make_train_sample(rng, hay, counter, tl)
            kinds[kind] = kinds.get(kind, 0) + 1
            enc = tok.encode(text).ids  # BOS + text (the tokenizer's post-processor)
            pos = min(len(enc), L)
            ids[b, :pos] = enc[:pos]
        if pos < L:
            need = L - pos - 1
            off = rng.randrange(0, max(1, corpus.shape[0] - need))
            ids[b, pos] = _W["bos"]
            ids[b, pos + 1:] = corpus[off:off + need]
    return step, L, ids, kinds, time.time() - t0


def make_eval_record(args, i):
    """Held-out evaluation record i (tasks.py's evaluation presets, cycling
    over the tasks) from the held-out files."""
    task = tasks.TASKS[i % len(tasks.TASKS)]
    return tasks.make_record(task, args.eval_len, f"specontext-eval-{args.seed}", i,
                             _W["eval_hay"], _W["counter"])


class Batches:
    """Ordered, prefetched batches. A batch's length follows the plan
    (seq_len_at with the current total); batches made for an older plan are
    made again."""

    def __init__(self, pool, args, total):
        self.pool, self.args, self.total = pool, args, total
        self.next_submit = 0
        self.pending = {}
        for _ in range(args.prefetch):
            self._submit()

    def _submit(self):
        s = self.next_submit
        if s < self.total:
            L = seq_len_at(self.args, s, self.total)
            self.pending[s] = (L, self.pool.apply_async(build_batch, (self.args, s, L)))
            self.next_submit += 1

    def replan(self, total):
        """The plan changed to `total` steps: drop or remake what no longer fits."""
        self.total = total
        for s in sorted(self.pending):
            L = seq_len_at(self.args, s, total)
            if s >= total:
                del self.pending[s]
            elif self.pending[s][0] != L:
                self.pending[s] = (L, self.pool.apply_async(build_batch, (self.args, s, L)))
        self.next_submit = min(self.next_submit, total)

    def get(self, step):
        L = seq_len_at(self.args, step, self.total)
        Lp, r = self.pending.pop(step, (None, None))
        if Lp != L:
            r = self.pool.apply_async(build_batch, (self.args, step, L))
        self._submit()
        return r.get()


# --------------------------------------------------------------------------
# Models and loss.


def load_teacher(path, dtype, device):
    import torch
    from transformers import LlamaForCausalLM

    try:
        model = LlamaForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    except TypeError:  # older transformers call it torch_dtype
        model = LlamaForCausalLM.from_pretrained(path, torch_dtype=dtype, attn_implementation="sdpa")
    # An older transformers may also take `dtype` as a config attribute and
    # load f32; the shards are bf16, so this cast is exact either way.
    model = model.to(device=device, dtype=dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    if not torch.equal(emb, head):
        sys.exit(f"{path}: lm_head differs from the embedding, but the student ties them "
                 "(tie_word_embeddings is expected)")
    return model


def make_student(teacher):
    """One-layer LlamaForCausalLM (f32 master weights) initialized from the
    teacher's embedding, layer 0, final norm and (tied) lm_head."""
    from transformers import LlamaForCausalLM

    cfg = copy.deepcopy(teacher.config)
    cfg.num_hidden_layers = 1
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:1]
    cfg.use_cache = False
    student = LlamaForCausalLM(cfg).float()
    src = teacher.state_dict()
    init = {k: v for k, v in src.items()
            if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    init["lm_head.weight"] = src["model.embed_tokens.weight"]
    missing, unexpected = student.load_state_dict(init, strict=False)
    if missing or unexpected:
        sys.exit(f"student does not match the teacher's layer 0: missing {missing}, "
                 f"unexpected {unexpected}")
    # Frozen: the head reuses the teacher's table (tied, these are one tensor;
    # untied, both are frozen all the same).
    student.model.embed_tokens.weight.requires_grad_(False)
    student.lm_head.weight.requires_grad_(False)
    return student


def param_groups(model, wd):
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def distill_loss(student, teacher, ids, ce_weight, amp):
    """(loss, kl, student CE, teacher CE), per token. KL(teacher || student)
    over every position and the whole vocabulary, in f32."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        t_logp = teacher(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=amp):
        s_logits = student(input_ids=ids, use_cache=False).logits
    s_logp = s_logits.float().log_softmax(-1)
    del s_logits
    V = s_logp.size(-1)
    n = s_logp.numel() // V
    kl = F.kl_div(s_logp.view(-1, V), t_logp.view(-1, V), log_target=True, reduction="sum") / n
    tgt = ids[:, 1:, None]
    with torch.set_grad_enabled(ce_weight > 0 and torch.is_grad_enabled()):
        s_ce = -s_logp[:, :-1].gather(-1, tgt).mean()
    with torch.no_grad():
        t_ce = -t_logp[:, :-1].gather(-1, tgt).mean()
    loss = kl + ce_weight * s_ce if ce_weight > 0 else kl
    return loss, kl.detach(), s_ce.detach(), t_ce


# --------------------------------------------------------------------------
# Export.


def teacher_id(path):
    with open(os.path.join(path, "config.json"), "rb") as f:
        h = hashlib.sha256(f.read()).hexdigest()[:16]
    return f"{os.path.basename(os.path.normpath(path))} config-sha256:{h}"


def export_head(args, student, teacher, path, steps, trained_context):
    import torch
    from safetensors.torch import save_file

    # The head has no embedding of its own: the student's must still be the
    # teacher's, bit for bit (and lm_head, tied or not).
    t_emb = teacher.model.embed_tokens.weight.detach()
    for name, w in (("embed_tokens", student.model.embed_tokens.weight),
                    ("lm_head", student.lm_head.weight)):
        w = w.detach()
        if not (torch.equal(w.to(t_emb.dtype), t_emb) and torch.equal(w, t_emb.to(w.dtype))):
            sys.exit(f"student {name} is not the teacher's embedding table: the head cannot "
                     "read the target model's embedding")
    cfg = teacher.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    layer = student.model.layers[0]

    def bf16(t):
        return t.detach().to(torch.bfloat16).cpu().contiguous()

    tensors = {"norm.weight": bf16(layer.input_layernorm.weight),
               "q_proj.weight": bf16(layer.self_attn.q_proj.weight),
               "k_proj.weight": bf16(layer.self_attn.k_proj.weight)}
    want = {"norm.weight": (cfg.hidden_size,), "q_proj.weight": (H * d, cfg.hidden_size),
            "k_proj.weight": (Hkv * d, cfg.hidden_size)}
    for k, shape in want.items():
        if tuple(tensors[k].shape) != shape:
            sys.exit(f"{k}: shape {tuple(tensors[k].shape)}, expected {shape}")
    meta = {
        "format": HEAD_FORMAT,
        "hidden_size": str(cfg.hidden_size),
        "num_heads": str(H),
        "num_kv_heads": str(Hkv),
        "head_dim": str(d),
        "rope_theta": repr(rope_theta_of(cfg)),
        "rms_norm_eps": repr(float(cfg.rms_norm_eps)),
        "vocab_size": str(cfg.vocab_size),
        "trained_context": str(trained_context),
        "embedding": "target",
        "teacher": teacher_id(args.teacher),
        "steps": str(steps),
        "seed": str(args.seed),
    }
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)
    print(f"exported {path}: " + ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items())
          + f"; metadata {json.dumps(meta)}", flush=True)
    return meta


def read_head(path):
    """The exported tensors and metadata, as the C++ reader sees them."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != HEAD_FORMAT or set(tensors) != {"norm.weight", "q_proj.weight", "k_proj.weight"}:
        sys.exit(f"{path}: unexpected contents {sorted(tensors)} / {meta}")
    return tensors, meta


# --------------------------------------------------------------------------
# Evaluation.


def rope_heads(q, k, cos, sin, H, Hkv, d):
    """q [T, H*d], k [T, Hkv*d] (f32) -> RoPE'd q [H, T, d], k [Hkv, T, d],
    with transformers' own apply_rotary_pos_emb; cos/sin [1, T, d] from the
    model's rotary embedding module."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    T = q.shape[0]
    q = q.view(1, T, H, d).transpose(1, 2)
    k = k.view(1, T, Hkv, d).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    return q[0], k[0]


def last_query_weights(q, k, scale):
    """Attention weights of the last position's queries: q [H, T, d],
    k [Hkv, T, d] -> softmax per query head [Hkv, G, T] (G query heads per KV
    head, in Hugging Face's grouping: query head h reads KV head h // G)."""
    Hkv, _, d = k.shape
    G = q.shape[0] // Hkv
    s = (q[:, -1].reshape(Hkv, G, 1, d) @ k.transpose(1, 2)[:, None]).squeeze(2) * scale
    return s.softmax(-1)


def yarn_inv_freq(d, theta, factor, trained_context):
    """RoPE inverse frequencies scaled by YaRN, as the engine computes them
    (worker/engine/specontext_head.cc, YarnInvFreq): dimensions whose
    wavelength fits the trained context more than 32 times keep their
    frequency, those that fit less than once are divided by the factor,
    linearly in between."""
    out = []
    for i in range(d // 2):
        base = 1.0 / theta ** (2.0 * i / d)
        f = base
        if factor > 1.0:
            r = trained_context / (2.0 * math.pi / base)
            keep = min(1.0, max(0.0, (r - 1.0) / 31.0))
            f = base / factor * (1.0 - keep) + base * keep
        out.append(f)
    return out


def topk_mask(score, B):
    """Boolean [Hkv, T]: the B highest scores of each row."""
    import torch

    idx = score.topk(min(B, score.shape[-1]), dim=-1).indices
    m = torch.zeros_like(score, dtype=torch.bool)
    return m.scatter_(1, idx, True)


def evaluate(args, teacher, student, head, records, tok, dev, trained_context):
    import torch

    cfg = teacher.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    scale = d ** -0.5
    eps = float(cfg.rms_norm_eps)
    budgets = [int(b) for b in args.eval_budgets.split(",") if b]
    layers = teacher.model.layers
    n_layers = len(layers)
    # The head as the engine runs it: the exported bf16 weights, in f32 math,
    # on the target model's embedding table.
    emb = teacher.model.embed_tokens.weight.detach().float()
    w_norm = head["norm.weight"].to(dev).float()
    w_q = head["q_proj.weight"].to(dev).float()
    w_k = head["k_proj.weight"].to(dev).float()
    # The engine's position scaling of the head for a sequence of the model's
    # whole context: YaRN by the model's context over the head's trained one
    # (with the attention temperature on the logits). "head" is the head as
    # trained (plain RoPE, what the engine runs at these records' length),
    # "head_yarn" the same head scaled as for the longest sequences.
    yarn_factor = float(getattr(cfg, "max_position_embeddings", 0) or 0) / trained_context
    yarn = None
    if yarn_factor > 1.0:
        inv = torch.tensor(yarn_inv_freq(d, rope_theta_of(cfg), yarn_factor, trained_context),
                           device=dev, dtype=torch.float32)
        mscale = 0.1 * math.log(yarn_factor) + 1.0
        yarn = (inv, mscale * mscale * scale)

    # The teacher's own q/k projections, captured as a check on the hidden
    # states' indexing (hidden_states[i] must be layer i's input).
    captured = {}
    hooks = []
    for li, layer in enumerate(layers):
        for name in ("q_proj", "k_proj"):
            def hook(_m, _i, out, key=(li, name)):
                captured[key] = out.detach()[0]
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(hook))

    preds = ("head",) + (("head_yarn",) if yarn else ()) + ("recent", "untrained_head")
    sums = {B: {p: [0.0] * n_layers for p in preds} for B in budgets}
    mass = {B: {p: [0.0] * n_layers for p in preds + ("oracle",)} for B in budgets}
    kinds, n_tok, qk_source, head_check = {}, 0, "hidden_states", None
    try:
        for rec in records:
            ids = tok.encode(rec["prompt"]).ids  # BOS + prompt
            T = len(ids)
            n_tok += T
            kinds[rec["task"]] = kinds.get(rec["task"], 0) + 1
            x = torch.tensor([ids], device=dev)
            pos = torch.arange(T, device=dev)[None]
            with torch.no_grad():
                out = teacher(input_ids=x, use_cache=False, output_hidden_states=True)
                hs = out.hidden_states
                cos, sin = teacher.model.rotary_emb(torch.zeros(1, device=dev, dtype=torch.float32), pos)
                # The retrieval head.
                e = emb[x[0]]
                nrm = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + eps) * w_norm
                kh_pre = nrm @ w_k.T
                qh, kh = rope_heads(nrm @ w_q.T, kh_pre, cos, sin, H, Hkv, d)
                p_head = last_query_weights(qh, kh, scale)
                if yarn:
                    ang = pos[0].float()[:, None] * yarn[0][None, :]
                    ang = torch.cat([ang, ang], dim=-1)[None]
                    qy, ky = rope_heads(nrm @ w_q.T, kh_pre, ang.cos(), ang.sin(), H, Hkv, d)
                    p_head_yarn = last_query_weights(qy, ky, yarn[1])
                if head_check is None:
                    # The hand-written head against the student's own modules
                    # (f32 master weights; the export rounds to bf16).
                    l0 = student.model.layers[0]
                    ref = l0.self_attn.k_proj(l0.input_layernorm(student.model.embed_tokens(x).float()))[0]
                    head_check = float((kh_pre - ref).norm() / ref.norm().clamp(min=1e-12))
                    print(f"eval: head k vs the student's layer 0: relative error {head_check:.2e}", flush=True)
                    if head_check > 2e-2:
                        print("eval: WARNING: the exported head does not reproduce the student's layer 0",
                              flush=True)
                p_layers = []
                for li, layer in enumerate(layers):
                    # (Read the captured ones first: the calls below fire the
                    # hooks again.)
                    cq, ck = captured[(li, "q_proj")], captured[(li, "k_proj")]
                    h = layer.input_layernorm(hs[li])[0]
                    q, k = layer.self_attn.q_proj(h), layer.self_attn.k_proj(h)
                    err = max(float((q - cq).float().norm() / cq.float().norm().clamp(min=1e-12)),
                              float((k - ck).float().norm() / ck.float().norm().clamp(min=1e-12)))
                    if err > 1e-2:
                        # Not the layer's input after all (a transformers
                        # version with other hidden_states semantics): use
                        # what the layer computed.
                        if qk_source == "hidden_states":
                            print(f"eval: WARNING: layer {li}: q/k from hidden_states differ from the "
                                  f"layer's own (relative {err:.2e}); using the captured ones", flush=True)
                        qk_source = "forward_hooks"
                        q, k = cq, ck
                    q, k = rope_heads(q.float(), k.float(), cos, sin, H, Hkv, d)
                    p_layers.append(last_query_weights(q, k, scale))
                for li, p_t in enumerate(p_layers):
                    t_sel = p_t.amax(1)  # [Hkv, T]
                    for B in budgets:
                        t_mask = topk_mask(t_sel, B)
                        n_true = t_mask.sum(-1).float()
                        recent = torch.zeros_like(t_mask)
                        recent[:, max(0, T - B):] = True
                        choice = {"head": topk_mask(p_head.amax(1), B), "recent": recent,
                                  "untrained_head": topk_mask(p_layers[0].amax(1), B)}
                        if yarn:
                            choice["head_yarn"] = topk_mask(p_head_yarn.amax(1), B)
                        for name, m in choice.items():
                            sums[B][name][li] += float(((t_mask & m).sum(-1) / n_true).mean())
                            mass[B][name][li] += float((p_t * m[:, None, :]).sum(-1).mean())
                        mass[B]["oracle"][li] += float((p_t * t_mask[:, None, :]).sum(-1).mean())
    finally:
        for h in hooks:
            h.remove()

    n = max(1, len(records))
    res = {"budgets": {}, "samples": len(records), "eval_len": args.eval_len,
           "mean_tokens": round(n_tok / n, 1), "tasks": kinds, "layers": n_layers,
           "qk_source": qk_source, "head_check_rel_err": head_check,
           "head_yarn_factor": round(yarn_factor, 4) if yarn else None}
    for B in budgets:
        r = {}
        for name in preds:
            per_layer = [v / n for v in sums[B][name]]
            r[name] = round(sum(per_layer) / n_layers, 4)
            r[f"{name}_per_layer"] = [round(v, 4) for v in per_layer]
        for name in preds + ("oracle",):
            r[f"{name}_mass"] = round(sum(mass[B][name]) / n / n_layers, 4)
        res["budgets"][str(B)] = r
    return res


# --------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    deadline = t_start + args.max_minutes * 60
    os.makedirs(args.out, exist_ok=True)
    import torch
    from tokenizers import Tokenizer

    if torch.cuda.is_available():
        dev = torch.device("cuda")
    elif args.smoke and args.cpu_ok:
        dev = torch.device("cpu")
        print("no CUDA: running the smoke test on the CPU (--cpu-ok)", flush=True)
    else:
        sys.exit("CUDA is not available: this script trains on a GPU "
                 "(only --smoke --cpu-ok runs on the CPU)")
    amp = dev.type == "cuda"

    with open(os.path.join(args.teacher, "config.json")) as f:
        tcfg = json.load(f)
    tok_path = os.path.join(args.teacher, "tokenizer.json")
    tok = Tokenizer.from_file(tok_path)
    bos_id = int(tcfg["bos_token_id"])
    if tok.encode("x").ids[0] != bos_id:
        sys.exit(f"{tok_path} does not start a sequence with BOS id {bos_id}")

    # Text, tokens and worker processes before the models reach the GPU.
    train_texts, held_texts, corpus_info = load_corpus(args)
    corpus = tokenize_corpus(tok, train_texts)
    corpus_info["train_tokens"] = int(corpus.size)
    corpus_info["train_tokens_sha256"] = hashlib.sha256(corpus.tobytes()).hexdigest()[:16]
    max_len = max(L for _, L in curriculum(args))
    if corpus.size < 4 * max_len or not held_texts:
        sys.exit(f"standard-library corpus too small: {corpus_info}")
    print(f"corpus: {json.dumps(corpus_info)} ({time.time() - t_start:.0f}s)", flush=True)
    train_text, held_text = "\n\n".join(train_texts), "\n\n".join(held_texts)
    del train_texts, held_texts
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers fork after the parallel encode
    pool = mp.get_context("fork").Pool(args.workers, initializer=_worker_init,
                                       initargs=(tok_path, train_text, held_text, corpus, bos_id))
    eval_jobs = [pool.apply_async(make_eval_record, (args, i)) for i in range(args.eval_samples)]
    total = args.steps
    batches = Batches(pool, args, total)

    # No TF32: the student computes in bf16 autocast anyway, and the
    # evaluation's f32 head math should stay f32.
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    teacher = load_teacher(args.teacher, torch.bfloat16 if amp else torch.float32, dev)
    if rope_type_of(teacher.config) != "default":
        sys.exit(f"teacher RoPE type {rope_type_of(teacher.config)!r}: the head format assumes plain RoPE")
    student = make_student(teacher).to(dev).train()
    trainable = [p for p in student.parameters() if p.requires_grad]
    print(f"teacher: {teacher_id(args.teacher)}, {len(teacher.model.layers)} layers, "
          f"rope_theta={rope_theta_of(teacher.config)}; student: 1 layer, "
          f"{sum(p.numel() for p in trainable) / 1e6:.2f}M trainable parameters "
          f"(embedding frozen); device {dev} ({time.time() - t_start:.0f}s)", flush=True)
    opt = torch.optim.AdamW(param_groups(student, args.weight_decay), lr=args.lr,
                            betas=(0.9, 0.95), eps=1e-8, fused=amp)

    csv_path = os.path.join(args.out, "loss.csv")
    fields = ["step", "seq_len", "lr", "kl", "ce_student", "ce_teacher", "tok_per_s", "elapsed_s"]
    csv_f = open(csv_path, "w", newline="")
    csv_w = csv.DictWriter(csv_f, fieldnames=fields)
    csv_w.writeheader()

    train_deadline = deadline - args.reserve_s
    t_train = time.time()
    step, step_time, trained_context, n_tokens = 0, None, 0, 0
    gpu_times, gen_times, history = [], [], []
    try:
        while step < total:
            if step_time is not None and time.time() + 1.5 * step_time > train_deadline:
                print(f"deadline: stopping at step {step} of {total}", flush=True)
                break
            if args.calib_steps > 0 and step == args.calib_steps:
                # Time per step: the GPU's, or the workers' batch rate if
                # slower; 10% margin (the second phase's longer sequences
                # cost a little more attention).
                k = len(gpu_times) // 3
                t_gpu = sorted(gpu_times[k:])[len(gpu_times[k:]) // 2]
                t_gen = sum(gen_times) / len(gen_times) / args.workers
                per = 1.1 * max(t_gpu, t_gen)
                fit = step + int(max(0.0, train_deadline - time.time()) / per)
                new_total = max(step + 1, min(args.steps, fit))
                print(f"plan: {new_total} steps ({t_gpu:.3f} s/step on the {dev.type}, "
                      f"{t_gen:.3f} s/step of batch making; --steps {args.steps})", flush=True)
                if new_total != total:
                    total = new_total
                    batches.replan(total)
            t0 = time.time()
            _, L, ids_np, kinds, gen_s = batches.get(step)
            t_wait = time.time() - t0
            ids = torch.from_numpy(ids_np).to(dev, non_blocking=True)
            lr = lr_at(args, step, total)
            for g in opt.param_groups:
                g["lr"] = lr
            loss, kl, s_ce, t_ce = distill_loss(student, teacher, ids, args.ce_weight, amp)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, args.grad_clip)
            opt.step()
            vals = torch.stack([kl, s_ce, t_ce, loss.detach()]).tolist()  # (waits for the GPU)
            dt = time.time() - t0
            step_time = dt if step_time is None else 0.8 * step_time + 0.2 * dt
            gpu_times.append(dt - t_wait)
            gen_times.append(gen_s)
            trained_context = max(trained_context, L)
            n_tokens += ids_np.size
            history.append(vals)
            tps = ids_np.size / max(dt, 1e-6)
            csv_w.writerow({"step": step, "seq_len": L, "lr": f"{lr:.6g}", "kl": f"{vals[0]:.5f}",
                            "ce_student": f"{vals[1]:.5f}", "ce_teacher": f"{vals[2]:.5f}",
                            "tok_per_s": int(tps), "elapsed_s": f"{time.time() - t_start:.1f}"})
            if step % args.log_every == 0 or step == total - 1:
                print(f"step {step}/{total} L={L} lr={lr:.2e} loss={vals[3]:.4f} kl={vals[0]:.4f} "
                      f"ce student={vals[1]:.4f} teacher={vals[2]:.4f} {tps / 1e3:.0f}K tok/s "
                      f"(waited {t_wait:.3f}s for data) kinds={kinds}", flush=True)
            step += 1
        # The evaluation records (queued before the first batch, long done);
        # one that failed must not cost the export.
        records = []
        for i, r in enumerate(eval_jobs):
            try:
                records.append(r.get())
            except Exception as e:  # noqa: BLE001
                print(f"eval record {i} failed: {e!r}", flush=True)
    finally:
        pool.terminate()
        pool.join()
        csv_f.close()
    if step == 0:
        sys.exit("no training step fitted in --max-minutes")
    train_minutes = (time.time() - t_train) / 60

    # Export (the head and the training record), then evaluate.
    head_path = os.path.join(args.out, "head.safetensors")
    export_head(args, student, teacher, head_path, step, trained_context)
    tail = history[-20:]
    final = [sum(v[i] for v in tail) / len(tail) for i in range(4)]  # kl, ce s/t, loss
    import transformers

    train_info = {
        "args": vars(args), "steps": step, "planned_steps": total, "tokens": n_tokens,
        "trained_context": trained_context,
        "final_loss": round(final[3], 5),
        "final_kl": round(final[0], 5), "final_ce_student": round(final[1], 5),
        "final_ce_teacher": round(final[2], 5), "loss_averaged_over_steps": len(tail),
        "first_kl": round(history[0][0], 5), "minutes": round(train_minutes, 2),
        "teacher": teacher_id(args.teacher), "corpus": corpus_info,
        "device": torch.cuda.get_device_name() if amp else "cpu",
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__},
    }
    with open(os.path.join(args.out, "train.json"), "w") as f:
        json.dump(train_info, f, indent=2)
    print(f"trained {step} steps ({n_tokens / 1e6:.0f}M tokens) in {train_minutes:.1f} min: "
          f"kl {history[0][0]:.4f} -> {final[0]:.4f} (last {len(tail)} steps)", flush=True)

    head, _ = read_head(head_path)
    student.eval()
    res = evaluate(args, teacher, student, head, records, tok, dev, trained_context)
    line = json.dumps({"specontext_head_recall": res})
    print(line, flush=True)
    with open(os.path.join(args.out, "eval.json"), "w") as f:
        f.write(line + "\n")
    print(f"done in {(time.time() - t_start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()

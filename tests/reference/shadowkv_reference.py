#!/usr/bin/env python3
"""Independent PyTorch reference of ShadowKV (Sun et al., 2024), Algorithms 1-2.

Written from the paper (and the documented facts of the official prototype),
not from Penumbra's C++ code. It runs one attention layer of one sequence:

  Algorithm 1 (prefill), per KV head h:
    SVD of the pre-RoPE keys concatenated over heads, [S, hkv*d]:
        A = U[:, :r]   (shared by all heads)       B = diag(s_r) Vh_r  viewed [hkv, r, d]
    post-RoPE keys from the exact pre-RoPE keys; chunks of C tokens over the
    first n_chunks*C tokens (n_chunks = (S - W) // C; the rest is the exact
    local window); landmark = mean of the chunk's post-RoPE keys;
    min-cos = min over the chunk's keys of cos(landmark, key); outliers = the O
    chunks with the lowest min-cos (ties -> lower index), kept exactly (K and V)
    and removed from the landmark set.

  Algorithm 2 (decode), query q at position S + i (no new tokens appended):
    P = RoPE(q) L^T per query head against its KV head's landmarks,
    S = softmax(P * scale) over the non-outlier chunks, S2 = max over the
    query heads of each KV group (the paper's sum over s_q is over one query),
    I = top-(budget // C) chunks of S2 per KV head (ties -> lower index);
    K_sparse = RoPE(A[tokens of I] @ B_h) at the tokens' true positions,
    V_sparse = exact V of those tokens;
    attention over [outlier K/V; sparse K/V; local-window K/V].

Context parallel (optional `shards`, token bounds [0, b1, ..., S] with the
inner bounds multiples of C): the sequence split into contiguous shards, as
the design of a sharded ShadowKV says (docs/architecture.md, "Context
parallel"), not as any code does: each shard factors its own pre-RoPE keys
(its own SVD, rank r), keeps its share of the outliers, round(O * len / S)
(halves up), among its own chunks, and the selection stays the whole
sequence's top-k. Chunks and landmarks do not change (a shard's chunks are
the sequence's).

GQA: query head j uses KV head j // group (Hugging Face repeat_kv order).
RoPE: rotate-half (pairs (i, i + d/2)), angle = f32(position) * inv_freq[i]
computed as one f32 multiply, inv_freq taken from the inputs file.

Sub-commands (see README.md):
  make-inputs  write a synthetic inputs file (k_pre, v, q, inv_freq + metadata)
  run          write the reference results in the engine's output format,
               optionally emulating an f32 or bf16 engine (to try the comparator)
  self-test    exactness and sanity checks, plus comparator checks
"""

import argparse
import dataclasses
import math
import os
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

F64 = torch.float64
F32 = torch.float32

INPUTS_FORMAT = "penumbra-shadowkv-check-inputs/1"
OUTPUTS_FORMAT = "penumbra-shadowkv-check-outputs/1"

# Metadata keys every inputs file carries (all values are strings).
META_INT_KEYS = ("rank", "chunk", "budget", "outliers", "local_window", "steps")
META_FLOAT_KEYS = ("rope_theta", "scale")


# ----------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------

@dataclasses.dataclass
class Inputs:
    k_pre: torch.Tensor     # [hkv, S, d] pre-RoPE keys
    v: torch.Tensor         # [hkv, S, d]
    q: torch.Tensor         # [steps, hq, d] pre-RoPE queries; step i sits at position S + i
    inv_freq: torch.Tensor  # [d / 2] f32
    rank: int
    chunk: int
    budget: int             # tokens; kslots = budget // chunk
    outliers: int           # outlier chunks per KV head
    local_window: int
    rope_theta: float
    scale: float
    steps: int

    @property
    def hkv(self): return self.k_pre.shape[0]
    @property
    def seq(self): return self.k_pre.shape[1]
    @property
    def d(self): return self.k_pre.shape[2]
    @property
    def hq(self): return self.q.shape[1]
    @property
    def group(self): return self.hq // self.hkv
    @property
    def n_chunks(self): return (self.seq - self.local_window) // self.chunk
    @property
    def kslots(self): return self.budget // self.chunk

    def validate(self):
        hkv, S, d = self.k_pre.shape
        _require(d % 2 == 0, f"head dim {d} must be even")
        _require(tuple(self.v.shape) == (hkv, S, d), f"v shape {tuple(self.v.shape)} != {(hkv, S, d)}")
        _require(self.q.dim() == 3 and self.q.shape[0] == self.steps and self.q.shape[2] == d,
                 f"q shape {tuple(self.q.shape)} != [steps={self.steps}, hq, {d}]")
        _require(self.hq % hkv == 0, f"hq {self.hq} is not a multiple of hkv {hkv}")
        _require(tuple(self.inv_freq.shape) == (d // 2,), f"inv_freq shape {tuple(self.inv_freq.shape)}")
        _require(1 <= self.rank <= min(S, hkv * d), f"rank {self.rank} not in [1, min(S, hkv*d)]")
        _require(self.chunk >= 1 and self.local_window >= 0, "chunk >= 1 and local_window >= 0")
        _require(self.n_chunks >= 1, f"no chunks: S={S} W={self.local_window} C={self.chunk}")
        _require(0 <= self.outliers < self.n_chunks, f"outliers {self.outliers} >= n_chunks {self.n_chunks}")
        _require(1 <= self.kslots <= self.n_chunks - self.outliers,
                 f"kslots {self.kslots} not in [1, n_chunks - outliers = {self.n_chunks - self.outliers}]")
        return self


def _require(cond, message):
    if not cond:
        raise ValueError(message)


def hf_inv_freq(theta, d):
    """RoPE inverse frequencies as Hugging Face computes them (f32 arithmetic)."""
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(F32) / d))


def read_safetensors(path, device="cpu"):
    with safe_open(path, framework="pt", device=device) as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, meta


def load_inputs(path, device="cpu"):
    t, meta = read_safetensors(path, device)
    for name in ("k_pre", "v", "q", "inv_freq"):
        _require(name in t, f"{path}: missing tensor '{name}'")
        _require(t[name].dtype == F32, f"{path}: tensor '{name}' is {t[name].dtype}, want float32")
    for key in META_INT_KEYS + META_FLOAT_KEYS:
        _require(key in meta, f"{path}: missing metadata key '{key}'")
    return Inputs(k_pre=t["k_pre"], v=t["v"], q=t["q"], inv_freq=t["inv_freq"],
                  **{k: int(meta[k]) for k in META_INT_KEYS},
                  **{k: float(meta[k]) for k in META_FLOAT_KEYS}).validate()


# ----------------------------------------------------------------------------
# Precision: where an emulated engine rounds what it stores
# ----------------------------------------------------------------------------

@dataclasses.dataclass
class Precision:
    """compute: arithmetic dtype. store: dtype of stored tensors (None: no rounding).

    The reference is Precision(F64, None). Emulations (`run --emulate`) only
    exist to try the comparator and its tolerances before an engine exists."""
    compute: torch.dtype = F64
    store_dtype: torch.dtype = None

    def store(self, x):
        if self.store_dtype is None:
            return x
        return x.to(self.store_dtype).to(self.compute)


EXACT = Precision(F64, None)
EMULATIONS = {
    "exact": EXACT,
    "f32": Precision(F32, None),
    "bf16": Precision(F32, torch.bfloat16),
}


# ----------------------------------------------------------------------------
# RoPE and small helpers
# ----------------------------------------------------------------------------

def apply_rope(x, positions, inv_freq):
    """Rotate-half RoPE. x: [..., n, d]; positions: [n] integers; returns x's dtype.

    angle[p, i] = f32(p) * inv_freq[i] in f32 (one rounding, as the engine and
    Hugging Face do); cos/sin are then evaluated in x's dtype. Dimension i is
    paired with i + d/2:
        out[i]       = x[i] cos - x[i + d/2] sin
        out[i + d/2] = x[i + d/2] cos + x[i] sin
    """
    angle = positions.to(F32)[:, None] * inv_freq.to(F32)[None, :]  # [n, d/2] f32
    angle = angle.to(x.dtype)
    cos = torch.cat([angle.cos(), angle.cos()], dim=-1)              # [n, d]
    sin = torch.cat([angle.sin(), angle.sin()], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def smallest_k(x, k):
    """Per row of x, the indices of the k smallest values (ties -> lower index), ascending."""
    order = torch.sort(x, dim=-1, stable=True).indices
    return order[..., :k].sort(dim=-1).values


def largest_k(x, k):
    """Per row of x, the indices of the k largest values (ties -> lower index), ascending."""
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices
    return order[..., :k].sort(dim=-1).values


def chunk_tokens(chunks, chunk_size):
    """Token indices of the given chunk ids, [k] -> [k * chunk_size]."""
    offsets = torch.arange(chunk_size, device=chunks.device)
    return (chunks[:, None] * chunk_size + offsets[None, :]).reshape(-1)


def attend(q, k, v, scale):
    """Softmax attention of queries [g, d] over k, v [n, d] -> [g, d]."""
    p = torch.softmax((q @ k.T) * scale, dim=-1)
    return p @ v


# ----------------------------------------------------------------------------
# Algorithm 1: prefill
# ----------------------------------------------------------------------------

@dataclasses.dataclass
class Prefill:
    k_low: torch.Tensor      # [hkv, S, d] low-rank pre-RoPE keys, A[t] @ B_h of token t's factors
    k_rope: torch.Tensor     # [hkv, S, d] exact post-RoPE keys (outliers and local window use them)
    v: torch.Tensor          # [hkv, S, d]
    landmarks: torch.Tensor  # [hkv, n_chunks, d] mean post-RoPE key of every chunk
    min_cos: torch.Tensor    # [hkv, n_chunks]
    outliers: torch.Tensor   # [hkv, O] int64, ascending
    bounds: list = None      # the shards' token bounds ([0, S] unsharded)
    sigmas: list = None      # per shard, the singular values of its [len, hkv*d] pre-RoPE keys (descending)


def check_shards(inp, shards):
    """The token bounds of the shards ([0, S] when None), checked."""
    if shards is None:
        return [0, inp.seq]
    shards = [int(b) for b in shards]
    _require(len(shards) >= 2 and shards[0] == 0 and shards[-1] == inp.seq,
             f"shards {shards}: must run from 0 to seq {inp.seq}")
    _require(all(a < b for a, b in zip(shards, shards[1:])), f"shards {shards}: not increasing")
    _require(all(b % inp.chunk == 0 for b in shards[1:-1]),
             f"shards {shards}: an inner bound is not a multiple of chunk {inp.chunk}")
    _require(shards[-2] // inp.chunk < inp.n_chunks, f"shards {shards}: the last shard holds no chunk")
    return shards


def shard_outliers(inp, min_cos, shards):
    """Per shard, its share of the outliers (round(O * len / S), halves up) among its own chunks."""
    S, C, n = inp.seq, inp.chunk, inp.n_chunks
    parts = []
    for b0, b1 in zip(shards, shards[1:]):
        c0, c1 = b0 // C, min(b1 // C, n)
        o = int(math.floor(inp.outliers * (b1 - b0) / S + 0.5))
        _require(o <= c1 - c0, f"shard [{b0}, {b1}): {o} outliers in {c1 - c0} chunks")
        parts.append(smallest_k(min_cos[:, c0:c1], o) + c0)
    out = torch.cat(parts, dim=-1)
    _require(out.shape[-1] == inp.outliers,
             f"shards {shards}: their outliers ({out.shape[-1]}) are not the inputs' {inp.outliers}")
    return out


def prefill(inp, prec=EXACT, outliers=None, shards=None):
    """Algorithm 1. `outliers` ([hkv, O]) overrides the chosen outlier chunks;
    `shards` (token bounds) factors and picks outliers per shard."""
    dt = prec.compute
    k_pre = inp.k_pre.to(dt)
    hkv, S, d = k_pre.shape
    r, C, n = inp.rank, inp.chunk, inp.n_chunks
    bounds = check_shards(inp, shards)

    # Low-rank pre-RoPE keys: SVD of the keys concatenated over KV heads (per
    # shard); A = U[:, :r], B = diag(s_r) Vh_r viewed [hkv, r, d].
    K2 = k_pre.permute(1, 0, 2).reshape(S, hkv * d)
    k_low = torch.empty(hkv, S, d, dtype=dt, device=k_pre.device)
    sigmas = []
    for b0, b1 in zip(bounds, bounds[1:]):
        U, s, Vh = torch.linalg.svd(K2[b0:b1], full_matrices=False)
        sigmas.append(s.detach().to("cpu", F64))
        A = prec.store(U[:, :r])
        B = prec.store((s[:r, None] * Vh[:r]).reshape(-1, hkv, d).permute(1, 0, 2))  # [hkv, r, d]
        k_low[:, b0:b1] = A @ B

    # Exact post-RoPE keys; chunk means are the landmarks.
    k_rope = prec.store(apply_rope(k_pre, torch.arange(S, device=k_pre.device), inp.inv_freq))
    chunks = k_rope[:, : n * C].reshape(hkv, n, C, d)
    mean = chunks.mean(dim=2)                                         # [hkv, n, d]

    # Outliers: the chunks whose keys are worst approximated by their mean.
    cos = (chunks * mean[:, :, None, :]).sum(-1) / (
        chunks.norm(dim=-1) * mean.norm(dim=-1)[:, :, None])          # [hkv, n, C]
    min_cos = cos.min(dim=-1).values                                  # [hkv, n]
    if outliers is None:
        outliers = shard_outliers(inp, min_cos, bounds)
    return Prefill(k_low=k_low, k_rope=k_rope, v=prec.store(inp.v.to(dt)),
                   landmarks=prec.store(mean), min_cos=min_cos, outliers=outliers.long(),
                   bounds=bounds, sigmas=sigmas)


# ----------------------------------------------------------------------------
# Algorithm 2: one decode step
# ----------------------------------------------------------------------------

@dataclasses.dataclass
class Step:
    scores: torch.Tensor    # [hkv, n_chunks] max over the group of the chunk softmax; 0 at outliers
    topk: torch.Tensor      # [hkv, kslots] the top-k chunks of `scores` (ascending)
    selected: torch.Tensor  # [hkv, kslots] chunks used for attention (topk unless overridden)
    out: torch.Tensor       # [hq, d] ShadowKV attention output
    full: torch.Tensor      # [hq, d] full attention over all S exact keys
    coverage: torch.Tensor  # [hq] full-attention probability mass on the tokens ShadowKV attends


def decode_step(inp, pre, q, position, prec=EXACT, selected=None):
    """Algorithm 2 for one query [hq, d] at `position`. `selected` overrides top-k."""
    dt = prec.compute
    hkv, S, d = pre.k_rope.shape
    G, C, n = inp.group, inp.chunk, inp.n_chunks
    dev = pre.k_rope.device
    pos = torch.tensor([position], device=dev)
    q_rope = prec.store(apply_rope(q.to(dt)[:, None, :], pos, inp.inv_freq)[:, 0, :])  # [hq, d]
    kv_of = torch.arange(inp.hq, device=dev) // G

    # Chunk scores against the landmarks; outlier chunks take no part in the softmax.
    valid = torch.ones(hkv, n, dtype=torch.bool, device=dev)
    valid[torch.arange(hkv, device=dev)[:, None], pre.outliers] = False
    logits = torch.einsum("jd,jnd->jn", q_rope, pre.landmarks[kv_of]) * inp.scale  # [hq, n]
    logits = logits.masked_fill(~valid[kv_of], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    scores = prec.store(probs.reshape(hkv, G, n).amax(dim=1))                    # [hkv, n]
    topk = largest_k(scores.masked_fill(~valid, float("-inf")), inp.kslots)
    if selected is None:
        selected = topk
    selected = selected.long()

    # Sparse attention: [outliers (exact); selected (rebuilt K, exact V); local window (exact)].
    local = torch.arange(n * C, S, device=dev)
    out = torch.empty(inp.hq, d, dtype=dt, device=dev)
    full = torch.empty(inp.hq, d, dtype=dt, device=dev)
    coverage = torch.empty(inp.hq, dtype=dt, device=dev)
    for h in range(hkv):
        out_tok = chunk_tokens(pre.outliers[h], C)
        sel_tok = chunk_tokens(selected[h], C)
        k_sel = prec.store(apply_rope(pre.k_low[h, sel_tok], sel_tok, inp.inv_freq))
        K = torch.cat([pre.k_rope[h, out_tok], k_sel, pre.k_rope[h, local]])
        V = torch.cat([pre.v[h, out_tok], pre.v[h, sel_tok], pre.v[h, local]])
        heads = slice(h * G, (h + 1) * G)
        out[heads] = attend(q_rope[heads], K, V, inp.scale)

        # Full attention (exact keys everywhere), for information.
        p_full = torch.softmax((q_rope[heads] @ pre.k_rope[h].T) * inp.scale, dim=-1)  # [G, S]
        full[heads] = p_full @ pre.v[h]
        attended = torch.zeros(S, dtype=torch.bool, device=dev)
        attended[torch.cat([out_tok, sel_tok, local])] = True
        coverage[heads] = p_full[:, attended].sum(-1)
    return Step(scores=scores, topk=topk, selected=selected, out=out, full=full, coverage=coverage)


# ----------------------------------------------------------------------------
# Whole run
# ----------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    pre: Prefill
    scores: torch.Tensor    # [steps, hkv, n_chunks]
    topk: torch.Tensor      # [steps, hkv, kslots]
    selected: torch.Tensor  # [steps, hkv, kslots]
    out: torch.Tensor       # [steps, hq, d]
    full: torch.Tensor      # [steps, hq, d]
    coverage: torch.Tensor  # [steps, hq]


def run_reference(inp, prec=EXACT, outliers=None, selected=None, pre=None, shards=None):
    """Prefill, then every decode step. `outliers` [hkv, O] and `selected`
    [steps, hkv, kslots] replace the reference's own decisions (the comparator
    uses that to check each stage given the engine's previous decisions).
    `pre` reuses an earlier prefill of the same inputs and precision;
    `shards` (token bounds) runs the sharded prefill."""
    if pre is None:
        pre = prefill(inp, prec, outliers=outliers, shards=shards)
    elif outliers is not None:
        pre = dataclasses.replace(pre, outliers=outliers.long().to(pre.outliers.device))
    steps = [decode_step(inp, pre, inp.q[i], inp.seq + i, prec,
                         selected=None if selected is None else selected[i])
             for i in range(inp.steps)]
    stack = lambda name: torch.stack([getattr(s, name) for s in steps])
    return Result(pre=pre, scores=stack("scores"), topk=stack("topk"), selected=stack("selected"),
                  out=stack("out"), full=stack("full"), coverage=stack("coverage"))


def result_tensors(res):
    """The engine's output format (see README.md)."""
    return {
        "landmarks": res.pre.landmarks.to(F32).cpu().contiguous(),
        "outliers": res.pre.outliers.to(torch.int32).cpu().contiguous(),
        "selected": res.selected.to(torch.int32).cpu().contiguous(),
        "out": res.out.to(F32).cpu().contiguous(),
        "scores": res.scores.to(F32).cpu().contiguous(),
    }


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def margins(inp, res):
    """How far the reference's decisions are from ties (relative gaps at the cut)."""
    out = {}
    min_cos, scores, outliers = res.pre.min_cos.cpu(), res.scores.cpu(), res.pre.outliers.cpu()
    if inp.outliers > 0:
        mc = min_cos.sort(dim=-1).values
        out["outlier_cut_gap"] = (mc[:, inp.outliers] - mc[:, inp.outliers - 1]).min().item()
    valid = torch.ones_like(scores, dtype=torch.bool)
    for h in range(inp.hkv):
        valid[:, h, outliers[h]] = False
    sc = scores.masked_fill(~valid, -1.0).sort(dim=-1, descending=True).values
    k = inp.kslots
    if k < inp.n_chunks - inp.outliers:
        kth, nxt = sc[..., k - 1], sc[..., k]
        out["select_cut_rel_gap"] = ((kth - nxt) / kth).min().item()
    return out


# Unit roundoff of float32: the scale of the backward error of an f32 solver.
F32_EPS = 2.0 ** -24


def cut_conditioning(inp, pre):
    """How well-posed the rank-r truncation is, from the float64 singular
    values s_1 >= s_2 >= ... of each shard's pre-RoPE keys ([len, hkv*d]).

    Near the cut, the rank-r factors are determined only up to rotations
    between the r-th and (r+1)-th singular directions of about
    (backward error) / (s_r - s_{r+1}) (Wedin). A float32 engine's backward
    error is about eps * s_1 for an SVD of the keys and eps * s_1^2, relative
    to s_r^2 - s_{r+1}^2, for an eigensolver of the Gram matrix K^T K (which
    squares the conditioning). Where that rotation is not small, a correct
    float32 engine's rank-r keys differ from the float64 reference's by up to
    about the rotation times s_r, and the comparison of the output is not
    well-posed. Reported, worst over the shards (a shard that its rank covers
    whole is exact and skipped):
      cut_sigma_r_rel     s_r / s_1
      cut_sigma_next_rel  s_{r+1} / s_1 (what the truncation drops, relative)
      cut_rel_gap         (s_r - s_{r+1}) / s_r
      cut_f32_rotation    min(1, eps * s_1^2 / (s_r^2 - s_{r+1}^2)), the Gram
                          eigensolver's (the larger) bound, eps = 2^-24
      cut_f32_key_err     cut_f32_rotation * hypot(s_r, s_{r+1}) / ||K||_F: the
                          order of magnitude of the relative difference between
                          a correct f32 engine's rank-r keys and the reference's
    """
    r = inp.rank
    worst = {"cut_sigma_r_rel": 0.0, "cut_sigma_next_rel": 0.0, "cut_rel_gap": 1.0, "cut_f32_rotation": 0.0,
             "cut_f32_key_err": 0.0}
    for s in pre.sigmas or []:
        s = s.tolist()
        if r >= len(s) or s[0] <= 0:
            continue
        s1, sr, sn = s[0], s[r - 1], s[r]
        gap2 = sr * sr - sn * sn
        rotation = 1.0 if gap2 <= 0 else min(1.0, F32_EPS * s1 * s1 / gap2)
        worst["cut_sigma_r_rel"] = max(worst["cut_sigma_r_rel"], sr / s1)
        worst["cut_sigma_next_rel"] = max(worst["cut_sigma_next_rel"], sn / s1)
        worst["cut_rel_gap"] = min(worst["cut_rel_gap"], (sr - sn) / sr if sr > 0 else 0.0)
        worst["cut_f32_rotation"] = max(worst["cut_f32_rotation"], rotation)
        worst["cut_f32_key_err"] = max(worst["cut_f32_key_err"],
                                       rotation * math.hypot(sr, sn) / math.sqrt(sum(x * x for x in s)))
    return worst


def summarize(inp, res):
    info = {
        "S": inp.seq, "hkv": inp.hkv, "hq": inp.hq, "d": inp.d, "rank": inp.rank, "chunk": inp.chunk,
        "n_chunks": inp.n_chunks, "kslots": inp.kslots, "outliers": inp.outliers,
        "local_tokens": inp.seq - inp.n_chunks * inp.chunk,
        "sparse_vs_full_rel_err": rel_err(res.out, res.full),
        "coverage_mean": res.coverage.mean().item(), "coverage_min": res.coverage.min().item(),
        "top_score_mean": res.scores.amax(dim=-1).mean().item(),
    }
    info.update(margins(inp, res))
    info.update(cut_conditioning(inp, res.pre))
    return info


# ----------------------------------------------------------------------------
# Synthetic inputs
# ----------------------------------------------------------------------------

def make_inputs(seed=0, seq=8192, hkv=8, group=4, d=128, rank=160, chunk=8, budget=2048,
                outliers=48, local_window=32, rope_theta=500000.0, steps=8,
                latent=256, decay=40.0, noise=0.005, spikes=None, segments=None):
    """Realistic-ish keys: a time-smooth latent walk through a projection whose
    component j has weight exp(-j / decay) (a geometrically decaying spectrum),
    a per-channel bias (as real keys have), small noise, larger magnitude in the
    low-frequency RoPE pairs, and a few "spike" tokens (token 0, like an
    attention sink, plus random ones) in unrelated directions; these make their
    chunks outliers. Queries aim at a few target tokens per query head
    (post-RoPE aligned with the target key), so attention is peaked; targets
    persist over steps mostly.

    `segments` (token bounds [0, b1, ..., S]): each segment projects the walk
    with its own projection, so each has its own key subspace (`latent`
    dimensions, plus the bias and its spikes). With `latent + 1 + spikes <
    rank` and a small `noise`, a shard equal to a segment has all its signal
    above the rank-r cut and only noise at it, so its rank-r keys are
    well-posed, while the whole sequence's rank-r factors are lossy (README.md,
    "Conditioning of the rank-r cut")."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=F64)
    N, hq = hkv * d, hkv * group

    # Channel magnitudes: low-frequency pairs (large i) carry more energy.
    pair = 0.25 + 1.5 * torch.arange(d // 2, dtype=F64) / max(1, d // 2 - 1)
    per_head = torch.exp(0.3 * randn(hkv, 1))
    channel = (per_head * torch.cat([pair, pair])[None, :]).reshape(N)

    # AR(1) latent walk with unit variance: neighbouring tokens are similar.
    rho = 0.97
    e = randn(seq, latent)
    Z = torch.empty_like(e)
    Z[0] = e[0]
    for t in range(1, seq):
        Z[t] = rho * Z[t - 1] + math.sqrt(1 - rho * rho) * e[t]
    weight = torch.exp(-torch.arange(latent, dtype=F64) / decay)
    W = randn(latent, N) * (weight / weight.norm())[:, None]  # unit variance per channel
    ZW = Z @ W
    if segments is not None:
        bounds = [int(b) for b in segments]
        _require(len(bounds) >= 2 and bounds[0] == 0 and bounds[-1] == seq
                 and all(a < b for a, b in zip(bounds, bounds[1:])),
                 f"segments {bounds}: must increase from 0 to seq {seq}")
        for b0, b1 in zip(bounds[1:], bounds[2:]):  # the first segment keeps W
            ZW[b0:b1] = Z[b0:b1] @ (randn(latent, N) * (weight / weight.norm())[:, None])
    K = (ZW + 0.5 * randn(N)[None, :]) * channel + noise * randn(seq, N)

    if spikes is None:
        spikes = max(4, seq // 1024)
    n_chunks = (seq - local_window) // chunk
    spike_tokens = torch.cat([torch.zeros(1, dtype=torch.long),
                              1 + torch.randperm(max(1, n_chunks * chunk - 1), generator=g)[: spikes - 1]])
    K[spike_tokens] = 3.0 * randn(len(spike_tokens), N) * channel
    k_pre = K.reshape(seq, hkv, d).permute(1, 0, 2).contiguous()
    v = randn(hkv, seq, d)

    inv_freq = hf_inv_freq(rope_theta, d)
    scale = 1.0 / math.sqrt(d)
    q = torch.empty(steps, hq, d, dtype=F64)
    targets = torch.randint(0, seq, (hq, 2), generator=g)
    for i in range(steps):
        renew = torch.rand(hq, generator=g) < 0.2
        targets[renew] = torch.randint(0, seq, (int(renew.sum()), 2), generator=g)
        for j in range(hq):
            h = j // group
            acc = torch.zeros(d, dtype=F64)
            for t in targets[j].tolist():
                k = k_pre[h, t]
                want = 6.0 + 6.0 * torch.rand(1, generator=g, dtype=F64).item()  # target logit
                alpha = want / (scale * k.dot(k).item())
                # RoPE(q, S + i) = alpha * RoPE(k, t)  <=>  q = alpha * RoPE(k, t - S - i)
                acc += alpha * apply_rope(k[None, :], torch.tensor([t - seq - i]), inv_freq)[0]
            q[i, j] = acc + 0.3 * acc.norm() / math.sqrt(d) * randn(d)

    tensors = {"k_pre": k_pre.to(F32), "v": v.to(F32), "q": q.to(F32), "inv_freq": inv_freq}
    meta = {
        "format": INPUTS_FORMAT,
        "rank": str(rank), "chunk": str(chunk), "budget": str(budget), "outliers": str(outliers),
        "local_window": str(local_window), "rope_theta": repr(float(rope_theta)), "scale": repr(scale),
        "steps": str(steps),
        # Informational (derivable from shapes and the keys above).
        "seq": str(seq), "hkv": str(hkv), "hq": str(hq), "group": str(group), "head_dim": str(d),
        "n_chunks": str(n_chunks), "kslots": str(budget // chunk), "seed": str(seed),
        "latent": str(latent), "decay": repr(float(decay)), "noise": repr(float(noise)), "spikes": str(spikes),
    }
    if segments is not None:
        meta["segments"] = ",".join(str(int(b)) for b in segments)
    return tensors, meta


def inputs_from(tensors, meta):
    return Inputs(k_pre=tensors["k_pre"], v=tensors["v"], q=tensors["q"], inv_freq=tensors["inv_freq"],
                  **{k: int(meta[k]) for k in META_INT_KEYS},
                  **{k: float(meta[k]) for k in META_FLOAT_KEYS}).validate()


def save_tensors(path, tensors, meta):
    save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, path, metadata=meta)


# ----------------------------------------------------------------------------
# Self-test
# ----------------------------------------------------------------------------

def self_test():
    """Exactness and sanity checks of the reference, then of the comparator.
    Returns the number of failed checks."""
    failures = 0

    def check(name, ok, detail):
        nonlocal failures
        failures += 0 if ok else 1
        print(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}")

    print("reference:")
    g = torch.Generator().manual_seed(1)
    d = 16
    inv = hf_inv_freq(10000.0, d)
    x = torch.randn(5, d, generator=g, dtype=F64)
    pos = torch.tensor([0, 1, 7, 100, 4000])
    rx = apply_rope(x, pos, inv)
    check("rope: position 0 is identity", torch.equal(rx[0], x[0]), "")
    check("rope: norm preserved", torch.allclose(rx.norm(dim=-1), x.norm(dim=-1), rtol=0, atol=1e-12), "")
    i, p = 3, 3
    ang = torch.tensor(float(pos[p]), dtype=F32) * inv[i]
    c, s = math.cos(ang.item()), math.sin(ang.item())
    x0, x1 = x[p, i].item(), x[p, i + d // 2].item()
    want = (x0 * c - x1 * s, x1 * c + x0 * s)
    got = (rx[p, i].item(), rx[p, i + d // 2].item())
    check("rope: rotate-half pairing (i, i+d/2)",
          abs(got[0] - want[0]) < 1e-12 and abs(got[1] - want[1]) < 1e-12, f"{got} vs {want}")
    y = torch.randn(d, generator=g, dtype=F64)
    a = apply_rope(x[1:2], torch.tensor([57]), inv)[0].dot(apply_rope(y[None], torch.tensor([50]), inv)[0])
    b = apply_rope(x[1:2], torch.tensor([7]), inv)[0].dot(y)
    check("rope: scores depend on relative position",
          abs(a - b).item() < 1e-5 * (x[1].norm() * y.norm()).item(),
          f"{a.item():.9f} vs {b.item():.9f}")

    # Small problems: full rank + every non-outlier chunk selected => exact attention.
    small = dict(seq=512, hkv=2, group=3, d=64, chunk=8, local_window=32, rope_theta=10000.0,
                 steps=3, latent=8, spikes=3)
    n_chunks = (512 - 32) // 8
    for O in (0, 4):
        t, m = make_inputs(seed=3, rank=2 * 64, budget=(n_chunks - O) * 8, outliers=O, **small)
        inp = inputs_from(t, m)
        res = run_reference(inp)
        recon = res.pre.k_low  # A @ B: [hkv, S, d]
        check(f"O={O}: full-rank A@B equals k_pre", (recon - inp.k_pre.to(F64)).abs().max().item() < 1e-10,
              f"max abs diff {(recon - inp.k_pre.to(F64)).abs().max().item():.3e}")
        diff = (res.out - res.full).abs().max().item()
        check(f"O={O}: all chunks + full rank == full attention", diff < 1e-10, f"max abs diff {diff:.3e}")
        check(f"O={O}: coverage is 1", abs(res.coverage.min().item() - 1) < 1e-12, "")
        # Sharded (two shards, each factored alone, two outliers each): still exact.
        res = run_reference(inp, shards=[0, 256, 512])
        diff = (res.out - res.full).abs().max().item()
        check(f"O={O}: shards [0, 256, 512] + full rank == full attention", diff < 1e-10, f"max abs diff {diff:.3e}")
        per_shard = [int((res.pre.outliers[h] < 32).sum()) for h in range(inp.hkv)]
        check(f"O={O}: each shard keeps its share of the outliers", per_shard == [O // 2] * inp.hkv,
              f"outliers in shard 0 per head {per_shard}")

    t, m = make_inputs(seed=4, rank=12, budget=64, outliers=4, **small)
    inp = inputs_from(t, m)
    res = run_reference(inp)
    info = summarize(inp, res)
    ok_scores = bool((res.scores.sum(-1) > 0).all()) and bool((res.scores <= 1).all())
    zero_at_outliers = all(res.scores[:, h, res.pre.outliers[h]].abs().max().item() == 0
                           for h in range(inp.hkv))
    check("scores are probabilities, 0 at outliers", ok_scores and zero_at_outliers, "")
    disjoint = all(not set(res.selected[i, h].tolist()) & set(res.pre.outliers[h].tolist())
                   for i in range(inp.steps) for h in range(inp.hkv))
    check("selected chunks exclude outliers", disjoint, "")
    print(f"  (info) low rank 12 of 128: sparse vs full rel err {info['sparse_vs_full_rel_err']:.3e}, "
          f"coverage mean {info['coverage_mean']:.3f}; chunk 0 outlier on heads: "
          f"{[0 in res.pre.outliers[h].tolist() for h in range(inp.hkv)]}; margins {margins(inp, res)}")

    # Segments with their own key subspaces, each spanning fewer than `rank`
    # directions above the noise: every shard's cut is in the noise, the whole
    # sequence's is not (README.md, "Conditioning of the rank-r cut").
    t, m = make_inputs(seed=6, rank=16, budget=64, outliers=4, noise=1e-5, segments=[0, 256, 512], **small)
    inp = inputs_from(t, m)
    per_shard = cut_conditioning(inp, prefill(inp, shards=[0, 256, 512]))
    whole = cut_conditioning(inp, prefill(inp))
    check("segments: each shard's rank-r cut is in the noise, the sequence's is not",
          per_shard["cut_sigma_r_rel"] < 1e-4 and whole["cut_sigma_r_rel"] > 1e-3,
          f"s_r/s_1 per shard {per_shard['cut_sigma_r_rel']:.2e}, whole {whole['cut_sigma_r_rel']:.2e}")

    print("comparator:")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import compare_shadowkv as cmp
    with tempfile.TemporaryDirectory() as tmp:
        t, m = make_inputs(seed=5, rank=12, budget=96, outliers=4, **small)
        in_path = os.path.join(tmp, "in.safetensors")
        save_tensors(in_path, t, m)
        inp = load_inputs(in_path)
        res = run_reference(inp)

        def compare(ours, bf16=False):
            path = os.path.join(tmp, "ours.safetensors")
            save_tensors(path, ours, {"format": OUTPUTS_FORMAT})
            return cmp.compare(inp, path, bf16=bf16, quiet=True)

        base = result_tensors(res)
        check("reference itself passes", compare(base)["pass"], "")
        bad = dict(base, out=base["out"] * 1.01)
        check("1% output error fails", not compare(bad)["pass"], "")
        sel = base["selected"].clone()
        h = 0
        chosen = set(sel[0, h].tolist()) | set(base["outliers"][h].tolist())
        worst = min((c for c in range(inp.n_chunks) if c not in chosen),
                    key=lambda c: base["scores"][0, h, c].item())
        sel[0, h, 0] = worst
        sel[0, h] = sel[0, h].sort().values
        check("a far-from-tie selection swap fails", not compare(dict(base, selected=sel))["pass"], "")
        outl = base["outliers"].clone()
        if inp.outliers > 0:
            best = max((c for c in range(inp.n_chunks) if c not in set(outl[0].tolist())),
                       key=lambda c: res.pre.min_cos[0, c].item())
            outl[0, 0] = best
            outl[0] = outl[0].sort().values
            check("a far-from-tie outlier swap fails", not compare(dict(base, outliers=outl))["pass"], "")
        lm = base["landmarks"].clone()
        c = min(set(range(inp.n_chunks)) - set(base["outliers"][1].tolist()))
        lm[1, c] *= 1.1
        check("a 10% landmark error fails", not compare(dict(base, landmarks=lm))["pass"], "")
        for name, bf16 in (("f32", False), ("bf16", True)):
            emu = result_tensors(run_reference(inp, EMULATIONS[name]))
            summary = compare(emu, bf16=bf16)
            check(f"emulated {name} engine passes {name} tolerances", summary["pass"],
                  f"failed checks: {[c for c, v in summary['checks'].items() if not v['ok']]}")
    print(f"self-test: {'PASS' if failures == 0 else f'{failures} FAILED'}")
    return failures


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    mk = sub.add_parser("make-inputs", help="write a synthetic inputs file")
    mk.add_argument("--out", required=True)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--seq", type=int, default=8192)
    mk.add_argument("--hkv", type=int, default=8)
    mk.add_argument("--group", type=int, default=4, help="query heads per KV head")
    mk.add_argument("--d", type=int, default=128)
    mk.add_argument("--rank", type=int, default=160)
    mk.add_argument("--chunk", type=int, default=8)
    mk.add_argument("--budget", type=int, default=2048, help="sparse budget in tokens")
    mk.add_argument("--outliers", type=int, default=48, help="outlier chunks per KV head")
    mk.add_argument("--local-window", type=int, default=32)
    mk.add_argument("--rope-theta", type=float, default=500000.0)
    mk.add_argument("--steps", type=int, default=8)
    mk.add_argument("--latent", type=int, default=256, help="dimensions of the keys' latent walk")
    mk.add_argument("--decay", type=float, default=40.0,
                    help="latent component j of the keys has weight exp(-j / decay)")
    mk.add_argument("--noise", type=float, default=0.005, help="i.i.d. key noise per channel")
    mk.add_argument("--spikes", type=int, help="spike tokens (default max(4, seq // 1024))")
    mk.add_argument("--segments", help="token bounds of segments with their own key subspace, e.g. 0,4096,8192")
    mk.add_argument("--shards", help="token bounds of context-parallel shards for the printed statistics, "
                    "e.g. 0,4096,8192 (the inputs do not depend on it)")
    mk.add_argument("--no-stats", action="store_true", help="skip running the reference on the result")

    rn = sub.add_parser("run", help="write reference results in the engine's output format")
    rn.add_argument("--inputs", required=True)
    rn.add_argument("--out", required=True)
    rn.add_argument("--emulate", choices=sorted(EMULATIONS), default="exact",
                    help="exact: the f64 reference; f32/bf16: a rough engine emulation")
    rn.add_argument("--device", default="cpu")
    rn.add_argument("--shards", help="token bounds of context-parallel shards, e.g. 0,4096,8192")

    sub.add_parser("self-test", help="exactness and sanity checks (CPU, float64)")

    args = ap.parse_args(argv)
    if args.cmd == "make-inputs":
        tensors, meta = make_inputs(
            seed=args.seed, seq=args.seq, hkv=args.hkv, group=args.group, d=args.d, rank=args.rank,
            chunk=args.chunk, budget=args.budget, outliers=args.outliers,
            local_window=args.local_window, rope_theta=args.rope_theta, steps=args.steps,
            latent=args.latent, decay=args.decay, noise=args.noise, spikes=args.spikes,
            segments=[int(b) for b in args.segments.split(",")] if args.segments else None)
        inp = inputs_from(tensors, meta)  # validates before writing
        save_tensors(args.out, tensors, meta)
        print(f"wrote {args.out}: " + ", ".join(f"{k}={v}" for k, v in meta.items() if k != "format"))
        if not args.no_stats:
            shards = [int(b) for b in args.shards.split(",")] if args.shards else None
            info = summarize(inp, run_reference(inp, shards=shards))
            print("reference: " + ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items()))
        return 0
    if args.cmd == "run":
        inp = load_inputs(args.inputs, args.device)
        shards = [int(b) for b in args.shards.split(",")] if args.shards else None
        res = run_reference(inp, EMULATIONS[args.emulate], shards=shards)
        meta = {"format": OUTPUTS_FORMAT, "producer": "shadowkv_reference.py",
                "emulate": args.emulate, "dtype": "bf16" if args.emulate == "bf16" else "f32"}
        if shards:
            meta.update(mode="cp" + str(len(shards) - 1), shards=args.shards)
        save_tensors(args.out, result_tensors(res), meta)
        print(f"wrote {args.out}")
        return 0
    if args.cmd == "self-test":
        torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
        return 1 if self_test() else 0
    return 2


if __name__ == "__main__":
    sys.exit(main())

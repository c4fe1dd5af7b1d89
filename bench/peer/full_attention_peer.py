#!/usr/bin/env python3
"""The full-attention peer: plain PyTorch on the same GPU, the baseline every
"Nx the peer" in docs/benchmarks.md is measured against.

The model is Llama-3.1-8B-shaped (32 layers, 32 query / 8 KV heads of 128,
hidden 4096, FFN 14336, vocab 128256) with random bf16 weights: it measures
time, not answers. Modes:

  decode                  full-attention decode: a KV cache of --context tokens
                          per sequence (random values, allocated up front),
                          the largest batch that fits (or --batch), one token
                          per sequence per step, attention by SDPA.
  decode --graph          the same step captured once as a CUDA graph and
                          replayed: no Python or launch cost per step, the
                          tightest peer. Every replay does one real step's work
                          at the same context.
  decode --shared-prefix  --batch sequences (default 64) over ONE copy of a
                          --context-token prefix (a document), each with its
                          own --suffix tokens (its question): the prefix is
                          attended once per KV head for all the batch's queries,
                          each suffix per sequence, and the two partial
                          softmaxes merged exactly by their log-sum-exp
                          (cascade attention). Combine with --graph.
  prefill                 one --context-token prompt through the model (causal
                          SDPA, the MLP in 8192-token pieces): the time to the
                          first token with plain PyTorch.
  hf                      decode through Hugging Face transformers (sdpa
                          attention, DynamicCache filled with --context tokens).

One JSON object per measurement on stdout, e.g.
  {"peer": "pytorch-sdpa-cudagraph", "mode": "decode", "context": 124928, "batch": 3,
   "tokens_per_s": 129.8, "ms_per_step": 23.11, "gpu": "NVIDIA H100 80GB HBM3"}
fields: peer, mode, context, batch, tokens_per_s and ms_per_step (decode),
suffix (shared prefix), seconds (prefill), gpu.

Run it in the same device call as the project's own bench (ops/device/bench.sh
does, the peer first and last) and compare ratios within a call:
  python3 bench/peer/full_attention_peer.py decode --graph --steps 20 --context 124928
  python3 bench/peer/full_attention_peer.py decode --shared-prefix --graph --batch 64 --context 124928
  python3 bench/peer/full_attention_peer.py prefill --context 124928
It needs PyTorch and a CUDA GPU (transformers for hf); --help works without them.
"""
import argparse
import json
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Full-attention PyTorch peer (Llama-3.1-8B shape, random bf16 weights) on the GPU.")
    p.add_argument("mode", choices=["decode", "prefill", "hf"])
    p.add_argument("--context", type=int, nargs="+", default=[61440, 122880],
                   help="context lengths in tokens, one measurement each")
    p.add_argument("--batch", type=int, default=0, help="sequences; 0 = the largest that fits (64 for --shared-prefix)")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--reserve-gib", type=float, default=4.0, help="GPU memory left free for activations")
    p.add_argument("--graph", action="store_true", help="decode: replay the step as a CUDA graph")
    p.add_argument("--shared-prefix", action="store_true", help="decode: one shared prefix, --batch sequences")
    p.add_argument("--suffix", type=int, default=64, help="shared-prefix: per-sequence tokens before decoding")
    return p.parse_args(argv)


class Peer:
    """The measurements, over one set of shapes. torch is imported here, not at
    module load, so that --help and the CPU tests run without it."""

    def __init__(self, a):
        import torch
        import torch.nn.functional as F
        self.torch, self.F, self.a = torch, F, a
        self.dev, self.dt = "cuda", torch.bfloat16
        self.gpu = torch.cuda.get_device_name()
        torch.manual_seed(0)
        self.L, self.H, self.KVH, self.D = a.layers, a.heads, a.kv_heads, a.head_dim
        self.HID, self.FFN, self.V = a.hidden, a.ffn, a.vocab

    # --- helpers -----------------------------------------------------------

    def emit(self, **fields):
        print(json.dumps(dict(fields, gpu=self.gpu)), flush=True)

    def rand(self, *shape, scale=None):
        t = self.torch.randn(*shape, device=self.dev, dtype=self.dt)
        return t if scale is None else t * scale

    def free_gib(self):
        return self.torch.cuda.mem_get_info()[0] / 2**30

    def norm(self, x):
        return self.F.rms_norm(x, (self.HID,))

    def seconds_per_call(self, fn, n):
        """Mean seconds of fn() over n calls, after two untimed calls."""
        cuda = self.torch.cuda
        fn()
        fn()
        cuda.synchronize()
        t0 = time.time()
        for _ in range(n):
            fn()
        cuda.synchronize()
        return (time.time() - t0) / n

    def as_graph(self, fn):
        """fn recorded once into a CUDA graph (after two warm-up runs on a side
        stream); returns the graph's replay."""
        cuda = self.torch.cuda
        side = cuda.Stream()
        side.wait_stream(cuda.current_stream())
        with cuda.stream(side):
            fn()
            fn()
        cuda.current_stream().wait_stream(side)
        g = cuda.CUDAGraph()
        with cuda.graph(g):
            fn()
        return g.replay

    # --- the model ---------------------------------------------------------

    def make_weights(self):
        L, H, KVH, D, HID, FFN, V = self.L, self.H, self.KVH, self.D, self.HID, self.FFN, self.V
        w = lambda *s: self.rand(*s, scale=0.02)  # noqa: E731
        self.w_qkv = [w(HID, (H + 2 * KVH) * D) for _ in range(L)]
        self.w_o = [w(H * D, HID) for _ in range(L)]
        self.w_gate_up = [w(HID, 2 * FFN) for _ in range(L)]
        self.w_down = [w(FFN, HID) for _ in range(L)]
        self.embed, self.lm_head = w(V, HID), w(HID, V)

    def kv_cache(self, batch, length):
        """Per layer, random keys and values [batch, kv heads, length, head dim]."""
        shape = (batch, self.KVH, length, self.D)
        self.k = [self.rand(*shape) for _ in range(self.L)]
        self.v = [self.rand(*shape) for _ in range(self.L)]

    def drop_cache(self):
        self.k = self.v = None
        self.torch.cuda.empty_cache()

    def qkv(self, l, x):
        H, KVH, D = self.H, self.KVH, self.D
        return (self.norm(x) @ self.w_qkv[l]).split([H * D, KVH * D, KVH * D], -1)

    def mlp(self, l, x):
        gate, up = (self.norm(x) @ self.w_gate_up[l]).chunk(2, -1)
        return (self.F.silu(gate) * up) @ self.w_down[l]

    def block(self, l, x, pos, causal):
        """One decoder layer over x [b, t, hidden] at positions pos..pos+t-1:
        its keys and values written into the cache, attention over the cache
        up to them, then the MLP in pieces of 8192 tokens (long prompts fit)."""
        b, t, _ = x.shape
        H, KVH, D = self.H, self.KVH, self.D
        q, k, v = self.qkv(l, x)
        self.k[l][:, :, pos:pos + t] = k.view(b, t, KVH, D).transpose(1, 2)
        self.v[l][:, :, pos:pos + t] = v.view(b, t, KVH, D).transpose(1, 2)
        o = self.F.scaled_dot_product_attention(
            q.view(b, t, H, D).transpose(1, 2), self.k[l][:, :, :pos + t], self.v[l][:, :, :pos + t],
            is_causal=causal, enable_gqa=True)
        x = x + o.transpose(1, 2).reshape(b, t, H * D) @ self.w_o[l]
        for s in range(0, t, 8192):
            x[:, s:s + 8192] += self.mlp(l, x[:, s:s + 8192])
        return x

    def next_token(self, x):
        return (self.norm(x) @ self.lm_head).argmax(-1)

    def step(self, tok, pos):
        """One decode step of every sequence: token ids [b, 1] at position pos."""
        x = self.embed[tok]
        for l in range(self.L):
            x = self.block(l, x, pos, causal=False)
        return self.next_token(x)

    # --- modes -------------------------------------------------------------

    def decode(self):
        a, torch = self.a, self.torch
        if a.shared_prefix:
            return self.decode_shared_prefix()
        self.make_weights()
        for ctx in a.context:
            room = ctx + a.steps + 4
            gib_per_seq = 2 * self.L * self.KVH * room * self.D * 2 / 2**30
            batch = a.batch or max(1, int((self.free_gib() - a.reserve_gib) // gib_per_seq))
            self.kv_cache(batch, room)
            tok = torch.zeros(batch, 1, dtype=torch.long, device=self.dev)
            if a.graph:
                # every replay decodes at position ctx: one real step's work
                dt = self.seconds_per_call(self.as_graph(lambda: tok.copy_(self.step(tok, ctx))), a.steps)
            else:
                for i in range(2):
                    tok = self.step(tok, ctx + i)
                torch.cuda.synchronize()
                t0 = time.time()
                for i in range(a.steps):
                    tok = self.step(tok, ctx + 2 + i)
                torch.cuda.synchronize()
                dt = (time.time() - t0) / a.steps
            self.emit(peer="pytorch-sdpa" + ("-cudagraph" if a.graph else ""), mode="decode", context=ctx,
                      batch=batch, tokens_per_s=round(batch / dt, 1), ms_per_step=round(dt * 1e3, 2))
            self.drop_cache()

    def attention_with_lse(self, q, k, v):
        """Attention output and the log-sum-exp of each query row's scores."""
        out, lse = self.torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
        return out, lse

    def decode_shared_prefix(self):
        a, torch = self.a, self.torch
        L, H, KVH, D = self.L, self.H, self.KVH, self.D
        group = H // KVH
        self.make_weights()
        for ctx in a.context:
            batch, room = a.batch or 64, a.suffix + a.steps + 4
            prefix_k = [self.rand(1, KVH, ctx, D) for _ in range(L)]
            prefix_v = [self.rand(1, KVH, ctx, D) for _ in range(L)]
            own_k = [self.rand(batch, KVH, room, D) for _ in range(L)]
            own_v = [self.rand(batch, KVH, room, D) for _ in range(L)]
            pos = a.suffix  # each sequence holds --suffix tokens of its own; the step writes the next
            tok = torch.zeros(batch, 1, dtype=torch.long, device=self.dev)

            def one_step():
                x = self.embed[tok]
                for l in range(L):
                    q, k, v = self.qkv(l, x)
                    own_k[l][:, :, pos] = k.view(batch, KVH, D)
                    own_v[l][:, :, pos] = v.view(batch, KVH, D)
                    q = q.view(batch, KVH, group, D)
                    # the document: every sequence's queries of a KV head in one
                    # call against the single shared copy
                    qd = q.permute(1, 0, 2, 3).reshape(1, KVH, batch * group, D)
                    od, lse_d = self.attention_with_lse(qd, prefix_k[l], prefix_v[l])
                    od = od.view(KVH, batch, group, D).permute(1, 0, 2, 3)
                    lse_d = lse_d.view(KVH, batch, group).permute(1, 0, 2)
                    # each sequence's own tokens (its query heads as rows of its KV head)
                    oo, lse_o = self.attention_with_lse(q, own_k[l][:, :, :pos + 1], own_v[l][:, :, :pos + 1])
                    # exact merge: weight of the document part = e^lse_d / (e^lse_d + e^lse_o)
                    w = torch.sigmoid(lse_d - lse_o).unsqueeze(-1)
                    o = (w * od.float() + (1 - w) * oo.float()).to(self.dt)
                    x = x + o.reshape(batch, 1, H * D) @ self.w_o[l]
                    x = x + self.mlp(l, x)
                tok.copy_(self.next_token(x))

            fn = self.as_graph(one_step) if a.graph else one_step
            dt = self.seconds_per_call(fn, a.steps)
            self.emit(peer="pytorch-sdpa-shared-prefix" + ("-cudagraph" if a.graph else ""), mode="decode",
                      context=ctx, batch=batch, suffix=a.suffix, tokens_per_s=round(batch / dt, 1),
                      ms_per_step=round(dt * 1e3, 2))
            del prefix_k, prefix_v, own_k, own_v
            torch.cuda.empty_cache()

    def prefill(self):
        a, torch = self.a, self.torch
        self.make_weights()
        for ctx in a.context:
            self.kv_cache(1, ctx)
            prompt = torch.randint(0, self.V, (1, ctx), device=self.dev)

            def first_token():
                x = self.embed[prompt]
                for l in range(self.L):
                    x = self.block(l, x, 0, causal=True)
                return self.next_token(x[:, -1:])

            first_token()  # warm-up
            torch.cuda.synchronize()
            t0 = time.time()
            first_token()
            torch.cuda.synchronize()
            self.emit(peer="pytorch-sdpa", mode="prefill", context=ctx, batch=1, seconds=round(time.time() - t0, 3))
            self.drop_cache()

    def hf(self):
        a, torch = self.a, self.torch
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(hidden_size=self.HID, intermediate_size=self.FFN, num_hidden_layers=self.L,
                          num_attention_heads=self.H, num_key_value_heads=self.KVH, vocab_size=self.V,
                          max_position_embeddings=1 << 20, rope_theta=500000.0)
        cfg._attn_implementation = "sdpa"
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        model = model.to_empty(device=self.dev).to(self.dt).eval()
        for w in model.parameters():
            w.data.normal_(0, 0.02)
        for ctx in a.context:
            gib_per_seq = 2 * self.L * self.KVH * ctx * self.D * 2 / 2**30
            batch = a.batch or max(1, int((self.free_gib() - 2 * a.reserve_gib) // (1.1 * gib_per_seq)))
            cache = DynamicCache()
            for l in range(self.L):
                cache.update(self.rand(batch, self.KVH, ctx, self.D), self.rand(batch, self.KVH, ctx, self.D), l)
            tok = torch.zeros(batch, 1, dtype=torch.long, device=self.dev)
            for i in range(a.steps + 1):  # the first step is untimed
                if i == 1:
                    torch.cuda.synchronize()
                    t0 = time.time()
                pos = torch.full((batch, 1), ctx + i, device=self.dev)
                tok = model(input_ids=tok, past_key_values=cache, position_ids=pos).logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            dt = (time.time() - t0) / a.steps
            self.emit(peer="hf-transformers-sdpa", mode="decode", context=ctx, batch=batch,
                      tokens_per_s=round(batch / dt, 1), ms_per_step=round(dt * 1e3, 2))
            del cache
            torch.cuda.empty_cache()


def main(argv=None):
    a = parse_args(argv)
    peer = Peer(a)
    with peer.torch.no_grad():
        {"decode": peer.decode, "prefill": peer.prefill, "hf": peer.hf}[a.mode]()
    return 0


if __name__ == "__main__":
    sys.exit(main())

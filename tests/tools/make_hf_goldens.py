#!/usr/bin/env python3
"""Builds tiny random-weight Hugging Face checkpoints and reference outputs.

Runs on the GPU machine (torch + transformers + safetensors). For each model
in MODELS it:
  1. builds the model with transformers' own config/model classes, fills the
     weights from a seeded CPU generator (wider than the default init so the
     logits are far from flat), and save_pretrained()s it in the model's
     storage dtype (the Llama one sharded into 2 files plus an index);
  2. reloads the saved directory (so the goldens describe exactly the files on
     disk) once in float32 and once in bfloat16, on CUDA, with eager attention
     and TF32 off;
  3. records, for a seeded 37-token prompt, the logits at every position and
     64 greedily generated tokens (no EOS stopping) for each compute dtype.

Output, per model, in --out/<name>/:
  config.json, generation_config.json      from save_pretrained
  model.safetensors                        (tiny_qwen2, tiny_mistral)
  model-0000{1,2}-of-00002.safetensors +
  model.safetensors.index.json             (tiny_llama)
  goldens.safetensors   F32 "logits_fp32" [37, V]: float32 forward, all positions
                        F32 "logits_bf16" [37, V]: bfloat16 forward (exact bf16 values, widened)
                        I32 "prompt_ids"  [37]
  golden.json           {"model", "prompt_ids", "greedy_fp32", "greedy_bf16" (64 new ids each),
                         "greedy_fp32_margins", "greedy_bf16_margins" (top1 - top2 logit per step),
                         "first_token_matches_forward_{fp32,bf16}", "storage_dtype",
                         "transformers_version", "torch_version", "device"}

Usage:
  python3 tests/tools/make_hf_goldens.py --out /tmp/goldens [--models tiny_llama,...]
  python3 tests/tools/make_hf_goldens.py --dry-run     # specs and sizes; needs no torch
"""

import argparse
import copy
import inspect
import json
import os
import sys

PROMPT_LEN = 37
NEW_TOKENS = 64
SIZE_LIMIT_BYTES = 3 * 1024 * 1024

# Model specs. "rope" is written as transformers 5.x rope_parameters; it is
# translated to rope_theta/rope_scaling for older versions.
MODELS = {
    # GQA 4 (8 heads, 2 KV heads). head_dim 32 with hidden 128, so the query
    # width (256) differs from hidden_size: o_proj is [128, 256]. llama3 RoPE
    # scaling with original_max_position_embeddings 64 so that, with
    # head_dim 32 and theta 500000, pairs 0-1 are high-frequency (unscaled),
    # pair 2 is in the smoothed band and pairs 3-15 are divided by 8.
    "tiny_llama": {
        "family": "llama",
        "seed": 1234,
        "storage_dtype": "float32",
        "shards": 2,
        "config": {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "vocab_size": 1024,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        "rope": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    # GQA 3 (6 heads, 2 KV heads), q/k/v biases (always on in Qwen2), tied
    # embeddings (no lm_head.weight in the file).
    "tiny_qwen2": {
        "family": "qwen2",
        "seed": 2345,
        "storage_dtype": "float32",
        "shards": 1,
        "config": {
            "hidden_size": 192,
            "intermediate_size": 224,
            "num_hidden_layers": 2,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "vocab_size": 1024,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "sliding_window": None,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    # GQA 4 (4 heads, 1 KV head), no sliding window, stored as bfloat16.
    "tiny_mistral": {
        "family": "mistral",
        "seed": 3456,
        "storage_dtype": "bfloat16",
        "shards": 1,
        "config": {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "vocab_size": 1024,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "sliding_window": None,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
    },
}

# Weight init: normal(0, std) by parameter kind; norms are 1 + 0.1 * randn.
INIT_STD_EMBED = 0.1  # embed_tokens and lm_head: logits std ~ 0.1 * sqrt(hidden) > 1
INIT_STD_LINEAR = 0.05
INIT_STD_BIAS = 0.05
INIT_NORM_JITTER = 0.1


def head_dim(cfg):
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def tensor_shapes(spec):
    """The HF tensor names and shapes save_pretrained writes for a spec."""
    c = spec["config"]
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = head_dim(c)
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    bias = spec["family"] == "qwen2"
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    for i in range(c["num_hidden_layers"]):
        p = "model.layers.%d." % i
        shapes[p + "input_layernorm.weight"] = [h]
        shapes[p + "post_attention_layernorm.weight"] = [h]
        shapes[p + "self_attn.q_proj.weight"] = [q, h]
        shapes[p + "self_attn.k_proj.weight"] = [kv, h]
        shapes[p + "self_attn.v_proj.weight"] = [kv, h]
        shapes[p + "self_attn.o_proj.weight"] = [h, q]
        if bias:
            shapes[p + "self_attn.q_proj.bias"] = [q]
            shapes[p + "self_attn.k_proj.bias"] = [kv]
            shapes[p + "self_attn.v_proj.bias"] = [kv]
        shapes[p + "mlp.gate_proj.weight"] = [inter, h]
        shapes[p + "mlp.up_proj.weight"] = [inter, h]
        shapes[p + "mlp.down_proj.weight"] = [h, inter]
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = [v, h]
    return shapes


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def estimated_dir_bytes(spec):
    elem = 4 if spec["storage_dtype"] == "float32" else 2
    weights = sum(numel(s) for s in tensor_shapes(spec).values()) * elem
    goldens = 2 * PROMPT_LEN * spec["config"]["vocab_size"] * 4 + PROMPT_LEN * 4
    return weights + goldens + 16 * 1024  # json files and headers


def check_specs():
    """Static checks on MODELS; returns a list of problems."""
    problems = []
    for name, spec in MODELS.items():
        c = spec["config"]
        if c["num_attention_heads"] % c["num_key_value_heads"]:
            problems.append("%s: kv heads do not divide heads" % name)
        if head_dim(c) % 2:
            problems.append("%s: odd head_dim" % name)
        if spec["storage_dtype"] not in ("float32", "bfloat16"):
            problems.append("%s: bad storage dtype" % name)
        size = estimated_dir_bytes(spec)
        if size >= SIZE_LIMIT_BYTES:
            problems.append("%s: estimated %d bytes >= %d" % (name, size, SIZE_LIMIT_BYTES))
        if spec["shards"] > 1:
            elem = 4 if spec["storage_dtype"] == "float32" else 2
            biggest = max(numel(s) for s in tensor_shapes(spec).values()) * elem
            if shard_size_limit(spec) < biggest:
                problems.append("%s: shard limit below the largest tensor" % name)
    return problems


def shard_size_limit(spec):
    """A max_shard_size (bytes) that splits the weights into spec["shards"] files."""
    elem = 4 if spec["storage_dtype"] == "float32" else 2
    total = sum(numel(s) for s in tensor_shapes(spec).values()) * elem
    return total // spec["shards"] + total // (4 * spec["shards"])


def legacy_rope_kwargs(rope):
    kwargs = {"rope_theta": rope["rope_theta"]}
    if rope["rope_type"] != "default":
        kwargs["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return kwargs


# ---------------------------------------------------------------------------
# Everything below needs torch/transformers/safetensors.


def build_config(spec):
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }[spec["family"]]
    kwargs = dict(spec["config"])
    params = inspect.signature(cls.__init__).parameters
    if "rope_parameters" in params:  # transformers >= 5
        kwargs["rope_parameters"] = dict(spec["rope"])
    else:
        kwargs.update(legacy_rope_kwargs(spec["rope"]))
    if spec["family"] == "qwen2":
        kwargs.pop("head_dim", None)
    return cls(**kwargs)


def torch_dtype(name):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def init_weights(model, seed):
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + INIT_NORM_JITTER * noise
            elif name.endswith(".bias"):
                value = INIT_STD_BIAS * noise
            elif "embed_tokens" in name or "lm_head" in name:
                value = INIT_STD_EMBED * noise
            else:
                value = INIT_STD_LINEAR * noise
            p.copy_(value.to(p.dtype))


def load_pretrained(path, dtype, device):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, attn_implementation="eager")
    return model.to(device).eval()


def save_checkpoint(name, spec, out_dir):
    """Builds, initializes and saves the model; returns its CPU float32 state dict."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec["seed"])
    config = build_config(spec)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    init_weights(model, spec["seed"])
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model = model.to(torch_dtype(spec["storage_dtype"]))
    os.makedirs(out_dir, exist_ok=True)
    kwargs = {}
    if spec["shards"] > 1:
        kwargs["max_shard_size"] = shard_size_limit(spec)
    else:
        kwargs["max_shard_size"] = 1 << 40
    model.save_pretrained(out_dir, **kwargs)

    # The runtime reads torch_dtype (4.x) or dtype (5.x); make sure one is right.
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    key = "dtype" if "dtype" in cfg else "torch_dtype"
    if cfg.get(key) != spec["storage_dtype"]:
        print("%s: fixing config.json %s %r -> %r" % (name, key, cfg.get(key), spec["storage_dtype"]))
        cfg[key] = spec["storage_dtype"]
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)

    files = sorted(os.listdir(out_dir))
    shards = [f for f in files if f.endswith(".safetensors")]
    if spec["shards"] > 1:
        if "model.safetensors.index.json" not in files or len(shards) != spec["shards"]:
            raise RuntimeError("%s: expected %d shards and an index, got %s" % (name, spec["shards"], files))
    elif shards != ["model.safetensors"]:
        raise RuntimeError("%s: expected one model.safetensors, got %s" % (name, files))
    return reference


def check_saved_tensors(name, spec, out_dir):
    """The files hold exactly the expected names and shapes."""
    from safetensors import safe_open

    want = tensor_shapes(spec)
    got = {}
    for f in sorted(os.listdir(out_dir)):
        if f.endswith(".safetensors") and f != "goldens.safetensors":
            with safe_open(os.path.join(out_dir, f), framework="pt") as st:
                for k in st.keys():
                    got[k] = list(st.get_slice(k).get_shape())
    if got != want:
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise RuntimeError("%s: saved tensors differ: missing %s extra %s wrong shape %s" % (name, missing, extra, wrong))


def greedy(model, prompt, vocab):
    import torch

    gc = copy.deepcopy(model.generation_config)
    gc.do_sample = False
    gc.num_beams = 1
    gc.max_new_tokens = NEW_TOKENS
    gc.min_new_tokens = None
    gc.eos_token_id = None
    gc.pad_token_id = 0
    gc.temperature = None
    gc.top_p = None
    gc.top_k = None
    ids = prompt[None].to(model.device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        generation_config=gc,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[0, ids.shape[1]:].tolist()
    if len(new) != NEW_TOKENS:
        raise RuntimeError("generate returned %d tokens, expected %d" % (len(new), NEW_TOKENS))
    margins = []
    for step, logits in enumerate(out.logits):
        row = logits[0].float()
        top = torch.topk(row, 2)
        if int(top.indices[0]) != new[step] and float(top.values[0]) != float(row[new[step]]):
            raise RuntimeError("step %d: generated %d but argmax is %d" % (step, new[step], int(top.indices[0])))
        margins.append(float(top.values[0] - top.values[1]))
    return new, margins


def make_goldens(name, spec, out_dir, device):
    import torch
    import transformers
    from safetensors.torch import save_file

    reference = save_checkpoint(name, spec, out_dir)
    check_saved_tensors(name, spec, out_dir)
    vocab = spec["config"]["vocab_size"]
    gen = torch.Generator(device="cpu").manual_seed(spec["seed"] + 1)
    prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen, dtype=torch.int64)

    result = {
        "model": name,
        "storage_dtype": spec["storage_dtype"],
        "prompt_ids": prompt.tolist(),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
    }
    tensors = {"prompt_ids": prompt.to(torch.int32).contiguous()}
    for tag, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = load_pretrained(out_dir, dtype, device)
        # The reload must reproduce the initialized weights (rounded to the storage dtype).
        storage = torch_dtype(spec["storage_dtype"])
        for k, v in model.state_dict().items():
            if k not in reference:
                raise RuntimeError("%s: reloaded model has unexpected tensor %s" % (name, k))
            expect = reference[k].to(storage).to(dtype)
            if not torch.equal(v.cpu(), expect):
                raise RuntimeError("%s/%s: reloaded %s differs from what was saved" % (name, tag, k))
        with torch.no_grad():
            logits = model(input_ids=prompt[None].to(device), use_cache=False).logits[0]
        logits = logits.float().cpu().contiguous()
        if logits.shape != (PROMPT_LEN, vocab) or not torch.isfinite(logits).all():
            raise RuntimeError("%s/%s: bad logits %s" % (name, tag, tuple(logits.shape)))
        tensors["logits_" + tag] = logits
        with torch.no_grad():
            tokens, margins = greedy(model, prompt, vocab)
        result["greedy_" + tag] = tokens
        result["greedy_%s_margins" % tag] = margins
        result["first_token_matches_forward_" + tag] = tokens[0] == int(logits[-1].argmax())
        print("%s/%s: logits std %.3f, last-position margin %.4f, min greedy margin %.4f, distinct tokens %d"
              % (name, tag, float(logits.std()), margins[0], min(margins), len(set(tokens))))
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    agree = sum(a == b for a, b in zip(result["greedy_fp32"], result["greedy_bf16"]))
    print("%s: fp32 and bf16 greedy agree on %d/%d tokens" % (name, agree, NEW_TOKENS))

    save_file(tensors, os.path.join(out_dir, "goldens.safetensors"),
              metadata={"model": name, "transformers_version": transformers.__version__})
    with open(os.path.join(out_dir, "golden.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    print("%s: %d bytes in %s" % (name, total, out_dir))
    if total >= SIZE_LIMIT_BYTES:
        print("%s: WARNING: over the %d-byte budget" % (name, SIZE_LIMIT_BYTES))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="output directory; one subdirectory per model")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of %s" % list(MODELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="print specs and estimated sizes, then exit")
    args = parser.parse_args(argv)

    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error("unknown models %s" % unknown)
    problems = check_specs()
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    if args.dry_run:
        for n in names:
            spec = MODELS[n]
            print("%-13s %-8s %-8s shards=%d tensors=%d est_bytes=%d rope=%s" % (
                n, spec["family"], spec["storage_dtype"], spec["shards"], len(tensor_shapes(spec)),
                estimated_dir_bytes(spec), spec["rope"]["rope_type"]))
        return 0
    if not args.out:
        parser.error("--out is required")

    # Deterministic, full-precision reference math.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 1
    for n in names:
        make_goldens(n, MODELS[n], os.path.join(args.out, n), args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Runs a JSONL task set through Hugging Face transformers (full attention).

The independent reference for `penumbra eval`: greedy decoding, BOS + prompt,
stop at the first generated token whose text contains a newline, at EOS, or
after max_new_tokens; multi-turn records continue on the same KV cache (see
docs/evalmodel.md, "Running a record"). Prints one JSON line per (task,
length), one per length over all tasks, and writes per-record predictions
(for agreement checks with compare_predictions.py).

  python3 ops/evalmodel/eval_hf.py --model build-evalmodel/run/model \
      --tasks build-evalmodel/tasks.jsonl --predictions build-evalmodel/pred_hf.jsonl
"""

import argparse
import collections
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from scoring import prediction_of, score  # noqa: E402


def load_model(path, dtype, attn, device):
    import torch
    from transformers import AutoModelForCausalLM

    td = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=td, attn_implementation=attn)
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=td, attn_implementation=attn)
    return model.to(device).eval()


class Runner:
    def __init__(self, model, tok, device):
        import torch

        self.torch, self.model, self.tok, self.device = torch, model, tok, device
        self.eos = model.config.eos_token_id
        self.nl_ids = tok.encode("\n", add_special_tokens=False).ids
        self._keep_kw = "logits_to_keep"

    def _forward(self, ids, past):
        t = self.torch.tensor([ids], dtype=self.torch.long, device=self.device)
        kw = {self._keep_kw: 1} if self._keep_kw else {}
        try:
            return self.model(input_ids=t, past_key_values=past, use_cache=True, **kw)
        except TypeError:
            if self._keep_kw == "logits_to_keep":
                self._keep_kw = "num_logits_to_keep"
            else:
                self._keep_kw = None
            return self._forward(ids, past)

    def has_newline(self, token_id):
        return "\n" in self.tok.decode([token_id], skip_special_tokens=False)

    def run(self, rec, max_new_tokens):
        """Returns a list of (generated_text, n_input_tokens) per turn."""
        turns = rec.get("turns") or [{"question": None, "answer": rec["answer"]}]
        feed = self.tok.encode(rec["prompt"]).ids  # BOS + prompt (post-processor)
        past, total, results = None, 0, []
        with self.torch.inference_mode():
            for ti, turn in enumerate(turns):
                if ti > 0:
                    feed = feed + self.tok.encode(turn["question"], add_special_tokens=False).ids
                total += len(feed)
                out = self._forward(feed, past)
                past = out.past_key_values
                gen = []
                for i in range(max_new_tokens):
                    nxt = int(out.logits[0, -1].argmax())
                    gen.append(nxt)
                    # The turn's last token (a stop, or the max_new_tokens-th)
                    # is not forwarded: the next turn feeds it first.
                    if nxt == self.eos or self.has_newline(nxt) or i + 1 == max_new_tokens:
                        break
                    out = self._forward([nxt], past)
                    past = out.past_key_values
                    total += 1
                results.append((self.tok.decode(gen, skip_special_tokens=False), total))
                # The last generated token is not in the cache: feed it first
                # next turn, plus a newline if it holds none.
                last = gen[-1]
                feed = [last] + ([] if self.has_newline(last) else list(self.nl_ids))
        return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks", required=True)
    ap.add_argument("--predictions", default=None, help="write per-turn predictions JSONL")
    ap.add_argument("--limit", type=int, default=0, help="records per (task, length); 0 = all")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--attn", default="sdpa", choices=("sdpa", "eager", "flash_attention_2"))
    ap.add_argument("--max-new-tokens", type=int, default=0, help="override the records' value")
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    model = load_model(args.model, args.dtype, args.attn, args.device)

    # The AutoTokenizer of the model must agree with the raw tokenizer.json.
    try:
        from transformers import AutoTokenizer

        at = AutoTokenizer.from_pretrained(args.model)
        probe = "<doc>\nHello, world. 1234567\n</doc>\nQ: What?\nA:"
        if at(probe)["input_ids"] != tok.encode(probe).ids:
            print("WARNING: AutoTokenizer ids differ from tokenizer.json ids", file=sys.stderr)
    except Exception as e:  # noqa: BLE001
        print(f"WARNING: AutoTokenizer check failed: {e}", file=sys.stderr)

    runner = Runner(model, tok, args.device)
    records = [json.loads(l) for l in open(args.tasks, encoding="utf-8") if l.strip()]
    if args.limit:
        seen = collections.Counter()
        kept = []
        for r in records:
            k = (r["task"], r["length"])
            if seen[k] < args.limit:
                kept.append(r)
                seen[k] += 1
        records = kept

    pred_f = open(args.predictions, "w", encoding="utf-8") if args.predictions else None
    agg = collections.defaultdict(lambda: [0, 0, 0.0])  # n, correct, partial
    t0 = time.time()
    for rec in records:
        mnt = args.max_new_tokens or rec.get("max_new_tokens", 64)
        outs = runner.run(rec, mnt)
        turns = rec.get("turns") or [{"answer": rec["answer"]}]
        for ti, ((text, n_in), turn) in enumerate(zip(outs, turns)):
            pred = prediction_of(text)
            ok, part = score(pred, turn["answer"])
            for key in ((rec["task"], rec["length"]), ("all", rec["length"])):
                a = agg[key]
                a[0] += 1
                a[1] += int(ok)
                a[2] += part
            if pred_f:
                pred_f.write(json.dumps({
                    "id": rec["id"], "task": rec["task"], "length": rec["length"],
                    "turn": ti, "prediction": pred, "answer": turn["answer"],
                    "correct": ok, "partial": round(part, 4), "tokens": n_in}) + "\n")
                pred_f.flush()  # a run stopped by a time limit keeps what it did
    if pred_f:
        pred_f.close()
    for (task, length), (n, c, p) in sorted(agg.items(), key=lambda kv: (kv[0][1], kv[0][0] == "all", kv[0][0])):
        print(json.dumps({"engine": "hf-transformers", "kv_policy": "full", "task": task,
                          "length": length, "n": n, "accuracy": round(c / n, 4),
                          "partial": round(p / n, 4)}))
    print(f"evaluated {len(records)} records in {time.time() - t0:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()

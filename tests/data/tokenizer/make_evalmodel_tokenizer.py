#!/usr/bin/env python3
"""Writes evalmodel_tokenizer.json and evalmodel_golden.jsonl (test fixtures).

evalmodel_tokenizer.json has exactly the shape of the tokenizer.json that
ops/evalmodel/train.py (train_tokenizer) saves with a recent `tokenizers`:
byte-level BPE (merges as 2-element arrays), ByteLevel pre-tokenizer
(add_prefix_space=false, use_regex=true), ByteLevel decoder,
TemplateProcessing single "<|bos|> $A", specials <|bos|>=0 <|eos|>=1
<|pad|>=2. Its vocabulary is small (VOCAB = 1024 ids, the vocab_size of
tests/data/models/tiny_llama) and learned here by a plain BPE count over
tests/data/evaltasks/haystack_kjv.txt plus a few task-style lines.

evalmodel_golden.jsonl holds, per input text, the ids this script's own BPE
encoder gives ("ids": no specials, "ids_special": with the BOS template), an
independent cross-check of coordinator/tokenizer on this file. Inputs are
ASCII so that the pre-tokenizer regex needs nothing beyond `regex`.

  python3 tests/data/tokenizer/make_evalmodel_tokenizer.py
"""

import collections
import json
import os

import regex

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
VOCAB = 1024
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]
SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def byte_alphabet():
    """The byte -> printable character table of byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTES = byte_alphabet()


def words_of(text):
    return ["".join(BYTES[b] for b in w.encode("utf-8")) for w in SPLIT.findall(text)]


def train(texts):
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(BYTES.values()):
        vocab[ch] = len(vocab)
    counts = collections.Counter()
    for t in texts:
        counts.update(words_of(t))
    words = {w: list(w) for w in counts}
    merges = []
    while len(vocab) < VOCAB:
        pairs = collections.Counter()
        for w, n in counts.items():
            p = words[w]
            for a, b in zip(p, p[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        best = min(pairs, key=lambda k: (-pairs[k], k))
        merges.append(best)
        vocab[best[0] + best[1]] = len(vocab)
        for w, p in words.items():
            i, out = 0, []
            while i < len(p):
                if i + 1 < len(p) and (p[i], p[i + 1]) == best:
                    out.append(p[i] + p[i + 1])
                    i += 2
                else:
                    out.append(p[i])
                    i += 1
            words[w] = out
    return vocab, merges


def encode(vocab, merges, text):
    rank = {m: i for i, m in enumerate(merges)}
    ids = []
    for w in words_of(text):
        p = list(w)
        while len(p) > 1:
            cands = [(rank[(a, b)], i) for i, (a, b) in enumerate(zip(p, p[1:])) if (a, b) in rank]
            if not cands:
                break
            _, i = min(cands)
            p[i:i + 2] = [p[i] + p[i + 1]]
        ids += [vocab[x] for x in p]
    return ids


def tokenizer_json(vocab, merges):
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, s in enumerate(SPECIALS)]
    bos = {"SpecialToken": {"id": "<|bos|>", "type_id": 0}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos, {"Sequence": {"id": "B", "type_id": 0}}],
            "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [0], "tokens": ["<|bos|>"]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab, "merges": [list(m) for m in merges],
        },
    }


GOLDEN_TEXTS = [
    "",
    "\n",
    "A: 4821907\n",
    "<doc>\nIn the beginning God created the heaven and the earth.\n</doc>\nQ: What is the special magic number "
    "for quiet-harbor?\nA:",
    "Q: What are all the special magic numbers for curly-bonnet?\nA:",
    " 6384106, 1234567, 7654321\n",
    "VAR ABCDE = 12345. VAR FGHIJ = VAR ABCDE.",
    "Key 3f2a9c1e-77b0-4c1d-9e8f-0123456789ab has value 00ff00ff-aaaa-bbbb-cccc-ddddeeeeffff.",
    "  two  spaces, tabs\tand\r\nnewlines\n\n\nend   ",
    "It's they'll we've I'm you'd ain't",
    "<|bos|>text after a special<|eos|> and more",
]


def main():
    hay = open(os.path.join(ROOT, "tests/data/evaltasks/haystack_kjv.txt"), encoding="utf-8").read()
    extra = ["<doc>\n", "\n</doc>\n", "Q: What is the special magic number for quiet-harbor?\nA: 4821907\n",
             "The special magic number for quiet-harbor is: 4821907.", "0123456789 " * 4]
    vocab, merges = train([hay] + extra * 50)
    with open(os.path.join(HERE, "evalmodel_tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_json(vocab, merges), f, ensure_ascii=False, indent=2)
        f.write("\n")
    with open(os.path.join(HERE, "evalmodel_golden.jsonl"), "w", encoding="utf-8") as f:
        for t in GOLDEN_TEXTS:
            if "<|" in t:
                # Added tokens are cut out first, then each piece is encoded.
                parts = regex.split(r"(<\|bos\|>|<\|eos\|>|<\|pad\|>)", t)
                ids = []
                for p in parts:
                    ids += [SPECIALS.index(p)] if p in SPECIALS else encode(vocab, merges, p)
            else:
                ids = encode(vocab, merges, t)
            f.write(json.dumps({"text": t, "ids": ids, "ids_special": [0] + ids}) + "\n")
    print(f"vocab {len(vocab)}, merges {len(merges)}")


if __name__ == "__main__":
    main()

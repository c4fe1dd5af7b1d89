#!/usr/bin/env python3
"""RULER-style long-context tasks for the Penumbra evaluation model (issue 4).

One seeded generator for both the evaluation sets (JSONL) and the synthetic
part of the training data (train.py imports make_train_sample). Pure standard
library; the `tokenizers` package is used only when a tokenizer.json is given.

Text format (the model is trained on exactly this):

    <doc>
    ...haystack with needles...
    </doc>
    Q: What is the special magic number for quiet-harbor?
    A: 4821907

The prompt ends with "A:"; the expected continuation is " " + answer + "\\n".
List answers are rendered as items joined by ", ". A multi-turn sample simply
continues with the next "Q: ...\\nA:" after the previous answer line.

Tasks (see docs/evalmodel.md for the scoring rules):
  niah_single      one needle "The special magic number for KEY is: N."
  niah_multikey    the target needle plus 3 distractor needles (other keys)
  niah_multivalue  4 needles with the same key; all 4 numbers are the answer
  niah_multiquery  4 keys asked in one question; answer in question order
  niah_multiturn   4 keys asked one after another (4 turns, one context)
  vt               variable tracking: "VAR ABCDE = 12345." then chains
                   "VAR FGHIJ = VAR ABCDE."; answer: every variable of the
                   chain holding the asked value (one distractor chain)
  kv               key-value retrieval over UUID pairs (no natural text)
  cwe              common-word extraction over a numbered list of words; the
                   answer is the 5 words that occur most often

Long generation (not in the default set; --tasks kv_many):
  kv_many          the kv list, and one question naming 64 of its keys; the
                   answer is their 64 values in question order (about 1.5K
                   tokens of output: what SpeContext's policy is for, the KV
                   of the tokens it generates growing as it writes), and the
                   record's max_new_tokens is sized to it

Length: every record's full sequence (BOS + context + all questions + gold
answers, i.e. what train.py trains on) has at most `length` tokens, and is as
long as the haystack granularity allows. Tokens are counted with a pluggable
counter: HFTokenCounter (tokenizer.json through the `tokenizers` package) or
ApproxTokenCounter (UTF-8 bytes / 4, for local testing without the model).

Usage:
  python3 ops/evalmodel/tasks.py --corpus build-evalmodel/data/corpus-heldout.txt.xz \\
      --tokenizer MODEL_DIR/tokenizer.json --lengths 4096,8192,16384,32768 \\
      --num 25 --seed 1234 --out tasks.jsonl

A record depends only on (seed, task, length, index), so `--num 100 --first
25` gives records 25..99 of the 100-record set: more records for a set
already run with --num 25, in pieces that can run apart (their ids are
distinct, so their prediction files concatenate into the whole set's).
"""

import argparse
import bisect
import hashlib
import json
import lzma
import os
import random
import re
import sys

TASKS = (
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "niah_multiturn",
    "vt",
    "kv",
    "cwe",
)

# Generated-output tasks, asked for by name: every question answered in one
# long generation.
LONG_TASKS = ("kv_many",)
KV_MANY_KEYS = 64

DEFAULT_MAX_NEW_TOKENS = 64
DOC_OPEN = "<doc>\n"
DOC_CLOSE = "\n</doc>\n"

# --------------------------------------------------------------------------
# Token counting.


class ApproxTokenCounter:
    """Approximate count: ceil(UTF-8 bytes / 4). For tests without a model."""

    name = "approx-bytes4"

    def count(self, text):
        return (len(text.encode("utf-8")) + 3) // 4


class HFTokenCounter:
    """Counts tokens with a Hugging Face tokenizer.json (no special tokens)."""

    def __init__(self, path):
        from tokenizers import Tokenizer  # imported lazily: optional dependency

        self.tokenizer = Tokenizer.from_file(path)
        with open(path, "rb") as f:
            self.name = "tokenizer-sha256:" + hashlib.sha256(f.read()).hexdigest()[:16]

    def count(self, text):
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)


def make_counter(tokenizer_path=None):
    if tokenizer_path:
        return HFTokenCounter(tokenizer_path)
    return ApproxTokenCounter()


# Every sequence starts with one BOS token (not part of the text).
BOS_TOKENS = 1

# --------------------------------------------------------------------------
# Haystack text.


def load_text(path):
    if path.endswith(".xz"):
        with lzma.open(path, "rb") as f:
            data = f.read()
    else:
        with open(path, "rb") as f:
            data = f.read()
    return data.decode("utf-8")


class Haystack:
    """Natural text to cut haystacks from (documents joined by paragraphs)."""

    def __init__(self, text):
        text = text.replace("\n\x1e\n", "\n\n").replace("\x1e", "")
        text = text.replace("<doc>", "<d0c>").replace("</doc>", "</d0c>")
        if len(text) < 1000:
            raise ValueError("haystack text too short (need >= 1000 chars)")
        self.text = text

    @classmethod
    def from_file(cls, path):
        return cls(load_text(path))

    def sample(self, rng, n_chars):
        """A contiguous span starting at a paragraph, wrapping around."""
        t = self.text
        start = rng.randrange(len(t))
        p = t.find("\n\n", start)
        start = 0 if p < 0 else p + 2
        out = t[start:start + n_chars]
        while len(out) < n_chars:
            out += "\n\n" + t[:n_chars - len(out)]
        return out


_UNIT_RE = re.compile(r".*?(?:[.!?;:](?=\s)|\n|$)\s*", re.S)


def split_units(text):
    """Sentences/lines, each keeping its trailing whitespace."""
    units = [m.group(0) for m in _UNIT_RE.finditer(text) if m.group(0)]
    return units


# --------------------------------------------------------------------------
# Random material.

_ADJ = """able acid aged airy ample angry apt arid ashen avid azure balmy bare
bold brave brief brisk broad bumpy calm cheap chief chilly civic clean clear
close cold cool cosy crisp cubic curly damp dark dear deep dense dim dizzy
dry dull dusty eager early easy elder empty equal even exact faint fair fancy
fast fierce final firm flat fond frail free fresh frosty full fuzzy giant
glad gold grand great green grey grim gross half happy hardy harsh hasty
hazy heavy hollow honest huge humble icy idle inner ivory jolly juicy keen
kind large late lazy lean level light little lively lone long loud lucky lunar
mad major merry mild misty modern moist mossy muddy narrow neat new nice
noble noisy odd old olive open oval pale plain plush polar proud pure quick
quiet rapid rare raw ready regal rich rigid ripe rocky rosy rough round royal
rural rusty sad safe salty sandy scarce sharp shiny short shy silent silky
simple sleek slim slow small smart smooth snowy soft solar solid sour spare
spicy stark steady steep stiff still stormy stout sunny super sweet swift
tall tame tart tender thick thin tidy tiny tough tropic true twin upper urban
vague vast velvet vivid warm weary wide wild windy wise witty young zesty""".split()

_NOUN = """acorn anchor apple arrow atlas badge bakery banjo barn basket beacon
bean bell berry bison blossom boat bonnet bottle boulder bramble bridge brook
bucket cabin cactus camel candle canoe canyon carpet castle cedar cellar chalk
cherry chimney cider cliff clover comet copper coral cotton crater creek crow
crystal daisy delta desert diamond dolphin donkey dragon drum eagle easel ember
engine falcon feather fern ferry fiddle field fig flute forest fossil fountain
fox garden garnet geyser glacier goose granite grove guitar hammer harbor hazel
helmet heron hill hive horizon island jacket jasmine jungle kettle kite ladder
lagoon lantern lemon lily lion lobster locket magnet mango maple marble meadow
melon mesa mill mirror mitten moose mountain needle nest oak oasis ocean olive
orchard otter owl paddle palace panda parrot pebble pepper piano pillow pine
planet plum pond poppy prairie puzzle quarry quill rabbit raven reef ribbon
river robin rocket saddle salmon sapphire scarf shell shovel silo sparrow
spider spoon spruce squid statue stone storm summit swan tablet teapot temple
thistle thunder tiger timber torch tower trail tulip tunnel turtle valley
violin volcano wagon walnut walrus whale willow window wizard wolf zebra""".split()

_CONS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _key(rng, used):
    while True:
        k = f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}"
        if k not in used:
            used.add(k)
            return k


def _number(rng, used):
    while True:
        v = str(rng.randint(1000000, 9999999))
        if v not in used:
            used.add(v)
            return v


def _var_name(rng, used):
    while True:
        v = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if v not in used:
            used.add(v)
            return v


def _uuid(rng):
    h = f"{rng.getrandbits(128):032x}"
    return f"{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _pseudo_word(rng, used):
    while True:
        n = rng.choice((2, 2, 3))
        w = "".join(rng.choice(_CONS) + rng.choice(_VOWELS) for _ in range(n))
        if w not in used:
            used.add(w)
            return w


# --------------------------------------------------------------------------
# Rendering and fitting.


def answer_text(answer):
    return ", ".join(answer) if isinstance(answer, list) else answer


def render_turns(turns):
    """Returns (tail_text, [(start, end) of each ' answer\\n' within tail])."""
    parts, spans, pos = [], [], 0
    for question, answer in turns:
        q = f"Q: {question}\nA:"
        a = f" {answer_text(answer)}\n"
        parts.append(q)
        pos += len(q)
        spans.append((pos, pos + len(a)))
        parts.append(a)
        pos += len(a)
    return "".join(parts), spans


def _fit(count_fn, proxy, length):
    """Largest n in [0, len(proxy)-1] with count_fn(n) <= length.

    count_fn must be nondecreasing in n; proxy[n] is a nondecreasing size
    estimate (e.g. cumulative characters) used to interpolate guesses, so only
    a handful of exact counts are needed.
    """
    n_max = len(proxy) - 1
    cache = {}

    def c(n):
        if n not in cache:
            cache[n] = count_fn(n)
        return cache[n]

    lo = 0
    if c(0) > length:
        raise ValueError(f"length {length} too small for the fixed part ({c(0)} tokens)")
    if c(n_max) <= length:
        return n_max
    hi = n_max  # smallest n known to exceed length
    it = 0
    while hi - lo > 1:
        it += 1
        if it <= 8:
            # Regula falsi in proxy space (counts are nearly linear in it).
            clo, chi = c(lo), c(hi)
            frac = (length - clo) / max(1, chi - clo)
            target = proxy[lo] + frac * (proxy[hi] - proxy[lo])
            n = bisect.bisect_right(proxy, target) - 1
        else:
            n = (lo + hi) // 2
        n = min(max(n, lo + 1), hi - 1)
        if c(n) <= length:
            lo = n
        else:
            hi = n
    return lo


class _Sample:
    """Result of one generator call."""

    def __init__(self, context, turns, n_tokens):
        self.context = context          # "<doc>\n...\n</doc>\n"
        self.turns = turns              # [(question, answer)]
        self.n_tokens = n_tokens        # BOS + full text

    def full_text(self):
        tail, spans = render_turns(self.turns)
        off = len(self.context)
        return self.context + tail, [(s + off, e + off) for s, e in spans]


def _needle_sample(rng, hay, counter, length, needles, turns):
    """Natural-text haystack with needles at random depths.

    needles: list of (depth in [0,1], text); inserted in depth order (stable).
    """
    needles = sorted(needles, key=lambda x: x[0])
    tail, _ = render_turns(turns)
    # Enough text: bytes/token is ~4 for English BPE; take 6 chars per token.
    text = hay.sample(rng, length * 6 + 4000)
    units = split_units(text)
    proxy = [0]
    for u in units:
        proxy.append(proxy[-1] + len(u))

    def render(n):
        pieces = []
        ni = 0
        for i in range(n + 1):
            while ni < len(needles) and min(n, int(needles[ni][0] * n)) == i:
                pieces.append(needles[ni][1] + (" " if i < n else ""))
                ni += 1
            if i < n:
                pieces.append(units[i])
        body = "".join(pieces).strip()
        return DOC_OPEN + body + DOC_CLOSE

    def count(n):
        return BOS_TOKENS + counter.count(render(n) + tail)

    n = _fit(count, proxy, length)
    ctx = render(n)
    return _Sample(ctx, turns, count(n))


def _list_sample(rng, counter, length, make_items, n_cap, joiner):
    """Haystack made of generated items; make_items(n) -> (items, turns)."""
    proxy = list(range(n_cap + 1))
    cache = {}

    def build(n):
        if n not in cache:
            items, turns = make_items(n)
            ctx = DOC_OPEN + joiner.join(items).strip() + DOC_CLOSE
            tail, _ = render_turns(turns)
            cache[n] = (ctx, turns, BOS_TOKENS + counter.count(ctx + tail))
        return cache[n]

    n = _fit(lambda k: build(k)[2], proxy, length)
    ctx, turns, ntok = build(n)
    return _Sample(ctx, turns, ntok)


def _magic(key, value):
    return f"The special magic number for {key} is: {value}."


def q_single(key):
    return f"What is the special magic number for {key}?"


def q_multivalue(key):
    return f"What are all the special magic numbers for {key}?"


def q_multiquery(keys):
    return "What are the special magic numbers for " + ", ".join(keys[:-1]) + f" and {keys[-1]}?"


def _niah(rng, hay, counter, length, n_keys, values_per_key, questions):
    """Generic needle task.

    values_per_key: list (len n_keys) of value counts.
    questions: list of ("single"|"multivalue", key_index) or ("multiquery", [key_index...]).
    Returns a _Sample whose answers follow the document order of the needles.
    """
    used_k, used_v = set(), set()
    keys = [_key(rng, used_k) for _ in range(n_keys)]
    needles = []  # (depth, key_index, value)
    for ki in range(n_keys):
        for _ in range(values_per_key[ki]):
            needles.append((rng.random(), ki, _number(rng, used_v)))
    needles.sort(key=lambda x: x[0])
    by_key = {ki: [v for _, k, v in needles if k == ki] for ki in range(n_keys)}
    turns = []
    for kind, arg in questions:
        if kind == "single":
            turns.append((q_single(keys[arg]), by_key[arg][0]))
        elif kind == "multivalue":
            turns.append((q_multivalue(keys[arg]), list(by_key[arg])))
        elif kind == "multiquery":
            turns.append((q_multiquery([keys[i] for i in arg]), [by_key[i][0] for i in arg]))
        else:
            raise ValueError(kind)
    return _needle_sample(rng, hay, counter, length,
                          [(d, _magic(keys[k], v)) for d, k, v in needles], turns)


def _vt(rng, hay, counter, length, n_chains, n_hops, asked):
    """Variable tracking: n_chains chains of n_hops hops; `asked` chain indices."""
    used_n, used_v = set(), set()
    needles, turns = [], []
    for c in range(n_chains):
        names = [_var_name(rng, used_n) for _ in range(n_hops + 1)]
        value = str(rng.randint(10000, 99999))
        while value in used_v:
            value = str(rng.randint(10000, 99999))
        used_v.add(value)
        depths = sorted(rng.random() for _ in range(n_hops + 1))
        needles.append((depths[0], f"VAR {names[0]} = {value}."))
        for h in range(1, n_hops + 1):
            needles.append((depths[h], f"VAR {names[h]} = VAR {names[h - 1]}."))
        if c in asked:
            turns.append((c, f"Which variables are assigned the value {value}?", names))
    turns = [(q, a) for _, q, a in sorted(turns, key=lambda t: asked.index(t[0]))]
    return _needle_sample(rng, hay, counter, length, needles, turns)


def _kv(rng, counter, length, n_queries, together=False):
    """UUID key-value pairs; the queried pairs sit at random depths. With
    `together`, one question names all the queried keys and the answer lists
    their values in that order."""
    pair_rng_seed = rng.getrandbits(64)
    q_depths = [rng.random() for _ in range(n_queries)]
    # Upper bound on pairs: each line is ~30+ tokens; 1 token per 4 bytes min.
    n_cap = max(n_queries + 1, length // 16)

    def make(n):
        r = random.Random(pair_rng_seed)
        n = max(n, n_queries)
        pairs = [(_uuid(r), _uuid(r)) for _ in range(n)]
        idx, seen = [], set()
        for d in q_depths:
            i = min(n - 1, int(d * n))
            while i in seen:
                i = (i + 1) % n
            seen.add(i)
            idx.append(i)
        items = [f"Key {k} has value {v}.\n" for k, v in pairs]
        if together:
            keys = [pairs[i][0] for i in idx]
            q = "What are the values of keys " + ", ".join(keys[:-1]) + f" and {keys[-1]}?"
            return items, [(q, [pairs[i][1] for i in idx])]
        turns = [(f"What is the value of key {pairs[i][0]}?", pairs[i][1]) for i in idx]
        return items, turns

    return _list_sample(rng, counter, length, make, n_cap - n_queries, "")


def _cwe(rng, counter, length, top_k, rare_freq):
    """Numbered word list; top_k words occur far more often than the rest.

    The list is one shuffled sequence cut to the fitted length (so the token
    count grows monotonically with the cut): the top_k common words make up
    about a quarter of it, every other word occurs at most rare_freq times.
    """
    n_cap = max(top_k * 8, length // 2)
    used = set()
    common = [_pseudo_word(rng, used) for _ in range(top_k)]
    freq = max(4, round(0.25 * n_cap / top_k))
    words = [w for w in common for _ in range(freq)]
    while len(words) < n_cap:
        w = _pseudo_word(rng, used)
        words.extend([w] * rare_freq)
    rng.shuffle(words)
    q = f"What are the {top_k} most common words in the list?"

    def make(n):
        n = max(n, top_k * 4)
        prefix = words[:n]
        counts = {}
        for w in prefix:
            counts[w] = counts.get(w, 0) + 1
        # The answer: the top_k words by count, ties by first appearance
        # (normally exactly the common words, in order of first appearance).
        first = {}
        for i, w in enumerate(prefix):
            first.setdefault(w, i)
        top = sorted(counts, key=lambda w: (-counts[w], first[w]))[:top_k]
        top.sort(key=lambda w: first[w])
        items = [f"{i + 1}. {w}" for i, w in enumerate(prefix)]
        return items, [(q, top)]

    return _list_sample(rng, counter, length, make, n_cap - top_k * 4, " ")


# --------------------------------------------------------------------------
# Evaluation presets (one question unless multi-turn).


def generate(task, rng, hay, counter, length):
    """Returns a _Sample for one evaluation record of `task`."""
    if task == "niah_single":
        return _niah(rng, hay, counter, length, 1, [1], [("single", 0)])
    if task == "niah_multikey":
        return _niah(rng, hay, counter, length, 4, [1] * 4, [("single", 0)])
    if task == "niah_multivalue":
        return _niah(rng, hay, counter, length, 1, [4], [("multivalue", 0)])
    if task == "niah_multiquery":
        return _niah(rng, hay, counter, length, 4, [1] * 4, [("multiquery", [0, 1, 2, 3])])
    if task == "niah_multiturn":
        order = [0, 1, 2, 3]
        rng.shuffle(order)
        return _niah(rng, hay, counter, length, 4, [1] * 4, [("single", i) for i in order])
    if task == "vt":
        return _vt(rng, hay, counter, length, 2, 4, [0])
    if task == "kv":
        return _kv(rng, counter, length, 1)
    if task == "cwe":
        return _cwe(rng, counter, length, 5, 2)
    if task == "kv_many":
        return _kv(rng, counter, length, KV_MANY_KEYS, together=True)
    raise ValueError(f"unknown task {task!r}")


def record_seed(base_seed, task, length, index):
    h = hashlib.sha256(f"{base_seed}:{task}:{length}:{index}".encode()).hexdigest()
    return int(h[:12], 16)


def make_record(task, length, base_seed, index, hay, counter):
    seed = record_seed(base_seed, task, length, index)
    rng = random.Random(seed)
    s = generate(task, rng, hay, counter, length)
    q0, a0 = s.turns[0]
    rec = {
        "id": f"{task}-{length}-{index}",
        "task": task,
        "length": length,
        "seed": seed,
        "prompt": s.context + f"Q: {q0}\nA:",
        "answer": a0,
        "n_tokens": s.n_tokens,
        "tokenizer": counter.name,
        "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
    }
    if task in LONG_TASKS:
        # The answer's tokens and room for a longer wrong one.
        rec["max_new_tokens"] = counter.count(" " + answer_text(a0) + "\n") * 5 // 4 + 16
    if len(s.turns) > 1:
        rec["context"] = s.context
        rec["turns"] = [{"question": f"Q: {q}\nA:", "answer": a} for q, a in s.turns]
    return rec


def generate_set(tasks, lengths, num, base_seed, hay, counter, first=0):
    """Records first..num-1 of each task and length."""
    for length in lengths:
        for task in tasks:
            for i in range(first, num):
                yield make_record(task, length, base_seed, i, hay, counter)


_JOB = {}


def _job_init(corpus, tokenizer):
    _JOB["hay"] = Haystack.from_file(corpus)
    _JOB["counter"] = make_counter(tokenizer)


def _job(spec):
    task, length, base_seed, i = spec
    return make_record(task, length, base_seed, i, _JOB["hay"], _JOB["counter"])


# --------------------------------------------------------------------------
# Training samples (imported by train.py).

TRAIN_WEIGHTS = (("niah", 0.55), ("vt", 0.15), ("kv", 0.2), ("cwe", 0.10))


def make_train_sample(rng, hay, counter, length):
    """A randomized multi-question sample of at most `length` tokens.

    Returns (text, answer_spans, task_name); answer_spans are character
    ranges of each " answer\\n" (train.py puts the task loss on them).
    Configurations too large for a short length are redrawn; the last resort
    is a single needle.
    """
    for _ in range(4):
        try:
            return _train_sample_once(rng, hay, counter, length)
        except ValueError:
            pass
    s = _niah(rng, hay, counter, length, 1, [1], [("single", 0)])
    text, spans = s.full_text()
    return text, spans, "niah"


def _train_sample_once(rng, hay, counter, length):
    r = rng.random()
    acc = 0.0
    kind = TRAIN_WEIGHTS[-1][0]
    for name, w in TRAIN_WEIGHTS:
        acc += w
        if r < acc:
            kind = name
            break
    if kind == "niah":
        # Longer samples carry more needles and questions (more answer tokens
        # per sequence where they are scarcest).
        n_keys = rng.randint(1, min(32, 8 + length // 1024))
        vpk = [1 if rng.random() < 0.8 else rng.randint(2, 4) for _ in range(n_keys)]
        order = list(range(n_keys))
        rng.shuffle(order)
        order = order[:rng.randint(1, min(n_keys, 4 + length // 2048))]
        questions = []
        i = 0
        while i < len(order):
            ki = order[i]
            if vpk[ki] > 1:
                questions.append(("multivalue", ki))
                i += 1
            elif rng.random() < 0.15 and i + 1 < len(order) and all(vpk[k] == 1 for k in order[i:i + 4]):
                m = min(len(order) - i, rng.randint(2, 4))
                questions.append(("multiquery", order[i:i + m]))
                i += m
            else:
                questions.append(("single", ki))
                i += 1
        s = _niah(rng, hay, counter, length, n_keys, vpk, questions)
    elif kind == "vt":
        n_chains = rng.randint(1, 3)
        asked = list(range(n_chains))
        rng.shuffle(asked)
        asked = asked[:rng.randint(1, n_chains)]
        s = _vt(rng, hay, counter, length, n_chains, rng.randint(1, 5), asked)
    elif kind == "kv":
        s = _kv(rng, counter, length, rng.randint(1, 4 + length // 2048))
    else:
        s = _cwe(rng, counter, length, rng.choice((3, 5)), rng.choice((1, 2)))
    text, spans = s.full_text()
    return text, spans, kind


# --------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description="Generate RULER-style JSONL task sets.")
    ap.add_argument("--corpus", required=True, help="haystack text (.txt or .txt.xz)")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer.json for exact lengths (default: approximate counter)")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--num", type=int, default=25, help="records per task and length")
    ap.add_argument("--first", type=int, default=0,
                    help="first record index: records first..num-1 (those of the --num set)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="-")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (output is identical)")
    args = ap.parse_args(argv)

    tasks = [t for t in args.tasks.split(",") if t]
    for t in tasks:
        if t not in TASKS and t not in LONG_TASKS:
            ap.error(f"unknown task {t} (the default set: {','.join(TASKS)}; long generation: {','.join(LONG_TASKS)})")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if not 0 <= args.first < args.num:
        ap.error(f"--first {args.first} must be in [0, --num {args.num})")
    out = sys.stdout if args.out == "-" else open(args.out, "w", encoding="utf-8")
    n = 0
    name = None
    if args.jobs > 1:
        import multiprocessing

        specs = [(t, L, args.seed, i) for L in lengths for t in tasks for i in range(args.first, args.num)]
        with multiprocessing.Pool(args.jobs, _job_init, (args.corpus, args.tokenizer)) as pool:
            records = pool.imap(_job, specs, chunksize=1)
            for rec in records:
                out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                name = rec["tokenizer"]
                n += 1
    else:
        hay = Haystack.from_file(args.corpus)
        counter = make_counter(args.tokenizer)
        name = counter.name
        for rec in generate_set(tasks, lengths, args.num, args.seed, hay, counter, args.first):
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
    if out is not sys.stdout:
        out.close()
    print(f"wrote {n} records ({name})", file=sys.stderr)


if __name__ == "__main__":
    main()

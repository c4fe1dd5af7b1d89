#!/usr/bin/env python3
"""Writes the tokenizer parity goldens read by tests/coordinator/tokenizer_golden_test.cc.

For each tokenizer (qwen2, llama2) this encodes a fixed, deterministic list of
a few hundred test strings with the Hugging Face `tokenizers` library and
writes one JSON line per string to <out_dir>/<name>_golden.jsonl:

  {"text": ..., "ids": encode(text, add_special_tokens=False).ids,
   "ids_special": encode(text, add_special_tokens=True).ids,
   "decoded": decode(ids, skip_special_tokens=False)}

Usage (on a machine with `pip install tokenizers`, e.g. the GPU machine):
  python3 tests/tools/make_tokenizer_goldens.py build/test_data/tokenizers tests/data/tokenizer
  python3 tests/tools/make_tokenizer_goldens.py --print-strings   # the inputs only

The string list lives here, not in the test, so the C++ side needs only the
.jsonl files. Keep it deterministic: the same script version must always
write the same files.
"""

import argparse
import json
import os
import random
import sys

NAMES = ("qwen2", "llama2")


def hand_written():
    s = []
    # Empty, whitespace-only and leading/trailing whitespace.
    s += ["", " ", "  ", "   ", "\t", "\n", "\r\n", " \n ", "\n\n\n", "\t\t\t", " \t \n", "\r", "\r\r\n\n"]
    s += [" Hello", "  Hello", "   Hello", "Hello ", "Hello  ", " Hello ", "\tHello", "\nHello", "Hello\n",
          "Hello world", "Hello  world", "Hello   world", "Hello\tworld", "Hello\nworld", "Hello\r\nworld",
          "Hello \n world", "Hello\n\nworld", "Hello \nworld", "Hello\n world", "a  b", "a   b c    d"]
    # Plain prose, punctuation and case.
    s += ["The quick brown fox jumps over the lazy dog.",
          "It was the best of times, it was the worst of times.",
          "HELLO WORLD", "hElLo WoRlD", "Hello, World!", "Wait... what?!", "!!!", "???", "...", "--", "—",
          "(parenthesis) [brackets] {braces} <angles>", "a/b\\c|d", "#hashtag @mention $100 50% ^caret &amp; *star*",
          "\"double\" 'single' `back`", "e.g. i.e. etc.", "Mr. Smith went to Washington."]
    # Contractions (the (?i:'s|'t|...) alternative).
    s += ["don't", "Don't", "DON'T", "I'm", "I'M", "you're", "YOU'RE", "we've", "they'll", "THEY'LL", "she'd",
          "it's", "IT'S", "'s", "'S", "'ll've", "rock 'n' roll", "O'Neil's", "x'sy"]
    # Numbers.
    s += ["0", "1", "12", "123", "1234", "12345", "123456789", "12345678901234567890123456789",
          "3.14159265358979", "1,000,000", "-42", "+7", "1e-10", "0x1F", "0b1010", "2024-01-15", "12:34:56",
          "$1,234.56", "1st 2nd 3rd 4th", "v1.2.3", "192.168.0.1", "(555) 123-4567", "100%", "1/2", "99 bottles"]
    # Code.
    s += ["def f(x):\n    return x * 2\n",
          "int main() {\n  printf(\"hi\\n\");\n  return 0;\n}\n",
          "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
          "if x == 1:\n\tpass\nelif x != 2:\n\t\tpass",
          "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
          "<html><body class=\"x\">Hi</body></html>",
          "SELECT * FROM users WHERE id = 42;",
          "    indented four\n        indented eight\n",
          "x=1;y=2;z=x+y",
          "#include <vector>\nstd::vector<int> v{1,2,3};",
          "lambda x: x**2 // 3 % 4",
          "https://example.com/path?query=1&b=2#frag",
          "user.name+tag@example.co.uk",
          "C:\\Users\\name\\file.txt",
          "/usr/local/bin/python3 -m pip install -U pip",
          "a_b_c snake_case CamelCase kebab-case SCREAMING_CASE",
          "```python\nprint('x')\n```"]
    # Scripts other than Latin.
    s += ["你好，世界。", "我爱自然语言处理", "東京は日本の首都です。", "ひらがな カタカナ 漢字",
          "안녕하세요 세계", "Привет, мир!", "Ελληνικά γράμματα", "مرحبا بالعالم", "שלום עולם",
          "नमस्ते दुनिया", "สวัสดีชาวโลก", "Xin chào thế giới", "Zażółć gęślą jaźń", "Straße groß",
          "ĳ Ǆ ǅ ǆ", "ﬁ ﬂ ﬀ", "Ⅻ ½ ² ³ ٣ ৪ ๕", "ＡＢＣ１２３ｱｲｳ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛", "𐍈 𐌰 𓀀"]
    # Accents, composed and decomposed (NFC matters for Qwen2).
    s += ["café", "cafe\u0301", "naïve", "nai\u0308ve", "Å", "A\u030a", "\u212b", "é", "e\u0301",
          "e\u0301\u0301", "o\u0308\u0304", "\u1100\u1161\u11a8", "\u1100\u1161", "\u0915\u093c", "\u00c7a va?",
          "C\u0327a va?", "x\u0301y", "\u0301leading combining", "ṩ", "s\u0323\u0307", "s\u0307\u0323",
          "\u00f1 n\u0303", "\u0041\u030a\u0301", "ǖ", "u\u0308\u0304", "\u2126 \u03a9", "\u1e9b\u0323"]
    # Emoji: single, ZWJ sequences, flags, skin tones, keycaps.
    s += ["😀", "🦙", "Hello 😀 world", "👍🏽", "👨‍👩‍👧‍👦", "🇺🇸🇯🇵", "1️⃣", "❤️", "🏳️‍🌈", "😀😀😀",
          "emoji:🎉done", "🙂 🙃", "☕", "✓ ✗ ★ ☆ ♠"]
    # Unusual whitespace and invisible characters.
    s += ["a\u00a0b", "a\u2028b", "a\u2029b", "a\u3000b", "a\u0085b", "a\u180eb", "a\u200bb", "a\u200db",
          "a\ufeffb", "\ufeffBOM", "a\u2009b\u200ab", "a\u202fb", "tab\tand\u000bvt\u000cff", "  \u00a0  ",
          "\u3000\u3000", "end\u00a0"]
    # Control characters and the NUL byte.
    s += ["a\u0000b", "\u0000", "\u0001\u0002\u0003", "del\u007f", "\u001b[31mred\u001b[0m", "\u0080\u009f"]
    # Private use, noncharacters, astral.
    s += ["\ue000\uf8ff", "\U000f0000", "\ufffd", "\uffff", "\U0010fffd", "\U0001f9ff"]
    # Characters that are tokens' building blocks in one of the two schemes.
    s += ["▁", "▁hello", "a▁b", "▁▁", "Ġ", "Ġhello", "Ċ", "ĠĠ", "<0x41>", "<0xFF>", "<unk>"]
    # Special and added tokens inside text (Qwen2 and Llama-2 spellings).
    s += ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<s></s>", "<s><s>",
          "<|im_start|>user\nHi<|im_end|>",
          "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
          "<|im_start|>assistant\n",
          "text<|endoftext|>more text", "  <|endoftext|>  ", "<|endoftext|><|endoftext|>",
          "<|im_start", "im_start|>", "<|im_start|", "<||>", "<|unknown|>", "< s>", "<s >", "<S>",
          "<s>Hello", "Hello<s>", "Hello <s> world", "Hello</s>", "</s> leading", "<s> </s>", " <s>",
          "<tool_call>{\"name\": \"f\"}</tool_call>", "<|fim_prefix|>def<|fim_suffix|>pass<|fim_middle|>",
          "<|vision_start|><|image_pad|><|vision_end|>", "<|file_sep|>main.py", "<|repo_name|>x",
          "<s>[INST] Hi [/INST]", "<unk><s></s>", "<|im_end|>\n"]
    # Long words and runs.
    s += ["supercalifragilisticexpialidocious", "Pneumonoultramicroscopicsilicovolcanoconiosis",
          "a" * 100, "ab" * 60, "abc" * 40, " " * 40, "\n" * 30, "\t" * 20, " \n" * 20, "." * 50, "-" * 80,
          "=" * 64, "0" * 50, "9876543210" * 5, "ha" * 30 + "!", "A" * 70, "😀" * 20, "你" * 40,
          "word " * 30, "x\n" * 25]
    return s


def generated(count, seed):
    """Deterministic random combinations of fragments and separators."""
    rng = random.Random(seed)
    words = ["the", "The", "model", "attention", "KV", "cache", "long-context", "token", "42", "3.5", "1000000",
             "don't", "we'll", "café", "naïve", "e\u0301", "你好", "世界", "日本語", "한국어", "Привет", "مرحبا",
             "😀", "🦙", "👍🏽", "x", "I", "a", "(", ")", "{", "}", "[", "]", ";", ":", ",", ".", "!", "?", "'", "\"",
             "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "▁", "Ġ", "def", "return", "==", "->",
             "//", "/*", "*/", "#", "$", "%", "&", "_", "__init__", "self", "0x7f", "\\n", "url://a.b/c"]
    seps = [" ", " ", " ", "  ", "", "\n", "\t", " \n", "\n\n", "   ", "\u00a0", "\r\n", "\u3000"]
    out = []
    for _ in range(count):
        n = rng.randint(1, 12)
        parts = []
        for i in range(n):
            if i:
                parts.append(rng.choice(seps))
            parts.append(rng.choice(words))
        text = "".join(parts)
        r = rng.random()
        if r < 0.15:
            text = " " + text
        elif r < 0.25:
            text = text + " "
        elif r < 0.3:
            text = "\n" + text + "\n"
        out.append(text)
    return out


def long_texts():
    para = ("Long-context inference keeps the key-value cache of every previous token. "
            "ShadowKV stores low-rank pre-RoPE keys on the GPU and offloads values to the host; "
            "it fetches only the chunks whose landmarks score highest. 12345 tokens/s, 3.2x faster!\n")
    mixed = "日本語のテキストと English text, mixed with numbers 1234567 and emoji 🦙🦙. "
    code = "def attention(q, k, v):\n    s = q @ k.T / math.sqrt(d)\n    return softmax(s) @ v\n\n"
    return [para * 10, mixed * 20, code * 15, (para + mixed + code) * 5,
            "<|im_start|>user\n" + para * 3 + "<|im_end|>\n<|im_start|>assistant\n" + mixed * 3 + "<|im_end|>"]


def all_strings():
    seen = set()
    out = []
    for t in hand_written() + generated(180, seed=20240615) + long_texts():
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tokenizers_dir", nargs="?", help="folder holding <name>/tokenizer.json (build/test_data/tokenizers, unpacked by the build from tests/data/tokenizer/<name>.tar.xz)")
    ap.add_argument("out_dir", nargs="?", default="tests/data/tokenizer", help="where <name>_golden.jsonl go")
    ap.add_argument("--names", nargs="+", default=list(NAMES), help="tokenizers to process")
    ap.add_argument("--print-strings", action="store_true", help="print the inputs as JSON lines and exit")
    args = ap.parse_args()

    strings = all_strings()
    if args.print_strings:
        for t in strings:
            print(json.dumps(t, ensure_ascii=True))
        print(f"{len(strings)} strings", file=sys.stderr)
        return 0
    if not args.tokenizers_dir:
        ap.error("tokenizers_dir is required")

    import tokenizers  # only needed here; absent on the build machines
    from tokenizers import Tokenizer

    os.makedirs(args.out_dir, exist_ok=True)
    for name in args.names:
        path = os.path.join(args.tokenizers_dir, name, "tokenizer.json")
        tok = Tokenizer.from_file(path)
        out_path = os.path.join(args.out_dir, f"{name}_golden.jsonl")
        with open(out_path, "w", encoding="ascii", newline="\n") as f:
            for text in strings:
                ids = tok.encode(text, add_special_tokens=False).ids
                ids_special = tok.encode(text, add_special_tokens=True).ids
                decoded = tok.decode(ids, skip_special_tokens=False)
                f.write(json.dumps({"text": text, "ids": ids, "ids_special": ids_special, "decoded": decoded},
                                   ensure_ascii=True) + "\n")
        print(f"{out_path}: {len(strings)} lines (tokenizers {tokenizers.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Extracts plain English text from installed Debian packages into a corpus.

Called by prepare_corpus.sh after the packages are installed. Pure standard
library (python3 >= 3.9). Output (under --out):
  corpus-train.txt.xz    documents separated by a line holding only "\\x1e"
  corpus-heldout.txt.xz  same format; about --heldout-frac of the documents,
                         chosen by a hash of the document name (for eval
                         haystacks, never used in training)
  sources.json           bytes and document counts per source

The extraction is deterministic: files are visited in sorted order and the
held-out split depends only on the document names.
"""

import argparse
import glob
import gzip
import hashlib
import html.parser
import json
import lzma
import os
import re
import subprocess
import sys
import unicodedata

DOC_SEP = "\n\x1e\n"

# --------------------------------------------------------------------------
# Cleaning.

_CTRL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_MULTI_BLANK = re.compile(r"\n{3,}")
_TRAIL_WS = re.compile(r"[ \t]+\n")


def _line_ok(line):
    s = line.strip()
    if len(s) < 20:
        return True
    letters = sum(c.isalpha() for c in s)
    return letters >= 0.45 * len(s)


def clean(text):
    """Normalizes, drops control characters and table/art-like lines."""
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ")
    text = _CTRL.sub("", text)
    # Our task prompts use these markers; never let the corpus contain them.
    text = text.replace("<doc>", "<d0c>").replace("</doc>", "</d0c>")
    lines = [l.rstrip() for l in text.split("\n")]
    lines = [l for l in lines if _line_ok(l)]
    text = "\n".join(lines)
    text = _TRAIL_WS.sub("\n", text)
    text = _MULTI_BLANK.sub("\n\n", text)
    return text.strip()


# --------------------------------------------------------------------------
# Format readers.


class _HTMLText(html.parser.HTMLParser):
    BLOCK = {"p", "div", "br", "li", "ul", "ol", "h1", "h2", "h3", "h4", "h5",
             "h6", "tr", "table", "pre", "dt", "dd", "dl", "section", "title",
             "blockquote", "hr"}
    SKIP = {"script", "style", "head", "nav"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts = []
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skip += 1
        elif tag in self.BLOCK:
            self.parts.append("\n\n" if tag in ("p", "h1", "h2", "h3", "pre") else "\n")

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def html_to_text(raw):
    p = _HTMLText()
    p.feed(raw)
    p.close()
    text = "".join(p.parts)
    # Reflow: collapse runs of spaces inside lines.
    text = re.sub(r"[ \u00a0]+", " ", text)
    text = re.sub(r" *\n *", "\n", text)
    return text


_POD_CMD = re.compile(r"^=(\w+)\s*(.*)$")
_POD_FMT = re.compile(r"[BCEFIJLSXZ]<+\s*(.*?)\s*>+")


def pod_to_text(raw):
    out = []
    in_pod = raw.lstrip().startswith("=")
    for line in raw.split("\n"):
        m = _POD_CMD.match(line)
        if m:
            cmd, rest = m.group(1), m.group(2)
            if cmd == "cut":
                in_pod = False
                continue
            in_pod = True
            if cmd.startswith("head") or cmd == "item":
                out.append("\n" + rest + "\n")
            continue
        if in_pod:
            out.append(line)
    text = "\n".join(out)
    for _ in range(3):
        text = _POD_FMT.sub(r"\1", text)
    return text


_RST_NOISE = re.compile(r"^\s*(\.\. |:[a-zA-Z]+:|[=\-~^\"'`#*+]{4,}\s*$)")
_RST_ROLE = re.compile(r":[a-z:]+:`([^`<]*?)(?:\s*<[^>]*>)?`")


def rst_to_text(raw):
    lines = []
    skipping = False
    for line in raw.split("\n"):
        if skipping:
            if line.strip() and not line.startswith((" ", "\t")):
                skipping = False
            else:
                continue
        if line.startswith(".. "):
            # Directives and comments; their indented bodies are skipped too,
            # except for prose-bearing admonitions.
            if not re.match(r"\.\. (note|warning|tip|important|versionadded|"
                            r"versionchanged|deprecated)::", line):
                skipping = True
            continue
        if _RST_NOISE.match(line):
            continue
        line = _RST_ROLE.sub(r"\1", line)
        line = line.replace("``", "").replace("**", "")
        lines.append(line)
    return "\n".join(lines)


def gcide_entries(raw):
    """Yields cleaned GCIDE entries (the dictd text of the dictionary)."""
    # Entries start at column 0; continuation lines are indented.
    entry = []
    for line in raw.split("\n"):
        if line and not line[0].isspace() and entry:
            yield "\n".join(entry)
            entry = []
        if "[1913 Webster]" in line or "[PJC]" in line or "[WordNet" in line:
            line = re.sub(r"\[(1913 Webster|PJC|WordNet[^\]]*)\]", "", line)
        line = re.sub(r"[{}\\*]", "", line).strip()
        if line:
            entry.append(line)
    if entry:
        yield "\n".join(entry)


def read_gz_or_plain(path):
    if path.endswith((".gz", ".dz")):
        with gzip.open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    with open(path, "rb") as f:
        return f.read().decode("utf-8", "replace")


# --------------------------------------------------------------------------
# Sources. Each yields (doc_name, text).


def src_kjv():
    try:
        out = subprocess.run(["bible", "-l1000", "gen1:1-rev22:21"],
                             capture_output=True, text=True, check=True,
                             stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"kjv: skipped ({e})", file=sys.stderr)
        return
    # Chapters start with a title line "Book N" preceded by a blank line.
    chapters = re.split(r"\n\n(?=[1-3]?\s?[A-Z][A-Za-z ]+ \d+\n)", out)
    group, gi = [], 0
    for ch in chapters:
        ch = re.sub(r"^\s+(\d+) ", r"\1 ", ch, flags=re.M)
        group.append(ch.strip())
        if len(group) == 5:
            yield f"kjv/{gi}", "\n\n".join(group)
            group, gi = [], gi + 1
    if group:
        yield f"kjv/{gi}", "\n\n".join(group)


FORTUNE_SKIP = {"art", "ascii-art", "translate-me"}


def src_fortunes():
    for path in sorted(glob.glob("/usr/share/games/fortunes/*")):
        name = os.path.basename(path)
        if "." in name or name in FORTUNE_SKIP or os.path.isdir(path):
            continue
        items = read_gz_or_plain(path).split("\n%\n")
        for i in range(0, len(items), 40):
            yield f"fortunes/{name}/{i}", "\n\n".join(x.strip() for x in items[i:i + 40])


def src_jargon():
    path = "/usr/share/doc/jargon-text/jargon.txt.gz"
    if not os.path.exists(path):
        return
    raw = read_gz_or_plain(path)
    # Entries look like "   :Headword: n." and are indented by three spaces;
    # everything before the first entry is the table of contents.
    entries = re.split(r"\n(?=   :[^:\n]+:)", raw)[1:]
    entries = [re.sub(r"^   ", "", e, flags=re.M).replace("{", "").replace("}", "")
               for e in entries]
    for i in range(0, len(entries), 60):
        yield f"jargon/{i}", "\n\n".join(e.strip() for e in entries[i:i + 60])


def src_rst_tree(prefix, root):
    for path in sorted(glob.glob(os.path.join(root, "**", "*.rst.txt"), recursive=True)):
        if "/translations/" in path:  # non-English kernel documentation
            continue
        yield f"{prefix}/{os.path.relpath(path, root)}", rst_to_text(read_gz_or_plain(path))


def src_html_tree(prefix, root, pattern="**/*.html"):
    for path in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
        yield f"{prefix}/{os.path.relpath(path, root)}", html_to_text(read_gz_or_plain(path))


def src_perl_pod():
    roots = sorted(glob.glob("/usr/share/perl/5*"))
    for root in roots[-1:]:
        for path in sorted(glob.glob(os.path.join(root, "**", "*.pod"), recursive=True)):
            yield f"perl/{os.path.relpath(path, root)}", pod_to_text(read_gz_or_plain(path))



def src_git_doc():
    for path in sorted(glob.glob("/usr/share/doc/git-doc/**/*.txt", recursive=True)):
        yield f"git/{os.path.relpath(path, '/usr/share/doc/git-doc')}", read_gz_or_plain(path)


def src_text_files(prefix, paths):
    for path in paths:
        if os.path.exists(path):
            yield f"{prefix}/{os.path.basename(path)}", read_gz_or_plain(path)


def src_gcide(max_bytes):
    path = "/usr/share/dictd/gcide.dict.dz"
    if not os.path.exists(path):
        return
    raw = read_gz_or_plain(path)
    group, size, gi = [], 0, 0
    total = 0
    for e in gcide_entries(raw):
        # Keep only entries with some prose (a quotation or a long definition).
        if len(e) < 200:
            continue
        # Deterministic subsample to about max_bytes.
        h = int(hashlib.md5(e[:64].encode()).hexdigest()[:8], 16)
        if h % 100 >= 45:
            continue
        group.append(e)
        size += len(e)
        if size > 20000:
            yield f"gcide/{gi}", "\n\n".join(group)
            total += size
            group, size, gi = [], 0, gi + 1
            if total >= max_bytes:
                return
    if group:
        yield f"gcide/{gi}", "\n\n".join(group)


def all_sources(gcide_bytes):
    return [
        ("kjv", "bible-kjv-text (+bible-kjv reader)", src_kjv()),
        ("fortunes", "fortunes, fortunes-min, fortunes-bofh-excuses", src_fortunes()),
        ("jargon", "jargon-text", src_jargon()),
        ("linux-doc", "linux-doc-6.1 (reStructuredText sources)",
         src_rst_tree("linux", "/usr/share/doc/linux-doc-6.1/html/_sources")),
        ("python-doc", "python3.11-doc (reStructuredText sources)",
         src_rst_tree("python", "/usr/share/doc/python3.11/html/_sources")),
        ("perl-doc", "perl-doc (pod)", src_perl_pod()),
        ("postgresql-doc", "postgresql-doc-15 (HTML)",
         src_html_tree("postgresql", "/usr/share/doc/postgresql-doc-15/html")),
        ("git-doc", "git-doc (AsciiDoc text)", src_git_doc()),
        ("debian-handbook", "debian-handbook (HTML, en-US only)",
         src_html_tree("handbook", "/usr/share/doc/debian-handbook/html/en-US")),
        ("gnu-standards", "gnu-standards", src_text_files("gnu", [
            "/usr/share/doc/gnu-standards/standards.text.gz",
            "/usr/share/doc/gnu-standards/maintain.text.gz"])),
        ("bash-doc", "bash-doc (HTML reference)", src_html_tree("bash", "/usr/share/doc/bash", "bashref.html")),
        ("doc-debian", "doc-debian", src_text_files("debian", sorted(
            glob.glob("/usr/share/doc/debian/*.txt*") + glob.glob("/usr/share/doc/debian/FAQ/*.txt*")))),
        ("gcide", "dict-gcide (subsample of entries)", src_gcide(gcide_bytes)),
    ]


def split_long(name, text, max_chars=200000):
    """Splits very long documents at paragraph boundaries."""
    if len(text) <= max_chars:
        yield name, text
        return
    paras = text.split("\n\n")
    cur, size, i = [], 0, 0
    for p in paras:
        cur.append(p)
        size += len(p) + 2
        if size >= max_chars:
            yield f"{name}#{i}", "\n\n".join(cur)
            cur, size, i = [], 0, i + 1
    if cur:
        yield f"{name}#{i}", "\n\n".join(cur)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--heldout-frac", type=float, default=0.04)
    ap.add_argument("--gcide-bytes", type=int, default=20_000_000)
    ap.add_argument("--min-doc-chars", type=int, default=300)
    ap.add_argument("--xz-preset", type=int, default=6)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    stats = {}
    train_parts, held_parts = [], []
    for key, pkg, docs in all_sources(args.gcide_bytes):
        st = {"package": pkg, "docs": 0, "chars": 0, "heldout_docs": 0, "heldout_chars": 0}
        for name, raw in docs:
            for dname, text in split_long(name, clean(raw)):
                if len(text) < args.min_doc_chars:
                    continue
                h = int(hashlib.sha256(dname.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
                if h < args.heldout_frac:
                    held_parts.append(text)
                    st["heldout_docs"] += 1
                    st["heldout_chars"] += len(text)
                else:
                    train_parts.append(text)
                    st["docs"] += 1
                    st["chars"] += len(text)
        stats[key] = st
        print(f"{key:16s} docs={st['docs']:6d} chars={st['chars']:11,d} "
              f"heldout_docs={st['heldout_docs']:5d} heldout_chars={st['heldout_chars']:10,d}",
              file=sys.stderr)

    for fname, parts in (("corpus-train.txt.xz", train_parts), ("corpus-heldout.txt.xz", held_parts)):
        data = DOC_SEP.join(parts).encode("utf-8")
        with lzma.open(os.path.join(args.out, fname), "wb", preset=args.xz_preset) as f:
            f.write(data)
        stats["_" + fname] = {"raw_bytes": len(data),
                              "xz_bytes": os.path.getsize(os.path.join(args.out, fname)),
                              "docs": len(parts)}
        print(f"{fname}: raw={len(data):,d} xz={stats['_' + fname]['xz_bytes']:,d}", file=sys.stderr)
    with open(os.path.join(args.out, "sources.json"), "w") as f:
        json.dump(stats, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()

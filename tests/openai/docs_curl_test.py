#!/usr/bin/python3
"""Runs the curl examples of docs/openai.md (the bash block after the
<!-- openai-curl-examples --> marker, one command per paragraph) against the
service tests/openai/with_service.py started, and checks each answer: the
model list, a chat completion, a stream of completion chunks ending with
[DONE]. Usage: with_service.py -- python3 docs_curl_test.py"""
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def examples():
    text = open(os.path.join(REPO, "docs", "openai.md")).read()
    m = re.search(r"<!-- openai-curl-examples -->\s*```bash\n(.*?)```", text, re.S)
    if not m:
        sys.exit("docs/openai.md: no bash block after <!-- openai-curl-examples -->")
    return [c.strip() for c in m.group(1).split("\n\n") if c.strip()]


def run(command):
    p = subprocess.run(["bash", "-c", "set -euo pipefail\n" + command], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=120)
    if p.returncode != 0:
        sys.exit("FAIL (exit %d): %s\n%s%s" % (p.returncode, command, p.stdout.decode(), p.stderr.decode()))
    return p.stdout.decode()


def main():
    cmds = examples()
    assert len(cmds) == 3, "expected 3 examples, got %d" % len(cmds)
    models = json.loads(run(cmds[0]))
    assert models["object"] == "list" and models["data"][0]["id"] == "penumbra-eval", models
    chat = json.loads(run(cmds[1]))
    assert chat["object"] == "chat.completion", chat
    assert chat["choices"][0]["message"]["role"] == "assistant", chat
    assert chat["usage"]["completion_tokens"] >= 1, chat
    events = [l[len("data: "):] for l in run(cmds[2]).splitlines() if l.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks), chunks
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length"), chunks[-1]
    print("docs/openai.md: %d curl examples answered" % len(cmds))


if __name__ == "__main__":
    main()

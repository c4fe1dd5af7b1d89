#!/usr/bin/python3
"""Runs the curl examples of docs/openai.md (the bash block after the
<!-- openai-curl-examples --> marker, one command per paragraph, and the
one after <!-- openai-batch-curl-example -->, as one script in a directory
of its own) against the service tests/openai/with_service.py started, and
checks each answer: the model list, a chat completion, a stream of
completion chunks ending with [DONE], a batch's output file with a line
for each of its requests. Usage: with_service.py -- python3 docs_curl_test.py"""
import json
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def block(marker):
    text = open(os.path.join(REPO, "docs", "openai.md")).read()
    m = re.search(r"<!-- %s -->\s*```bash\n(.*?)```" % marker, text, re.S)
    if not m:
        sys.exit("docs/openai.md: no bash block after <!-- %s -->" % marker)
    return m.group(1)


def examples():
    return [c.strip() for c in block("openai-curl-examples").split("\n\n") if c.strip()]


def run(command, cwd=None):
    p = subprocess.run(["bash", "-c", "set -euo pipefail\n" + command], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=120, cwd=cwd)
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
    with tempfile.TemporaryDirectory() as d:
        lines = [json.loads(l) for l in run(block("openai-batch-curl-example"), cwd=d).splitlines() if l.strip()]
    assert sorted(l["custom_id"] for l in lines) == ["dog", "park"], lines
    assert all(l["response"]["status_code"] == 200 and l["response"]["body"]["object"] == "chat.completion"
               for l in lines), lines
    print("docs/openai.md: %d curl examples and the batch example answered" % len(cmds))


if __name__ == "__main__":
    main()

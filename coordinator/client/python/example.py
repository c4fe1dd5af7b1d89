#!/usr/bin/python3
"""Puts a document into Penumbra and streams the answer to a question about it.

    /usr/bin/python3 coordinator/client/python/example.py --port 7700 [--api-key-file F] [--tls-ca CA] \\
        [--document FILE] [--question "Who is Lily?"]

(The API key: --api-key-file, else $PENUMBRA_API_KEY_FILE or $PENUMBRA_API_KEY;
TLS: --tls-ca, else $PENUMBRA_TLS_CA.)
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from penumbra_client import (PenumbraClientError, add_connection_args, chunk_error, client_from_args,  # noqa: E402
                             state_name)

SAMPLE_DOCUMENT = (
    "Once upon a time, there was a little girl named Lily. She lived in a small house near a big forest "
    "with her mom, her dad and her dog Max. Every morning Lily and Max went to the park to play with a red "
    "ball. One day the ball rolled into the forest. Lily was scared, but Max was brave. Max ran into the "
    "forest and found the ball under a big tree. Lily hugged Max and said, \"Thank you, Max! You are the "
    "best dog in the world.\" They went home and ate apples with mom. From that day on, Lily was not "
    "scared of the forest anymore.\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_connection_args(ap)
    ap.add_argument("--document", help="a text file (default: a short built-in story)")
    ap.add_argument("--question", default="\nQuestion: What did Max find under the tree?\nAnswer:")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--keep", action="store_true", help="keep the document (default: delete it at the end)")
    args = ap.parse_args()
    if args.port is None:
        ap.error("--port is required (or $PENUMBRA_PORT)")
    try:
        client = client_from_args(args)  # reads the key and TLS files: a bad one is named here
    except ValueError as e:
        ap.error(str(e))

    if args.document:
        with open(args.document, encoding="utf-8") as f:
            text = f.read()
        name = os.path.basename(args.document)
    else:
        text, name = SAMPLE_DOCUMENT, "sample-story"

    try:
        with client:
            t0 = time.monotonic()
            doc = client.put_document(name, text=text)
            print("document %s (%s): %d tokens, %s in %.2f s" %
                  (doc.id, name, doc.tokens, state_name(doc.state), time.monotonic() - t0), file=sys.stderr)
            if doc.error:
                print("document failed: %s" % doc.error, file=sys.stderr)
                return 1
            try:
                request_id = client.generate([doc.id], text=args.question, max_new_tokens=args.max_new_tokens,
                                             temperature=args.temperature)
                last = None
                for delta, chunk in client.stream(request_id):
                    sys.stdout.write(delta)
                    sys.stdout.flush()
                    last = chunk
                print()
                u = last.usage
                print("finish: %s; prompt tokens %d (of which cached %d), generated %d, ttft %.3f s" %
                      (last.finish_reason, u.prompt_tokens, u.cached_prompt_tokens, u.generated_tokens,
                       u.ttft_seconds))
                err = chunk_error(last)
                if err is not None:
                    print("generation failed: %s" % err, file=sys.stderr)
                    return 1
            finally:
                if not args.keep:
                    client.delete_document(doc.id)
    except PenumbraClientError as e:
        print("error: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

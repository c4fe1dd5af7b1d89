#!/usr/bin/python3
"""Asks every question about every document as one Penumbra batch job.

    /usr/bin/python3 coordinator/client/python/batch_job.py --port 7700 [--api-key-file F] [--tls-ca CA] \\
        [--document FILE ...] [--question "Who is Lily?" ...] [--max-new-tokens 64]

Puts the documents (default: a short built-in story), submits a job of
documents x questions (custom_id "d<i>-q<j>"), waits for it with a progress
line on stderr, prints each answer, then deletes the job and the documents
(unless --keep). Ctrl-C while waiting cancels the job. The coordinator must
have been started with --data-dir (batch jobs are off without one).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from example import SAMPLE_DOCUMENT  # noqa: E402
from penumbra_client import (JobStatus, PenumbraClientError, add_connection_args, client_from_args,  # noqa: E402
                             job_result_error, job_status_name, state_name)

DEFAULT_QUESTIONS = [
    "\nQuestion: What did Max find under the tree?\nAnswer:",
    "\nQuestion: Who is Lily?\nAnswer:",
    "\nQuestion: What did they eat at home?\nAnswer:",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_connection_args(ap)
    ap.add_argument("--document", action="append", default=[], help="a text file (repeatable; default: a built-in story)")
    ap.add_argument("--question", action="append", default=[], help="a question (repeatable; default: three)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--poll-s", type=float, default=1.0, help="how often the job is polled")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="how long to wait for the job")
    ap.add_argument("--keep", action="store_true", help="keep the job and the documents")
    args = ap.parse_args()
    try:
        client = client_from_args(args)  # reads the key and TLS files: a bad one is named here
    except ValueError as e:
        ap.error(str(e))

    sources = []
    for path in args.document:
        with open(path, encoding="utf-8") as f:
            sources.append((os.path.basename(path), f.read()))
    if not sources:
        sources = [("sample-story", SAMPLE_DOCUMENT)]
    questions = args.question or DEFAULT_QUESTIONS

    def progress(job):
        done = job.completed + job.failed + job.cancelled
        print("job %s: %s, %d/%d done (%d ok, %d failed, %d cancelled), %d running, %.1f s" %
              (job.id, job_status_name(job.status), done, job.total, job.completed, job.failed, job.cancelled,
               job.running, time.monotonic() - t0), file=sys.stderr)

    docs = []
    job = None
    try:
        with client:
            try:
                for name, text in sources:
                    doc = client.put_document(name, text=text)
                    print("document %s (%s): %d tokens, %s" % (doc.id, name, doc.tokens, state_name(doc.state)),
                          file=sys.stderr)
                    if doc.error:
                        print("document failed: %s" % doc.error, file=sys.stderr)
                        return 1
                    docs.append(doc)
                items = {}  # custom_id -> (document, question)
                for i, doc in enumerate(docs):
                    for j, q in enumerate(questions):
                        items["d%d-q%d" % (i, j)] = (doc, q)
                t0 = time.monotonic()
                job = client.submit_job(
                    [{"custom_id": cid, "document_ids": [doc.id], "text": q, "max_new_tokens": args.max_new_tokens,
                      "temperature": args.temperature} for cid, (doc, q) in items.items()],
                    metadata="batch_job.py")
                print("job %s: %d items submitted" % (job.id, job.total), file=sys.stderr)
                try:
                    job = client.wait_job(job.id, poll_s=args.poll_s, timeout_s=args.timeout_s,
                                          on_progress=progress)
                except KeyboardInterrupt:
                    job = client.cancel_job(job.id)
                    print("interrupted: job %s %s" % (job.id, job_status_name(job.status)), file=sys.stderr)
                    return 130
                failed = 0
                for r in client.job_results(job.id):
                    doc, q = items[r.custom_id]
                    print("[%s] %s: %s" % (r.custom_id, doc.name, q.strip().replace("\n", " ")))
                    if r.ok:
                        print("    %s (%s, %d tokens)" % (r.text.strip(), r.finish_reason, r.usage.generated_tokens))
                    else:
                        failed += 1
                        print("    %s: %s" % (r.state, job_result_error(r)))
                return 0 if job.status == JobStatus.COMPLETED and failed == 0 else 1
            finally:
                if not args.keep:
                    if job is not None:
                        try:
                            client.delete_job(job.id)
                        except PenumbraClientError as e:  # still running (cancelled, not over yet)
                            print("job %s not deleted: %s" % (job.id, e), file=sys.stderr)
                    for doc in docs:
                        client.delete_document(doc.id)
    except PenumbraClientError as e:
        print("error: %s" % e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

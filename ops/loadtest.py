#!/usr/bin/python3
"""Load test of a Penumbra coordinator through the Python client.

    /usr/bin/python3 ops/loadtest.py --host H --port P [--api-key-file F] [--tls-ca CA] --clients N --seconds T \\
        [--document-tokens-text-chars C] [--max-new-tokens M] [--json OUT]
    /usr/bin/python3 ops/loadtest.py --start MODEL_DIR [--build BUILD_DIR] [--tls] --clients N --seconds T ...

The API key: --api-key-file, else $PENUMBRA_API_KEY_FILE, else
$PENUMBRA_API_KEY (never on the command line: --api-key is refused); TLS:
--tls-ca (default $PENUMBRA_TLS_CA), a client certificate with --tls-cert and
--tls-key (defaults $PENUMBRA_TLS_CERT/_KEY).

Puts one document (C characters of simple-story text), then N threads (one
client each) loop for T seconds: generate an answer about the document to a
question varied per request, stream it (long polling), and measure the time
to first token (generate call -> first chunk with tokens) and the per-token
latency (time between token arrivals / tokens in the chunk). Requests still
running at T finish (they are cancelled after --grace-seconds more). Errors
are counted by code. Prints a summary and one JSON line (also appended to
OUT with --json):

  {"bench": "service-load", "clients", "seconds", "requests", "requests_per_s",
   "ttft_p50_s", "ttft_p99_s", "token_latency_p50_s", "token_latency_p99_s",
   "generated_tokens", "tokens_per_s", "errors", "errors_by_code", "date", ...}

--start MODEL_DIR starts a worker (--device cpu unless --device) and a
coordinator from BUILD_DIR/bin on loopback (coordinator/client/python/
penumbra_local.py), with a random API key made for the run (unless one is
given) and, with --tls, certificates made for the run (`penumbra cert init`),
and stops them at the end.
"""

import argparse
import collections
import datetime
import json
import os
import secrets
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "coordinator", "client", "python"))


def percentile(values, q):
    """Linear-interpolated percentile (q in [0, 100]) of values; None if empty."""
    if not values:
        return None
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


_NAMES = ["Lily", "Tom", "Ben", "Sue", "Max", "Mia", "Sam", "Anna", "Tim", "Lucy"]
_ASKS = ["What did %s find?", "Where did %s live?", "Who was the friend of %s?", "How did %s feel?",
         "What did %s play with?", "Where did %s go at night?"]


def question(i):
    return "\n\nQuestion %d: %s\nAnswer:" % (i, _ASKS[i % len(_ASKS)] % _NAMES[(i // len(_ASKS)) % len(_NAMES)])


class Results(object):
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = 0
        self.ttft = []
        self.token_latency = []
        self.generated_tokens = 0
        self.errors = collections.Counter()
        self.finish = collections.Counter()


def client_loop(pc, args, doc_id, index, stop_at, hard_stop_at, results, counter):
    """One client: generates about doc_id and streams each answer until stop_at (cancelling a request still
    running at hard_stop_at), adding to results. Reads args.host, port, api_key, timeout, max_new_tokens,
    temperature, ignore_eos and wait_ms (ops/fairness.py passes one such namespace per tenant)."""
    r = results
    client = pc.PenumbraClient(args.host, args.port, api_key=args.api_key, timeout_s=args.timeout, tls_ca=args.tls_ca,
                               tls_cert=args.tls_cert, tls_key=args.tls_key)
    try:
        while time.monotonic() < stop_at:
            with r.lock:
                i = next(counter)
            ttft, lat, gen, finish, err = None, [], 0, None, None
            t0 = time.monotonic()
            try:
                rid = client.generate([doc_id], text=question(i), max_new_tokens=args.max_new_tokens,
                                      temperature=args.temperature, seed=i, ignore_eos=args.ignore_eos)
                last_t = None
                cancelled = False
                for _, chunk in client.stream(rid, wait_ms=args.wait_ms):
                    now = time.monotonic()
                    n = len(chunk.ids or [])
                    if n:
                        if ttft is None:
                            ttft = now - t0
                        else:
                            lat.extend([(now - last_t) / n] * n)
                        last_t = now
                    if chunk.done:
                        finish = chunk.finish_reason
                        gen = chunk.usage.generated_tokens if chunk.usage else 0
                        e = pc.chunk_error(chunk)
                        if e is not None:
                            err = e.code_name
                    elif not cancelled and now > hard_stop_at:
                        client.cancel(rid)
                        cancelled = True
            except pc.PenumbraClientError as e:
                err = e.code_name
                if isinstance(e, pc.ResourceExhausted):
                    time.sleep(min(5.0, (e.retry_after_ms or 100) / 1000.0))
                elif isinstance(e, pc.Unavailable):
                    time.sleep(0.5)
            with r.lock:
                if err is not None:
                    r.errors[err] += 1
                if finish is not None:
                    r.finish[finish] += 1
                    if err is None:
                        r.requests += 1
                        r.generated_tokens += gen
                        if ttft is not None:
                            r.ttft.append(ttft)
                        r.token_latency.extend(lat)
    finally:
        client.close()


def import_client(default_build):
    """penumbra_client, its generated code from $PENUMBRA_GEN_PY, else from
    the --build directory of the command line (read ahead of the rest: the
    parser needs penumbra_client's refuse_api_key_flag)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--build", default=default_build)
    known, _ = pre.parse_known_args()
    if not os.environ.get("PENUMBRA_GEN_PY"):
        os.environ["PENUMBRA_GEN_PY"] = os.path.join(os.path.abspath(known.build), "transport", "gen-py")
    import penumbra_client
    return penumbra_client


def main():
    pc = import_client(os.path.join(REPO, "build"))
    import penumbra_local
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pc.refuse_api_key_flag(ap)  # and no abbreviations: nothing is taken for --api-key-file by its prefix
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--api-key-file", default=os.environ.get("PENUMBRA_API_KEY_FILE"),
                    help="a file holding the API key (default $PENUMBRA_API_KEY_FILE, else the key in $PENUMBRA_API_KEY)")
    ap.add_argument("--tls-ca", default=os.environ.get("PENUMBRA_TLS_CA"),
                    help="the CA of the coordinator's certificate: TLS on (default $PENUMBRA_TLS_CA)")
    ap.add_argument("--tls-cert", default=os.environ.get("PENUMBRA_TLS_CERT"), help="a client certificate")
    ap.add_argument("--tls-key", default=os.environ.get("PENUMBRA_TLS_KEY"), help="its private key")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--document-tokens-text-chars", type=int, default=8000,
                    help="characters of the document's text (default 8000)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true", help="generate max-new-tokens every time")
    ap.add_argument("--wait-ms", type=int, default=1000, help="long-poll wait (default 1000)")
    ap.add_argument("--timeout", type=float, default=30.0, help="socket timeout of a call, seconds")
    ap.add_argument("--grace-seconds", type=float, default=30.0,
                    help="requests still running this long after --seconds are cancelled")
    ap.add_argument("--json", help="append the JSON line to this file")
    ap.add_argument("--start", metavar="MODEL_DIR", help="start a local worker + coordinator serving MODEL_DIR")
    ap.add_argument("--build", default=os.path.join(REPO, "build"), help="with --start: the build directory")
    ap.add_argument("--device", default="cpu", help="with --start: the worker's --device")
    ap.add_argument("--tls", action="store_true", help="with --start: TLS on, with certificates made for the run")
    ap.add_argument("--keep-document", action="store_true")
    args = ap.parse_args()

    if args.clients < 1 or args.seconds <= 0:
        ap.error("--clients must be >= 1 and --seconds > 0")
    if args.tls and not args.start:
        ap.error("--tls goes with --start (a running service's CA: --tls-ca)")
    try:
        args.api_key = pc.api_key_from_args(args)
        if args.tls_ca or args.tls_cert or args.tls_key:  # a bad TLS file is named here, before any thread starts
            if not args.tls_ca:
                raise ValueError("--tls-cert/--tls-key need --tls-ca (the CA of the coordinator's certificate)")
            pc.tls_context(args.tls_ca, args.tls_cert, args.tls_key)
    except ValueError as e:
        ap.error(str(e))
    svc = None
    if args.start:
        penumbra_local.install_sigterm_exit()
        if not args.api_key:
            args.api_key = "loadtest-" + secrets.token_hex(16)  # made for the run, never shown
        svc = penumbra_local.LocalService(args.build, args.start, api_keys={args.api_key: "loadtest"},
                                          device=args.device, worker_args=["--drain-seconds", "5"],
                                          coordinator_args=["--drain-seconds", "5"], tls=args.tls)
        t = time.monotonic()
        try:
            svc.start()
        except penumbra_local.ProcessError as e:
            print("loadtest: could not start the service: %s" % e, file=sys.stderr)
            return 1
        args.host, args.port = "127.0.0.1", svc.port
        if args.tls:
            args.tls_ca, args.tls_cert, args.tls_key = os.path.join(svc.certs_dir, "ca.pem"), None, None
        print("started worker :%d and coordinator :%d (%s) in %.1f s (logs in %s)" %
              (svc.worker.port, svc.port, "TLS" if args.tls else "plaintext", time.monotonic() - t, svc.workdir),
              file=sys.stderr)
    elif not args.port:
        ap.error("--port is required (or --start MODEL_DIR)")

    rc = 1
    try:
        rc = run(pc, penumbra_local, args)
        return rc
    finally:
        if svc is not None:
            codes = svc.stop(remove_workdir=(rc == 0))
            print("stopped the service: exit statuses %s%s" %
                  (codes, "" if rc == 0 else "; logs in " + svc.workdir), file=sys.stderr)


def run(pc, penumbra_local, args):
    setup = pc.PenumbraClient(args.host, args.port, api_key=args.api_key, timeout_s=args.timeout, tls_ca=args.tls_ca,
                              tls_cert=args.tls_cert, tls_key=args.tls_key)
    try:
        text = penumbra_local.story_text(args.document_tokens_text_chars, seed=11)
        t = time.monotonic()
        doc = setup.put_document("loadtest-%d" % os.getpid(), text=text, wait=True)
        if pc.state_name(doc.state) != "READY":
            print("loadtest: document %s is %s: %s" % (doc.id, pc.state_name(doc.state), doc.error), file=sys.stderr)
            return 1
        print("document %s: %d chars, %d tokens, ready in %.2f s" %
              (doc.id, len(text), doc.tokens, time.monotonic() - t), file=sys.stderr)

        results = Results()
        counter = iter(range(1 << 62))
        start = time.monotonic()
        stop_at = start + args.seconds
        hard_stop_at = stop_at + args.grace_seconds
        threads = [threading.Thread(target=client_loop, name="client-%d" % k, daemon=True,
                                    args=(pc, args, doc.id, k, stop_at, hard_stop_at, results, counter))
                   for k in range(args.clients)]
        for th in threads:
            th.start()
        for th in threads:
            # A thread ends at most a call's timeout after the hard stop.
            th.join(max(0.0, hard_stop_at + 2 * args.timeout + args.wait_ms / 1000.0 - time.monotonic()))
        elapsed = time.monotonic() - start
        stuck = sum(th.is_alive() for th in threads)

        r = results
        rec = collections.OrderedDict()
        rec["bench"] = "service-load"
        rec["clients"] = args.clients
        rec["tls"] = bool(args.tls_ca)
        rec["seconds"] = args.seconds
        rec["elapsed_s"] = round(elapsed, 3)
        rec["requests"] = r.requests
        rec["requests_per_s"] = round(r.requests / elapsed, 4)
        for name, values in (("ttft", r.ttft), ("token_latency", r.token_latency)):
            for q in (50, 99):
                v = percentile(values, q)
                rec["%s_p%d_s" % (name, q)] = round(v, 6) if v is not None else None
        rec["generated_tokens"] = r.generated_tokens
        rec["tokens_per_s"] = round(r.generated_tokens / elapsed, 3)
        rec["errors"] = sum(r.errors.values())
        rec["errors_by_code"] = dict(r.errors)
        rec["finish_reasons"] = dict(r.finish)
        rec["document_tokens"] = doc.tokens
        rec["max_new_tokens"] = args.max_new_tokens
        rec["stuck_clients"] = stuck
        rec["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

        def fmt(v):
            return "-" if v is None else "%.4f" % v
        print("clients %d, %.1f s: %d requests (%.2f/s), %d tokens generated (%.1f/s)" %
              (args.clients, elapsed, r.requests, rec["requests_per_s"], r.generated_tokens, rec["tokens_per_s"]))
        print("ttft p50 %s s, p99 %s s; per-token latency p50 %s s, p99 %s s" %
              (fmt(rec["ttft_p50_s"]), fmt(rec["ttft_p99_s"]), fmt(rec["token_latency_p50_s"]),
               fmt(rec["token_latency_p99_s"])))
        print("errors: %s; finish reasons: %s" % (dict(r.errors) or "none", dict(r.finish)))
        line = json.dumps(rec)
        print(line)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")
        if not args.keep_document:
            try:
                setup.delete_document(doc.id)
            except pc.PenumbraClientError as e:
                print("loadtest: deleting the document: %s" % e, file=sys.stderr)
        return 0 if stuck == 0 else 1
    except pc.PenumbraClientError as e:
        print("loadtest: %s" % e, file=sys.stderr)
        return 1
    finally:
        setup.close()


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Fairness run: two tenants, one flooding; the other's time to first token.

    /usr/bin/python3 ops/fairness.py --start MODEL_DIR [--build BUILD_DIR] [--tls] [--seconds T] \\
        [--steady-clients S] [--flood-clients F] [--flood-max-sequences N] [--max-batch B] [--json OUT]

Writes a temporary tenants.yaml with two tenants, `flood` and `steady` (fresh
random API keys, their sha256 hashes in the file; equal weights unless
--flood-weight / --steady-weight; --flood-max-sequences N sets flood's
max_concurrent_sequences quota), starts a worker (--max-batch B, default 8)
and a coordinator (--tenants FILE) on loopback
(coordinator/client/python/penumbra_local.py; with --tls on certificates made
for the run by `penumbra cert init`, every client checking its CA; the keys
never leave this process), and puts one document per
tenant (simple-story text, different per tenant). One unmeasured request per
tenant warms the service up; then:

  phase 1 (unloaded): S `steady` clients loop for T seconds, each generating
    an answer about steady's document and streaming it to the end; the time
    to first token (TTFT) of each request is recorded.
  phase 2 (loaded): F `flood` clients loop the same way on flood's document
    (--flood-max-new-tokens each); after --warmup-seconds (default 2) S
    `steady` clients run as in phase 1 for T seconds; then everything stops.
    Requests still running then are cancelled after --grace-seconds.

The clients are ops/loadtest.py's (client_loop): an error is counted by its
code, and a refused request (RESOURCE_EXHAUSTED, flood's quota) is retried
after its retry_after_ms. `steady` must have no errors (exit status 1
otherwise). Prints a summary and one JSON line (also appended to OUT with
--json):

  {"bench": "service-fairness", "date", "model", "device", "max_batch",
   "flood_clients", "flood_max_sequences",
   "steady_unloaded": {"requests", "ttft_p50_s", "ttft_p99_s", ...},
   "steady_loaded": {...}, "flood": {"requests", "tokens_per_s", "errors_by_code", ...},
   "ttft_p99_ratio": steady_loaded.ttft_p99_s / steady_unloaded.ttft_p99_s, "command", ...}
"""

import argparse
import collections
import datetime
import hashlib
import itertools
import json
import os
import re
import secrets
import shlex
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import loadtest  # noqa: E402  (also puts coordinator/client/python on sys.path)
import penumbra_local  # noqa: E402  (stdlib only; penumbra_client is imported in main, after PENUMBRA_GEN_PY)

MIN_API_KEY_BYTES = 16  # coordinator/tenants/tenants.h kMinApiKeyBytes
_TENANT_NAME = re.compile(r"^[a-z0-9_-]{1,64}$")


# --------------------------------------------------------------------------- tenants.yaml

def hash_api_key(key):
    """The tenants.yaml form of an API key, "sha256:<64 hex>" (`penumbra tenant hash-key`)."""
    data = key.encode("utf-8")
    if len(data) < MIN_API_KEY_BYTES:
        raise ValueError("an API key must be at least %d bytes" % MIN_API_KEY_BYTES)
    return "sha256:" + hashlib.sha256(data).hexdigest()


def new_api_key(tenant):
    """A fresh random key for tenant (its name, then 32 hex digits)."""
    return "%s-%s" % (tenant, secrets.token_hex(16))


def tenants_yaml(tenants):
    """The text of a tenants.yaml (configs/tenants.yaml's format) for tenants:
    a list of dicts {"name", "api_keys": [plaintext keys], "weight" (default 1),
    "max_concurrent_sequences" (absent or None: unlimited)}. Only the keys'
    hashes are written. ValueError for what the coordinator would refuse."""
    lines = ["# Written by ops/fairness.py (keys are random and used once).", "tenants:"]
    names = set()
    for i, t in enumerate(tenants):
        name = t["name"]
        if not _TENANT_NAME.match(name) or name in names:
            raise ValueError("tenants[%d].name: 1-64 of [a-z0-9_-], unique: got %r" % (i, name))
        names.add(name)
        keys = list(t.get("api_keys") or ())
        if not keys:
            raise ValueError("tenants[%d].api_keys: at least one key" % i)
        weight = float(t.get("weight", 1.0))
        if not (0 < weight <= 1e6):
            raise ValueError("tenants[%d].weight: must be > 0 and <= 1e6, got %r" % (i, weight))
        lines.append("  - name: %s" % name)
        lines.append("    api_keys:")
        lines.extend("      - %s" % hash_api_key(k) for k in keys)
        seqs = t.get("max_concurrent_sequences")
        if seqs is not None:
            if int(seqs) != seqs or seqs < 1:
                raise ValueError("tenants[%d].quotas.max_concurrent_sequences: must be >= 1, got %r" % (i, seqs))
            lines.append("    quotas:")
            lines.append("      max_concurrent_sequences: %d" % seqs)
        lines.append("    weight: %r" % weight)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- summaries

def _round(v, digits=6):
    return None if v is None else round(v, digits)


def phase_summary(results, elapsed):
    """A loadtest.Results as a JSON-able dict."""
    r = results
    return collections.OrderedDict([
        ("requests", r.requests),
        ("ttft_p50_s", _round(loadtest.percentile(r.ttft, 50))),
        ("ttft_p99_s", _round(loadtest.percentile(r.ttft, 99))),
        ("token_latency_p50_s", _round(loadtest.percentile(r.token_latency, 50))),
        ("token_latency_p99_s", _round(loadtest.percentile(r.token_latency, 99))),
        ("generated_tokens", r.generated_tokens),
        ("tokens_per_s", round(r.generated_tokens / elapsed, 3) if elapsed > 0 else None),
        ("elapsed_s", round(elapsed, 3)),
        ("errors", sum(r.errors.values())),
        ("errors_by_code", dict(r.errors)),
        ("finish_reasons", dict(r.finish)),
    ])


def ttft_ratio(loaded, unloaded):
    """loaded / unloaded (either a number or None), rounded; None when either is missing or unloaded is 0."""
    if loaded is None or not unloaded:
        return None
    return round(loaded / unloaded, 3)


# --------------------------------------------------------------------------- the run

class Group(object):
    """n client threads of one tenant (loadtest.client_loop) adding to one Results."""

    def __init__(self, pc, name, cargs, doc_id, n, stop_at, hard_stop_at):
        self.name = name
        self.results = loadtest.Results()
        self.cargs = cargs
        self.hard_stop_at = hard_stop_at
        counter = itertools.count()
        self.threads = [threading.Thread(target=loadtest.client_loop, name="%s-%d" % (name, k), daemon=True,
                                         args=(pc, cargs, doc_id, k, stop_at, hard_stop_at, self.results, counter))
                        for k in range(n)]
        self.started = None
        self.elapsed = None

    def start(self):
        self.started = time.monotonic()
        for th in self.threads:
            th.start()
        return self

    def join(self):
        """Waits (bounded: a thread ends at most a call's timeout after the hard stop); returns the stuck count."""
        limit = self.hard_stop_at + 2 * self.cargs.timeout + self.cargs.wait_ms / 1000.0
        for th in self.threads:
            th.join(max(0.0, limit - time.monotonic()))
        self.elapsed = time.monotonic() - self.started
        return sum(th.is_alive() for th in self.threads)


def client_args(args, api_key, max_new_tokens):
    """The namespace loadtest.client_loop reads."""
    return argparse.Namespace(host=args.host, port=args.port, api_key=api_key, tls_ca=args.tls_ca, tls_cert=None,
                              tls_key=None, timeout=args.timeout,
                              max_new_tokens=max_new_tokens, temperature=args.temperature,
                              ignore_eos=args.ignore_eos, wait_ms=args.wait_ms)


def put_document(pc, cargs, name, seed, chars):
    client = pc.PenumbraClient(cargs.host, cargs.port, api_key=cargs.api_key, timeout_s=cargs.timeout,
                               tls_ca=cargs.tls_ca)
    try:
        text = penumbra_local.story_text(chars, seed=seed)
        t = time.monotonic()
        doc = client.put_document(name, text=text, wait=True)
        if pc.state_name(doc.state) != "READY":
            raise RuntimeError("document %s is %s: %s" % (doc.id, pc.state_name(doc.state), doc.error))
        print("document %s: %d chars, %d tokens, ready in %.2f s" %
              (doc.id, len(text), doc.tokens, time.monotonic() - t), file=sys.stderr)
        # One unmeasured request: the first one after start-up pays one-time costs.
        client.ask([doc.id], text=loadtest.question(0), max_new_tokens=cargs.max_new_tokens,
                   temperature=cargs.temperature, ignore_eos=cargs.ignore_eos)
        return doc
    finally:
        client.close()


def run(pc, args, keys):
    steady = client_args(args, keys["steady"], args.max_new_tokens)
    flood = client_args(args, keys["flood"], args.flood_max_new_tokens)
    tag = "fairness-%d" % os.getpid()
    steady_doc = put_document(pc, steady, tag + "-steady", 11, args.document_tokens_text_chars)
    flood_doc = put_document(pc, flood, tag + "-flood", 12, args.document_tokens_text_chars)

    # Phase 1: steady alone.
    t = time.monotonic()
    p1 = Group(pc, "steady", steady, steady_doc.id, args.steady_clients, t + args.seconds,
               t + args.seconds + args.grace_seconds).start()
    stuck = p1.join()
    print("phase 1 (unloaded): %d steady requests in %.1f s" % (p1.results.requests, p1.elapsed), file=sys.stderr)

    # Phase 2: flood first, steady after the warm-up; both stop together.
    t = time.monotonic()
    stop_at = t + args.warmup_seconds + args.seconds
    fl = Group(pc, "flood", flood, flood_doc.id, args.flood_clients, stop_at, stop_at + args.grace_seconds).start()
    time.sleep(max(0.0, t + args.warmup_seconds - time.monotonic()))
    p2 = Group(pc, "steady", steady, steady_doc.id, args.steady_clients, stop_at,
               stop_at + args.grace_seconds).start()
    stuck += p2.join()
    stuck += fl.join()
    print("phase 2 (loaded): %d steady requests in %.1f s, %d flood requests in %.1f s" %
          (p2.results.requests, p2.elapsed, fl.results.requests, fl.elapsed), file=sys.stderr)
    return p1, p2, fl, stuck, steady_doc


def report(args, p1, p2, fl, stuck, doc):
    rec = collections.OrderedDict()
    rec["bench"] = "service-fairness"
    rec["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rec["model"] = os.path.basename(os.path.normpath(args.start))
    rec["device"] = args.device
    rec["max_batch"] = args.max_batch
    rec["tls"] = bool(args.tls)
    rec["share_window_ms"] = args.share_window_ms
    rec["seconds"] = args.seconds
    rec["steady_clients"] = args.steady_clients
    rec["flood_clients"] = args.flood_clients
    rec["flood_max_sequences"] = args.flood_max_sequences
    rec["weights"] = {"flood": args.flood_weight, "steady": args.steady_weight}
    rec["max_new_tokens"] = args.max_new_tokens
    rec["flood_max_new_tokens"] = args.flood_max_new_tokens
    rec["document_tokens"] = doc.tokens
    rec["steady_unloaded"] = phase_summary(p1.results, p1.elapsed)
    rec["steady_loaded"] = phase_summary(p2.results, p2.elapsed)
    rec["flood"] = phase_summary(fl.results, fl.elapsed)
    rec["ttft_p99_ratio"] = ttft_ratio(rec["steady_loaded"]["ttft_p99_s"], rec["steady_unloaded"]["ttft_p99_s"])
    rec["ttft_p50_ratio"] = ttft_ratio(rec["steady_loaded"]["ttft_p50_s"], rec["steady_unloaded"]["ttft_p50_s"])
    rec["stuck_clients"] = stuck
    rec["command"] = "python3 " + " ".join(shlex.quote(a) for a in sys.argv)

    def fmt(v):
        return "-" if v is None else "%.4f" % v
    for name in ("steady_unloaded", "steady_loaded"):
        s = rec[name]
        print("%-15s %4d requests, TTFT p50 %s s, p99 %s s; errors %s" %
              (name, s["requests"], fmt(s["ttft_p50_s"]), fmt(s["ttft_p99_s"]), s["errors_by_code"] or "none"))
    f = rec["flood"]
    print("%-15s %4d requests, %.1f tokens/s, TTFT p50 %s s, p99 %s s; errors %s" %
          ("flood", f["requests"], f["tokens_per_s"] or 0, fmt(f["ttft_p50_s"]), fmt(f["ttft_p99_s"]),
           f["errors_by_code"] or "none"))
    print("steady TTFT p99 loaded/unloaded: %s (p50: %s)" %
          ("-" if rec["ttft_p99_ratio"] is None else "%.2fx" % rec["ttft_p99_ratio"],
           "-" if rec["ttft_p50_ratio"] is None else "%.2fx" % rec["ttft_p50_ratio"]))
    line = json.dumps(rec)
    print(line)
    if args.json:
        with open(args.json, "a") as out:
            out.write(line + "\n")
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--start", metavar="MODEL_DIR", required=True,
                    help="start a local worker + coordinator serving MODEL_DIR")
    ap.add_argument("--build", default=os.path.join(REPO, "build"), help="the build directory (bin/, transport/)")
    ap.add_argument("--device", default="cpu", help="the worker's --device (default cpu)")
    ap.add_argument("--tls", action="store_true", help="TLS on, with certificates made for the run")
    ap.add_argument("--max-batch", type=int, default=8, help="the worker's --max-batch (default 8)")
    ap.add_argument("--share-window-ms", type=int, default=None,
                    help="the worker's --share-window-ms (default: the worker's; 0 turns the batch caps off)")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each steady phase (default 20)")
    ap.add_argument("--warmup-seconds", type=float, default=2.0,
                    help="phase 2: flood runs this long before steady starts (default 2)")
    ap.add_argument("--steady-clients", type=int, default=1)
    ap.add_argument("--flood-clients", type=int, default=16)
    ap.add_argument("--flood-max-sequences", type=int, default=None,
                    help="flood's max_concurrent_sequences quota (default: unlimited)")
    ap.add_argument("--flood-weight", type=float, default=1.0)
    ap.add_argument("--steady-weight", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=64, help="steady's answers (default 64)")
    ap.add_argument("--flood-max-new-tokens", type=int, default=64, help="flood's answers (default 64)")
    ap.add_argument("--document-tokens-text-chars", type=int, default=8000,
                    help="characters of each tenant's document (default 8000)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true", help="generate max-new-tokens every time")
    ap.add_argument("--wait-ms", type=int, default=1000, help="long-poll wait (default 1000)")
    ap.add_argument("--timeout", type=float, default=30.0, help="socket timeout of a call, seconds")
    ap.add_argument("--grace-seconds", type=float, default=30.0,
                    help="requests still running this long after a phase's end are cancelled")
    ap.add_argument("--json", help="append the JSON line to this file")
    ap.add_argument("--keep-logs", action="store_true", help="keep the service's work directory")
    args = ap.parse_args()
    if args.steady_clients < 1 or args.flood_clients < 1 or args.seconds <= 0 or args.max_batch < 1:
        ap.error("--steady-clients, --flood-clients and --max-batch must be >= 1 and --seconds > 0")
    if args.flood_max_sequences is not None and args.flood_max_sequences < 1:
        ap.error("--flood-max-sequences must be >= 1")

    if not os.environ.get("PENUMBRA_GEN_PY"):
        os.environ["PENUMBRA_GEN_PY"] = os.path.join(os.path.abspath(args.build), "transport", "gen-py")
    import penumbra_client as pc

    keys = {"flood": new_api_key("flood"), "steady": new_api_key("steady")}
    try:
        text = tenants_yaml([
            {"name": "flood", "api_keys": [keys["flood"]], "weight": args.flood_weight,
             "max_concurrent_sequences": args.flood_max_sequences},
            {"name": "steady", "api_keys": [keys["steady"]], "weight": args.steady_weight},
        ])
    except ValueError as e:
        ap.error(str(e))
    workdir = tempfile.mkdtemp(prefix="penumbra-fairness-")
    tenants_path = os.path.join(workdir, "tenants.yaml")
    with open(tenants_path, "w") as f:
        f.write(text)

    penumbra_local.install_sigterm_exit()
    svc = penumbra_local.LocalService(args.build, args.start, device=args.device, workdir=workdir,
                                      tenants=tenants_path,
                                      worker_args=["--max-batch", str(args.max_batch), "--drain-seconds", "5"] +
                                      ([] if args.share_window_ms is None
                                       else ["--share-window-ms", str(args.share_window_ms)]),
                                      coordinator_args=["--drain-seconds", "5"], tls=args.tls)
    rc = 1
    try:
        t = time.monotonic()
        try:
            svc.start()
        except penumbra_local.ProcessError as e:
            print("fairness: could not start the service: %s" % e, file=sys.stderr)
            return 1
        args.host, args.port = "127.0.0.1", svc.port
        args.tls_ca = os.path.join(svc.certs_dir, "ca.pem") if args.tls else None
        print("started worker :%d (--max-batch %d) and coordinator :%d in %.1f s (logs in %s)" %
              (svc.worker.port, args.max_batch, svc.port, time.monotonic() - t, workdir), file=sys.stderr)
        try:
            p1, p2, fl, stuck, doc = run(pc, args, keys)
        except (pc.PenumbraClientError, RuntimeError) as e:
            print("fairness: %s" % e, file=sys.stderr)
            return 1
        rec = report(args, p1, p2, fl, stuck, doc)
        steady_errors = rec["steady_unloaded"]["errors"] + rec["steady_loaded"]["errors"]
        if steady_errors:
            print("fairness: steady had %d errors (must be 0)" % steady_errors, file=sys.stderr)
        if stuck:
            print("fairness: %d clients did not stop" % stuck, file=sys.stderr)
        rc = 0 if steady_errors == 0 and stuck == 0 else 1
        return rc
    finally:
        codes = svc.stop(remove_workdir=(rc == 0 and not args.keep_logs))
        print("stopped the service: exit statuses %s%s" %
              (codes, "" if rc == 0 and not args.keep_logs else "; logs in " + workdir), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

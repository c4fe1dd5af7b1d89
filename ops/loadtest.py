#!/usr/bin/python3
"""Load test of a Penumbra coordinator through its Thrift API (the Python
client), its OpenAI-compatible HTTP API (docs/openai.md), or both in turn.

    /usr/bin/python3 ops/loadtest.py --host H --port P [--api-key-file F] [--tls-ca CA] --clients N --seconds T \\
        [--api thrift|openai|both] [--openai-url URL] [--document-tokens-text-chars C] [--max-new-tokens M] \\
        [--require-no-errors] [--json OUT]
    /usr/bin/python3 ops/loadtest.py --start MODEL_DIR [--build BUILD_DIR] [--tls] [--api thrift|openai|both] \\
        --clients N --seconds T ...

The API key: --api-key-file, else $PENUMBRA_API_KEY_FILE, else
$PENUMBRA_API_KEY (never on the command line: --api-key is refused); TLS:
--tls-ca (default $PENUMBRA_TLS_CA), a client certificate with --tls-cert and
--tls-key (defaults $PENUMBRA_TLS_CERT/_KEY). The same key and TLS files
serve both APIs.

Puts one document (C characters of simple-story text; with --token-ids
VOCAB, for a model without a tokenizer such as configs/bench/llama-3.1-8b
with random weights, --document-tokens random ids, and each question
--question-tokens) through the Thrift API, then N threads (one client and one connection each) loop for T seconds
generating an answer about the document to a question varied per request
(greedy unless --temperature, seed = the request's number), streamed to its
end. Requests still running at T finish (they are cancelled after
--grace-seconds more). Errors are counted by code.

--api thrift (the default): PenumbraClient.generate, then streaming (long
  polling). TTFT: generate call -> first chunk with tokens; per-token
  latency: the time between token arrivals / tokens in the chunk.
--api openai: POST /v1/completions with "documents": [the document],
  "stream": true and "stream_options": {"include_usage": true} (the model:
  the first id of GET /v1/models), reading the server-sent events; one
  persistent HTTP(S) connection per client, opened again after a failure.
  With "return_token_ids": true (our extension), each chunk carries the
  ids that came since the last, so the measures are the Thrift ones: TTFT:
  request sent -> first chunk with tokens; per-token latency: the time
  between chunks / tokens in the chunk; generated tokens: the usage chunk's
  completion_tokens. An error (HTTP status, or an `error` event in the stream) is counted
  by its error.code, else error.type; a failed connection by its exception's
  name. 429 waits its retry-after-ms (Retry-After) as the Thrift client waits
  RESOURCE_EXHAUSTED's retry_after_ms, 503 waits 0.5 s; a stream still
  running at the hard stop has its connection closed (the server cancels the
  generation), counted as finish reason and error "cancelled" (the Thrift
  client's: "cancelled" and CANCELLED).
--api both: on the same service and document, phases of T seconds with the
  same clients alternate thrift, openai, thrift, openai.

The HTTP API's base URL: --openai-url (e.g. https://127.0.0.1:8000; a
trailing /v1 is allowed), needed with --api openai|both unless --start. An
https URL is checked against --tls-ca when given (the system's CAs
otherwise).

Prints a summary and one JSON line per phase (also appended to OUT with
--json):

  {"bench": "service-load", "api": "thrift" or "openai", "clients", "tls", "seconds",
   "requests", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "token_latency_p50_s", "token_latency_p99_s",
   "generated_tokens", "tokens_per_s", "errors", "errors_by_code", "finish_reasons", "stuck_clients", "date", ...}

and, with --api both, one comparison line after the four:

  {"bench": "service-load-http-vs-thrift", "clients", "seconds", "phases": 4,
   "thrift_tokens_per_s", "openai_tokens_per_s" (each the mean of its two phases),
   "tokens_per_s_ratio" (openai / thrift), "thrift_ttft_p50_s", "openai_ttft_p50_s", "thrift_ttft_p99_s",
   "openai_ttft_p99_s" (over the pooled samples of an API's two phases), "ttft_p99_ratio" (openai / thrift),
   "thrift_requests", "openai_requests", "errors", "stuck_clients", "date", ...}

The exit status is 1 when a client got stuck (still running well past the
hard stop), and, with --api both, when an API completed no request; with
--require-no-errors also when a phase counted an error or completed no
request.

--start MODEL_DIR starts a worker (--device cpu unless --device) and a
coordinator from BUILD_DIR/bin on loopback (coordinator/client/python/
penumbra_local.py; with --api openai|both, the coordinator's --openai-port
0, the URL http(s)://127.0.0.1:PORT from its port file), with a random API
key made for the run (unless one is given) and, with --tls, certificates made
for the run (`penumbra cert init`), and stops them at the end.
"""

import argparse
import collections
import datetime
import http.client
import json
import os
import secrets
import ssl
import sys
import threading
import time
import urllib.parse

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "coordinator", "client", "python"))

APIS = {"thrift": ["thrift"], "openai": ["openai"], "both": ["thrift", "openai", "thrift", "openai"]}


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


def random_ids(n, vocab, seed):
    """n token ids in [1, vocab), the same for the same seed (a model without a tokenizer)."""
    import random
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def prompt_of(args, i):
    """Request i's question: its text, or with --token-ids its --question-tokens ids."""
    if args.token_ids:
        return {"token_ids": random_ids(args.question_tokens, args.token_ids, 1000003 + i)}
    return {"text": question(i)}


class Results(object):
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = 0
        self.ttft = []
        self.token_latency = []
        self.generated_tokens = 0
        self.errors = collections.Counter()
        self.finish = collections.Counter()

    def add(self, ttft, lat, gen, finish, err):
        """One request's outcome: counted as a request when it finished without an error."""
        with self.lock:
            if err is not None:
                self.errors[err] += 1
            if finish is not None:
                self.finish[finish] += 1
                if err is None:
                    self.requests += 1
                    self.generated_tokens += gen
                    if ttft is not None:
                        self.ttft.append(ttft)
                    self.token_latency.extend(lat)


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
                rid = client.generate([doc_id], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                      seed=i, ignore_eos=args.ignore_eos, **prompt_of(args, i))
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
            r.add(ttft, lat, gen, finish, err)
    finally:
        client.close()


# --------------------------------------------------------------------------- the OpenAI-compatible API


def parse_openai_url(url):
    """(scheme, host, port, path prefix) of a base URL such as https://127.0.0.1:8000 (a trailing /v1 is
    dropped: the routes add it); ValueError when it is not an http(s) URL with a host."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError("--openai-url %r: expected http(s)://HOST[:PORT]" % url)
    try:
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError as e:
        raise ValueError("--openai-url %r: %s" % (url, e)) from None
    prefix = u.path.rstrip("/")
    if prefix.endswith("/v1"):
        prefix = prefix[:-3]
    return u.scheme, u.hostname, port, prefix


class OpenAIError(Exception):
    """An HTTP status other than 200: code (error.code, else error.type, else HTTP_<status>) and the seconds to
    wait before the next request (429: retry-after-ms or Retry-After; 503: 0.5), or None."""

    def __init__(self, status, code, message, wait_s=None):
        super().__init__("HTTP %d %s: %s" % (status, code, message))
        self.status = status
        self.code = code
        self.wait_s = wait_s


def error_code(obj):
    """error.code, else error.type, of an {"error": {...}} body or event; None when it has no error."""
    e = obj.get("error") if isinstance(obj, dict) else None
    if not e:
        return None
    if isinstance(e, dict):
        return str(e.get("code") or e.get("type") or "error")
    return str(e)


class OpenAIConnection(object):
    """One persistent HTTP(S) connection to the OpenAI-compatible API, opened when needed (again after the
    server closed it or a failure: close() it). A request on a kept-alive connection the server has closed
    meanwhile is sent again once on a new one."""

    def __init__(self, url, api_key, timeout_s, context=None):
        self.scheme, self.host, self.port, self.prefix = parse_openai_url(url)
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.context = context
        self.conn = None
        self.served = 0  # requests sent on the open connection

    def _open(self):
        if self.conn is None:
            if self.scheme == "https":
                self.conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout_s,
                                                        context=self.context)
            else:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        if self.conn.sock is None:  # new, or closed by http.client after a response with Connection: close
            self.conn.connect()
            self.served = 0

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def request(self, method, path, body=None):
        """Sends a request (connecting first, outside the time measured); returns (response, t0), t0 the
        monotonic time just before the request was sent. The response's status is not checked."""
        headers = {"Accept": "application/json, text/event-stream"}
        if self.api_key:
            headers["Authorization"] = "Bearer " + self.api_key
        if body is not None:
            headers["Content-Type"] = "application/json"
        for attempt in (0, 1):
            self._open()
            reused = self.served > 0
            t0 = time.monotonic()
            try:
                self.conn.request(method, self.prefix + path, body=body, headers=headers)
                resp = self.conn.getresponse()
            except (ConnectionError, ssl.SSLEOFError):
                self.close()
                if not reused or attempt:
                    raise
                continue
            self.served += 1
            return resp, t0

    def get_json(self, path):
        """The JSON body of GET path; OpenAIError for a status other than 200."""
        resp, _ = self.request("GET", path)
        data = resp.read()
        if resp.status != 200:
            raise http_error(resp, data)
        return json.loads(data.decode("utf-8"))


def http_error(resp, data):
    """The OpenAIError of a response whose status is not 200 (data: its body, read)."""
    try:
        body = json.loads(data.decode("utf-8"))
    except ValueError:
        body = None
    code = error_code(body) or "HTTP_%d" % resp.status
    message = body["error"].get("message", "") if isinstance(body, dict) and isinstance(body.get("error"), dict) \
        else data[:200].decode("utf-8", "replace")
    wait_s = None
    if resp.status == 429:
        ms = resp.getheader("retry-after-ms")
        s = resp.getheader("Retry-After")
        try:
            wait_s = float(ms) / 1000.0 if ms else float(s) if s else 0.1
        except ValueError:
            wait_s = 0.1
        wait_s = min(5.0, max(0.0, wait_s))
    elif resp.status == 503:
        wait_s = 0.5
    return OpenAIError(resp.status, code, message, wait_s)


def sse_events(resp, hard_stop_at):
    """Yields the data of each server-sent event of resp (comment lines skipped) until `data: [DONE]` (not
    yielded; the rest of the body is read so the connection can serve the next request). Yields None instead
    when the hard stop has passed (the caller closes the connection). ConnectionError when the stream ends
    without [DONE]."""
    data = []
    while True:
        if time.monotonic() > hard_stop_at:
            yield None
            return
        line = resp.readline()
        if not line:
            raise ConnectionError("the stream ended without data: [DONE]")
        line = line.rstrip(b"\r\n")
        if not line:
            if data:
                payload = b"\n".join(data)
                data = []
                if payload == b"[DONE]":
                    resp.read()
                    return
                yield payload
            continue
        if line.startswith(b":"):
            continue
        field, _, value = line.partition(b":")
        if field == b"data":
            data.append(value[1:] if value.startswith(b" ") else value)


def openai_model(args):
    """The first model id of GET /v1/models."""
    conn = OpenAIConnection(args.openai_url, args.api_key, args.timeout, args.openai_context)
    try:
        models = conn.get_json("/v1/models")
    finally:
        conn.close()
    data = models.get("data") if isinstance(models, dict) else None
    if not data or not isinstance(data[0], dict) or not data[0].get("id"):
        raise ValueError("GET /v1/models named no model: %s" % json.dumps(models)[:200])
    return data[0]["id"]


def openai_client_loop(args, model, doc_id, stop_at, hard_stop_at, results, counter):
    """One client of the OpenAI-compatible API: as client_loop, through POST /v1/completions streamed on one
    connection (args.openai_url, openai_context, api_key, timeout, max_new_tokens, temperature, ignore_eos)."""
    r = results
    conn = OpenAIConnection(args.openai_url, args.api_key, args.timeout, args.openai_context)
    try:
        while time.monotonic() < stop_at:
            with r.lock:
                i = next(counter)
            q = prompt_of(args, i)
            body = json.dumps({"model": model, "prompt": q.get("text", q.get("token_ids")), "documents": [doc_id],
                               "max_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": i,
                               "ignore_eos": bool(args.ignore_eos), "stream": True, "return_token_ids": True,
                               "stream_options": {"include_usage": True}}).encode("utf-8")
            ttft, lat, gen, finish, err = None, [], 0, None, None
            wait_s = None
            resp = None
            try:
                resp, t0 = conn.request("POST", "/v1/completions", body)
                if resp.status != 200:
                    e = http_error(resp, resp.read())
                    err, wait_s = e.code, e.wait_s
                else:
                    first_t = last_t = None
                    reason = None
                    for payload in sse_events(resp, hard_stop_at):
                        if payload is None:  # the hard stop: the server cancels a stream whose client went away
                            resp.close()  # (it holds the socket too)
                            conn.close()
                            finish = err = "cancelled"  # as the Thrift client's: finish reason and error
                            break
                        now = time.monotonic()
                        event = json.loads(payload.decode("utf-8"))
                        code = error_code(event)
                        if code is not None:
                            err = code
                            continue
                        choices = event.get("choices") or []
                        if choices:
                            # Tokens as they come (return_token_ids: a chunk per arrival, text or not).
                            n = len(choices[0].get("token_ids") or [])
                            if n:
                                if first_t is None:
                                    first_t = now
                                    ttft = now - t0
                                else:
                                    lat.extend([(now - last_t) / n] * n)
                                last_t = now
                            reason = choices[0].get("finish_reason") or reason
                        usage = event.get("usage")
                        if usage:
                            gen = int(usage.get("completion_tokens") or 0)
                    else:
                        finish = reason or ("error" if err is not None else "unknown")
            except (OSError, http.client.HTTPException, ValueError) as e:
                # A failed connection (refused, reset, timed out, TLS), or a body that is not JSON.
                err = type(e).__name__
                if resp is not None:
                    resp.close()
                conn.close()
                wait_s = 0.5
            r.add(ttft, lat, gen, finish, err)
            if wait_s:
                time.sleep(wait_s)
    finally:
        conn.close()


# --------------------------------------------------------------------------- the run


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


def openai_context(pc, args):
    """The SSL context of an https --openai-url (the CA of --tls-ca, else the system's), None for http."""
    if parse_openai_url(args.openai_url)[0] != "https":
        return None
    if args.tls_ca:
        return pc.tls_context(args.tls_ca, args.tls_cert, args.tls_key)
    return ssl.create_default_context()


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
    ap.add_argument("--api", choices=sorted(APIS), default="thrift",
                    help="the API measured: thrift (default), openai (POST /v1/completions), or both "
                         "(phases thrift, openai, thrift, openai)")
    ap.add_argument("--openai-url", help="the OpenAI-compatible API's base URL (e.g. https://127.0.0.1:8000) of a "
                                         "running service; with --start, the started coordinator's")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0, help="length of a phase (default 20)")
    ap.add_argument("--document-tokens-text-chars", type=int, default=8000,
                    help="characters of the document's text (default 8000)")
    ap.add_argument("--token-ids", type=int, default=0, metavar="VOCAB",
                    help="a model without a tokenizer (random weights): the document and the questions are random "
                         "token ids below VOCAB (--document-tokens, --question-tokens)")
    ap.add_argument("--document-tokens", type=int, default=4096, help="with --token-ids: the document's tokens")
    ap.add_argument("--question-tokens", type=int, default=64, help="with --token-ids: each question's tokens")
    ap.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                    help="with --start: one more argument of penumbra-worker (repeat: --worker-arg=--kv-policy "
                         "--worker-arg=shadowkv)")
    ap.add_argument("--start-timeout", type=float, default=60.0, help="with --start: seconds for each process to serve")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true", help="generate max-new-tokens every time")
    ap.add_argument("--wait-ms", type=int, default=1000, help="long-poll wait (default 1000)")
    ap.add_argument("--timeout", type=float, default=30.0, help="socket timeout of a call, seconds")
    ap.add_argument("--grace-seconds", type=float, default=30.0,
                    help="requests still running this long after --seconds are cancelled")
    ap.add_argument("--require-no-errors", action="store_true",
                    help="exit status 1 when a phase counted an error or completed no request")
    ap.add_argument("--json", help="append the JSON lines to this file")
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
    if args.openai_url and args.start:
        ap.error("--openai-url is a running service's; --start serves the API of the coordinator it starts")
    if args.api != "thrift" and not args.start and not args.openai_url:
        ap.error("--api %s needs --openai-url (or --start MODEL_DIR)" % args.api)
    try:
        args.api_key = pc.api_key_from_args(args)
        if args.tls_ca or args.tls_cert or args.tls_key:  # a bad TLS file is named here, before any thread starts
            if not args.tls_ca:
                raise ValueError("--tls-cert/--tls-key need --tls-ca (the CA of the coordinator's certificate)")
            pc.tls_context(args.tls_ca, args.tls_cert, args.tls_key)
        if args.openai_url:
            parse_openai_url(args.openai_url)
    except ValueError as e:
        ap.error(str(e))
    svc = None
    if args.start:
        penumbra_local.install_sigterm_exit()
        if not args.api_key:
            args.api_key = "loadtest-" + secrets.token_hex(16)  # made for the run, never shown
        coordinator_args = ["--drain-seconds", "5"]
        if args.api != "thrift":
            coordinator_args += ["--openai-port", "0"]
        svc = penumbra_local.LocalService(args.build, args.start, api_keys={args.api_key: "loadtest"},
                                          device=args.device, worker_args=["--drain-seconds", "5"] + args.worker_arg,
                                          coordinator_args=coordinator_args, tls=args.tls,
                                          start_timeout_s=args.start_timeout)
        t = time.monotonic()
        try:
            svc.start()
        except penumbra_local.ProcessError as e:
            print("loadtest: could not start the service: %s" % e, file=sys.stderr)
            return 1
        args.host, args.port = "127.0.0.1", svc.port
        if args.tls:
            args.tls_ca, args.tls_cert, args.tls_key = os.path.join(svc.certs_dir, "ca.pem"), None, None
        openai = ""
        if args.api != "thrift":
            if svc.coordinator.openai_port <= 0:
                print("loadtest: the coordinator's port file names no openai_port", file=sys.stderr)
                svc.stop(remove_workdir=False)
                return 1
            args.openai_url = "%s://127.0.0.1:%d" % ("https" if args.tls else "http", svc.coordinator.openai_port)
            openai = ", OpenAI API :%d" % svc.coordinator.openai_port
        print("started worker :%d and coordinator :%d%s (%s) in %.1f s (logs in %s)" %
              (svc.worker.port, svc.port, openai, "TLS" if args.tls else "plaintext", time.monotonic() - t,
               svc.workdir), file=sys.stderr)
    elif not args.port:
        ap.error("--port is required (or --start MODEL_DIR)")
    args.openai_context = openai_context(pc, args) if args.openai_url else None

    rc = 1
    try:
        rc = run(pc, penumbra_local, args)
        return rc
    finally:
        if svc is not None:
            codes = svc.stop(remove_workdir=(rc == 0))
            print("stopped the service: exit statuses %s%s" %
                  (codes, "" if rc == 0 else "; logs in " + svc.workdir), file=sys.stderr)


def _p(values, q):
    v = percentile(values, q)
    return round(v, 6) if v is not None else None


def _now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def emit(args, rec):
    line = json.dumps(rec)
    print(line)
    if args.json:
        with open(args.json, "a") as f:
            f.write(line + "\n")


def run_phase(pc, args, api, doc, model):
    """One phase of args.seconds: args.clients clients of `api` (thrift or openai). Returns (record, Results)."""
    results = Results()
    counter = iter(range(1 << 62))
    start = time.monotonic()
    stop_at = start + args.seconds
    hard_stop_at = stop_at + args.grace_seconds
    if api == "thrift":
        threads = [threading.Thread(target=client_loop, name="client-%d" % k, daemon=True,
                                    args=(pc, args, doc.id, k, stop_at, hard_stop_at, results, counter))
                   for k in range(args.clients)]
    else:
        threads = [threading.Thread(target=openai_client_loop, name="openai-client-%d" % k, daemon=True,
                                    args=(args, model, doc.id, stop_at, hard_stop_at, results, counter))
                   for k in range(args.clients)]
    for th in threads:
        th.start()
    for th in threads:
        # A thread ends at most a call's timeout after the hard stop.
        th.join(max(0.0, hard_stop_at + 2 * args.timeout + args.wait_ms / 1000.0 - time.monotonic()))
    elapsed = time.monotonic() - start
    stuck = sum(th.is_alive() for th in threads)

    r = results
    with r.lock:  # a stuck client may still add
        rec = collections.OrderedDict()
        rec["bench"] = "service-load"
        rec["api"] = api
        rec["clients"] = args.clients
        rec["tls"] = bool(args.tls_ca) if api == "thrift" else parse_openai_url(args.openai_url)[0] == "https"
        rec["seconds"] = args.seconds
        rec["elapsed_s"] = round(elapsed, 3)
        rec["requests"] = r.requests
        rec["requests_per_s"] = round(r.requests / elapsed, 4)
        for name, values in (("ttft", r.ttft), ("token_latency", r.token_latency)):
            for q in (50, 99):
                rec["%s_p%d_s" % (name, q)] = _p(values, q)
        rec["generated_tokens"] = r.generated_tokens
        rec["tokens_per_s"] = round(r.generated_tokens / elapsed, 3)
        rec["errors"] = sum(r.errors.values())
        rec["errors_by_code"] = dict(r.errors)
        rec["finish_reasons"] = dict(r.finish)
        rec["document_tokens"] = doc.tokens
        rec["max_new_tokens"] = args.max_new_tokens
        rec["stuck_clients"] = stuck
        rec["date"] = _now()

    def fmt(v):
        return "-" if v is None else "%.4f" % v
    tag = "" if args.api == "thrift" else "%s: " % api
    print("%sclients %d, %.1f s: %d requests (%.2f/s), %d tokens generated (%.1f/s)" %
          (tag, args.clients, elapsed, rec["requests"], rec["requests_per_s"], rec["generated_tokens"],
           rec["tokens_per_s"]))
    print("%sttft p50 %s s, p99 %s s; per-token latency p50 %s s, p99 %s s" %
          (tag, fmt(rec["ttft_p50_s"]), fmt(rec["ttft_p99_s"]), fmt(rec["token_latency_p50_s"]),
           fmt(rec["token_latency_p99_s"])))
    print("%serrors: %s; finish reasons: %s" % (tag, rec["errors_by_code"] or "none", rec["finish_reasons"]))
    return rec, r


def comparison(args, phases):
    """The service-load-http-vs-thrift record of the phases [(record, Results)] of --api both."""
    def ratio(a, b):
        return round(a / b, 4) if a is not None and b else None
    rec = collections.OrderedDict()
    rec["bench"] = "service-load-http-vs-thrift"
    rec["clients"] = args.clients
    rec["tls"] = bool(args.tls_ca)
    rec["seconds"] = args.seconds
    rec["phases"] = len(phases)
    pooled = {}
    for api in ("thrift", "openai"):
        mine = [(rec_, r) for rec_, r in phases if rec_["api"] == api]
        rec["%s_tokens_per_s" % api] = round(sum(x["tokens_per_s"] for x, _ in mine) / len(mine), 3)
        pooled[api] = [t for _, r in mine for t in r.ttft]
    rec["tokens_per_s_ratio"] = ratio(rec["openai_tokens_per_s"], rec["thrift_tokens_per_s"])
    for q in (50, 99):
        for api in ("thrift", "openai"):
            rec["%s_ttft_p%d_s" % (api, q)] = _p(pooled[api], q)
    rec["ttft_p50_ratio"] = ratio(rec["openai_ttft_p50_s"], rec["thrift_ttft_p50_s"])
    rec["ttft_p99_ratio"] = ratio(rec["openai_ttft_p99_s"], rec["thrift_ttft_p99_s"])
    for api in ("thrift", "openai"):
        rec["%s_requests" % api] = sum(x["requests"] for x, _ in phases if x["api"] == api)
    rec["errors"] = sum(x["errors"] for x, _ in phases)
    rec["stuck_clients"] = sum(x["stuck_clients"] for x, _ in phases)
    rec["document_tokens"] = phases[0][0]["document_tokens"]
    rec["max_new_tokens"] = args.max_new_tokens
    rec["date"] = _now()
    return rec


def run(pc, penumbra_local, args):
    setup = pc.PenumbraClient(args.host, args.port, api_key=args.api_key, timeout_s=args.timeout, tls_ca=args.tls_ca,
                              tls_cert=args.tls_cert, tls_key=args.tls_key)
    try:
        model = None
        if args.api != "thrift":
            try:
                model = openai_model(args)
            except (OSError, http.client.HTTPException, ValueError, OpenAIError) as e:
                print("loadtest: the OpenAI API at %s: %s: %s" % (args.openai_url, type(e).__name__, e),
                      file=sys.stderr)
                return 1
        t = time.monotonic()
        if args.token_ids:
            text = None
            doc = setup.put_document("loadtest-%d" % os.getpid(),
                                     token_ids=random_ids(args.document_tokens, args.token_ids, 11), wait=True)
        else:
            text = penumbra_local.story_text(args.document_tokens_text_chars, seed=11)
            doc = setup.put_document("loadtest-%d" % os.getpid(), text=text, wait=True)
        if pc.state_name(doc.state) != "READY":
            print("loadtest: document %s is %s: %s" % (doc.id, pc.state_name(doc.state), doc.error), file=sys.stderr)
            return 1
        print("document %s: %s, %d tokens, ready in %.2f s%s" %
              (doc.id, "random ids" if text is None else "%d chars" % len(text), doc.tokens, time.monotonic() - t,
               "" if model is None else "; model " + model), file=sys.stderr)

        phases = []
        for api in APIS[args.api]:
            rec, r = run_phase(pc, args, api, doc, model)
            emit(args, rec)
            phases.append((rec, r))
        failures = []
        stuck = sum(rec["stuck_clients"] for rec, _ in phases)
        if stuck:
            failures.append("%d clients stuck" % stuck)
        if args.api == "both":
            emit(args, comparison(args, phases))
            for api in ("thrift", "openai"):
                if not any(rec["requests"] for rec, _ in phases if rec["api"] == api):
                    failures.append("no %s request completed" % api)
        if args.require_no_errors:
            for k, (rec, _) in enumerate(phases):
                if rec["errors"] or not rec["requests"]:
                    failures.append("phase %d (%s): %d errors %s, %d requests completed" %
                                    (k + 1, rec["api"], rec["errors"], rec["errors_by_code"], rec["requests"]))
        if not args.keep_document:
            try:
                setup.delete_document(doc.id)
            except pc.PenumbraClientError as e:
                print("loadtest: deleting the document: %s" % e, file=sys.stderr)
        for f in failures:
            print("loadtest: FAILED: %s" % f, file=sys.stderr)
        return 1 if failures else 0
    except pc.PenumbraClientError as e:
        print("loadtest: %s" % e, file=sys.stderr)
        return 1
    finally:
        setup.close()


if __name__ == "__main__":
    sys.exit(main())

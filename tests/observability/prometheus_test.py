#!/usr/bin/python3
"""A real Prometheus (Debian's `prometheus`) scrapes the coordinator's and the
worker's /metrics on loopback; the checks go through its HTTP API.

Run by tests/openai/with_service.py, which starts the service (TLS, tenants
alpha, beta and tight) and names it in the environment (PENUMBRA_METRICS,
PENUMBRA_WORKER_METRICS, OPENAI_BASE_URL, the keys and the CA):

    tests/openai/with_service.py -- python3 tests/observability/prometheus_test.py

1. Traffic through the OpenAI API: tenant alpha puts a document and asks
   about it twice (its tokens come from the document cache), beta asks
   once, tight runs into its quota (429).
2. Prometheus starts with a scrape job per process (every second), on a port
   the OS picks (read back from its log), its data in a temporary folder.
3. Through Prometheus's API: both targets up with no scrape error; the key
   series per tenant (requests, prompt, cached and generated tokens, quota
   refusals) equal what the API's answers said; the workers' queue gauges
   and request counters are there.
4. The Grafana dashboard (ops/grafana/penumbra.json): every query runs in
   this Prometheus (Grafana's $__rate_interval as 1m), every series it names
   was scraped, and the per-tenant panels have data.
"""

import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(REPO, "ops", "grafana", "penumbra.json")
MODEL = "penumbra-eval"
STORY = ("Once upon a time there was a little girl named Lily. She liked to play in the park with her dog Max. "
         "One day Max found a red ball under a big tree. Lily and Max played with the ball until the sun went down. ")


def fail(msg):
    sys.stderr.write("prometheus_test: FAIL: %s\n" % msg)
    sys.exit(1)


class Api(object):
    """The OpenAI API of the service under test, as one tenant."""

    def __init__(self, key):
        self.base = os.environ["OPENAI_BASE_URL"]
        self.key = key
        self.ctx = ssl.create_default_context(cafile=os.environ["PENUMBRA_TLS_CA"])

    def post(self, path, body):
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(), method="POST", headers={
            "Authorization": "Bearer " + self.key, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = e.read()
            try:
                return e.code, json.loads(body or b"{}")
            except ValueError:
                return e.code, {"body": body[:500].decode("utf-8", "replace")}


def traffic():
    """Requests per tenant; returns what their answers say: {tenant: {prompt, cached, generated, requests}}."""
    seen = {}

    def count(tenant, answer):
        s = seen.setdefault(tenant, {"prompt": 0, "cached": 0, "generated": 0, "requests": 0})
        u = answer["usage"]
        s["prompt"] += u["prompt_tokens"]
        s["cached"] += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        s["generated"] += u["completion_tokens"]
        s["requests"] += 1

    alpha = Api(os.environ["OPENAI_API_KEY"])
    # The coordinator may not have seen its worker healthy yet (503): retried
    # as a client would, for at most 30 s.
    deadline = time.time() + 30
    while True:
        status, doc = alpha.post("/documents", {"name": "story", "text": STORY, "wait": True})
        if status != 503 or time.time() > deadline:
            break
        time.sleep(0.2)
    if status != 200:
        fail("put a document: %d %s" % (status, doc))
    for question in ("What did Max find?", "Where did Lily play?"):
        status, a = alpha.post("/completions", {"model": MODEL, "documents": [doc["id"]], "prompt": question,
                                                "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        if status != 200:
            fail("alpha's completion: %d %s" % (status, a))
        count("alpha", a)
    if seen["alpha"]["cached"] <= 0:
        fail("alpha's questions about its document had no cached tokens: %s" % seen)
    beta = Api(os.environ["PENUMBRA_KEY_BETA"])
    status, b = beta.post("/completions", {"model": MODEL, "prompt": STORY + "Who is Max?", "max_tokens": 7,
                                           "temperature": 0, "ignore_eos": True})
    if status != 200:
        fail("beta's completion: %d %s" % (status, b))
    count("beta", b)
    # Tenant tight may generate 64 tokens a minute: 48, then 48 more is over.
    tight = Api(os.environ["PENUMBRA_KEY_TIGHT"])
    status, t = tight.post("/completions", {"model": MODEL, "prompt": "Lily", "max_tokens": 48, "temperature": 0,
                                            "ignore_eos": True})
    if status != 200:
        fail("tight's first completion: %d %s" % (status, t))
    count("tight", t)
    status, t2 = tight.post("/completions", {"model": MODEL, "prompt": "Max", "max_tokens": 48, "temperature": 0,
                                             "ignore_eos": True})
    if status != 429:
        fail("tight's second completion was not refused by its quota: %d %s" % (status, t2))
    return seen


def host_port(url):
    u = urllib.parse.urlparse(url)
    return "%s:%d" % (u.hostname, u.port)


def start_prometheus(workdir):
    binary = shutil.which("prometheus")
    if binary is None:
        fail("Debian's prometheus is not installed (ops/setup.sh installs it)")
    config = os.path.join(workdir, "prometheus.yml")
    with open(config, "w") as f:
        f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
                "scrape_configs:\n"
                "  - job_name: penumbra-coordinator\n    static_configs:\n      - targets: ['%s']\n"
                "  - job_name: penumbra-worker\n    static_configs:\n      - targets: ['%s']\n"
                % (host_port(os.environ["PENUMBRA_METRICS"]), host_port(os.environ["PENUMBRA_WORKER_METRICS"])))
    log_path = os.path.join(workdir, "prometheus.log")
    log = open(log_path, "w")
    proc = subprocess.Popen([binary, "--config.file=" + config, "--storage.tsdb.path=" + os.path.join(workdir, "data"),
                             "--web.listen-address=127.0.0.1:0", "--log.level=info"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    # Its log names the port the OS gave it: msg="Listening on" address=127.0.0.1:PORT.
    listening = re.compile(r'msg="Listening on" address=127\.0\.0\.1:(\d+)')
    deadline = time.time() + 30
    while time.time() < deadline:
        if proc.poll() is not None:
            fail("prometheus exited (%d): %s" % (proc.returncode, open(log_path).read()[-2000:]))
        m = listening.search(open(log_path).read())
        if m:
            return proc, "http://127.0.0.1:%s" % m.group(1), log_path
        time.sleep(0.1)
    fail("prometheus did not say where it listens: %s" % open(log_path).read()[-2000:])


class Prometheus(object):
    def __init__(self, base):
        self.base = base

    def get(self, path, **params):
        url = self.base + path + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            fail("%s: %s" % (url, body))
        return body["data"]

    def query(self, expr):
        """An instant query's vector as [(labels, value)]."""
        try:
            data = self.get("/api/v1/query", query=expr)
        except urllib.error.HTTPError as e:
            fail("query %r: HTTP %d %s" % (expr, e.code, e.read()[:500]))
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def value(self, expr):
        r = self.query(expr)
        return r[0][1] if r else None


def wait_for(what, check, timeout_s=30):
    deadline = time.time() + timeout_s
    last = None
    while time.time() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.25)
    fail("%s: not within %d s (last: %r)" % (what, timeout_s, last))


def main():
    seen = traffic()
    workdir = tempfile.mkdtemp(prefix="penumbra-prometheus-")
    proc, base, log_path = start_prometheus(workdir)
    ok = False
    try:
        p = Prometheus(base)
        # Both targets up, scraped without error.
        up = wait_for("both targets up", lambda: len([v for _, v in p.query("up == 1")]) == 2 and p.query("up"))
        jobs = sorted(labels["job"] for labels, _ in up)
        if jobs != ["penumbra-coordinator", "penumbra-worker"]:
            fail("targets: %s" % up)
        # Scraped without error (a scrape of a loaded machine may time out
        # once: the next must succeed).
        deadline = time.time() + 30
        while True:
            bad = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in p.get("/api/v1/targets")["activeTargets"]
                   if t["health"] != "up" or t["lastError"]]
            if not bad:
                break
            if time.time() > deadline:
                fail("targets not scraped without error within 30 s: %s" % bad)
            time.sleep(0.25)

        # The key series per tenant equal what the API's answers said (the
        # traffic ended before the first scrape).
        def per_tenant(metric):
            return {labels.get("tenant"): v for labels, v in p.query("sum by (tenant) (%s)" % metric)}

        want = {
            "penumbra_coordinator_requests_total": {t: s["requests"] for t, s in seen.items()},
            "penumbra_coordinator_prompt_tokens_total": {t: s["prompt"] for t, s in seen.items()},
            "penumbra_coordinator_cached_prompt_tokens_total": {t: s["cached"] for t, s in seen.items()},
            "penumbra_coordinator_generated_tokens_total": {t: s["generated"] for t, s in seen.items()},
        }
        for metric, by_tenant in want.items():
            got = wait_for(metric + " scraped", lambda m=metric: per_tenant(m) or None)
            for tenant, n in by_tenant.items():
                if got.get(tenant, 0.0) != n:
                    fail("%s{tenant=%r}: Prometheus has %s, the answers said %s (all: %s)" %
                         (metric, tenant, got.get(tenant), n, got))
        if per_tenant("penumbra_coordinator_quota_refusals_total").get("tight", 0) < 1:
            fail("no quota refusal of tenant tight: %s" % per_tenant("penumbra_coordinator_quota_refusals_total"))
        reasons = {labels["reason"] for labels, _ in
                   p.query('penumbra_coordinator_requests_total{tenant="alpha"} > 0')}
        if reasons != {"length"}:
            fail("alpha's requests by reason: %s" % reasons)
        # The workers' queue and their counters.
        for gauge in ("penumbra_worker_requests_queued", "penumbra_worker_requests_prefilling",
                      "penumbra_worker_requests_decoding", "penumbra_coordinator_requests_running"):
            if p.value(gauge) != 0.0:
                fail("%s: %s (nothing runs now)" % (gauge, p.query(gauge)))
        finished = p.value("penumbra_worker_requests_finished_total")
        if finished is None or finished < sum(s["requests"] for s in seen.values()):
            fail("penumbra_worker_requests_finished_total: %s" % finished)

        # The dashboard: every query runs here, names only scraped series,
        # and the per-tenant panels have data (rates need two scrapes).
        with open(DASHBOARD) as f:
            dashboard = json.load(f)
        names = set(p.get("/api/v1/label/__name__/values"))
        exprs = [(panel["title"], t["expr"]) for panel in dashboard["panels"] for t in panel.get("targets", [])]
        if len(exprs) < 10:
            fail("the dashboard has %d queries" % len(exprs))
        for title, expr in exprs:
            for name in set(re.findall(r"\bpenumbra_[a-z0-9_]+", expr)):
                if name not in names:
                    fail("panel %r names %s, which no target exports" % (title, name))
            p.query(expr.replace("$__rate_interval", "1m"))
        for title, expr in exprs:
            if "by (tenant" in expr:
                # Only tight was refused by a quota; alpha did everything else.
                # (Rates need two scrapes.)
                tenant = "tight" if "quota_refusals" in expr else "alpha"
                wait_for("panel %r: a series of tenant %s" % (title, tenant),
                         lambda e=expr, t=tenant: t in {labels.get("tenant") for labels, _ in
                                                        p.query(e.replace("$__rate_interval", "1m"))})
        ok = True
        print("prometheus_test: PASS (%d dashboard queries; tenants %s)" % (len(exprs), sorted(seen)))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if not ok:
            sys.stderr.write(open(log_path).read()[-3000:])
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Integration test of the Python client (coordinator/client/python) against a
real penumbra-worker (CPU) and penumbra-coordinator on loopback.

    /usr/bin/python3 tests/service/python_client_test.py [--build BUILD_DIR] [--model MODEL_DIR] [unittest args]

Defaults: <repo>/build and <repo>/models/penumbra-eval. The generated Thrift
code is taken from $PENUMBRA_GEN_PY, else BUILD_DIR/transport/gen-py. Both
processes are started with OS-picked ports, over TLS with certificates made
by `penumbra cert init` (the coordinator with a --data-dir
in the service's work directory, so batch jobs are on) and stopped at the end (SIGTERM,
then SIGKILL after 10 s), also on failure or interruption; the whole run is
bounded (a watchdog stops the servers after WATCHDOG_S seconds).
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import unittest
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLIENT_DIR = os.path.join(REPO, "coordinator", "client", "python")


def _parse_args():
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--model", default=os.path.join(REPO, "models", "penumbra-eval"))
    args, rest = ap.parse_known_args()
    return os.path.abspath(args.build), os.path.abspath(args.model), rest


BUILD_DIR, MODEL_DIR, UNITTEST_ARGV = _parse_args()
if not os.environ.get("PENUMBRA_GEN_PY"):
    os.environ["PENUMBRA_GEN_PY"] = os.path.join(BUILD_DIR, "transport", "gen-py")
sys.path.insert(0, CLIENT_DIR)

import penumbra_client as pc  # noqa: E402
import penumbra_local  # noqa: E402
from penumbra_client import PenumbraClient  # noqa: E402

KEY_A, TENANT_A = "test-key-alpha-0123456789", "tenant-alpha"  # --api-keys keys: 16 bytes or more
KEY_B, TENANT_B = "test-key-beta-0123456789", "tenant-beta"
QUESTION = "\n\nQuestion: What did Ben find in the park?\nAnswer:"
WATCHDOG_S = 170  # the whole test stays under 3 minutes
WAIT_S = 30.0     # bound of each polling loop


def _watchdog(signum, frame):
    # Stopping the servers makes every pending call fail at once.
    sys.stderr.write("python_client_test: watchdog: %d s elapsed; stopping the servers\n" % WATCHDOG_S)
    penumbra_local._stop_all_at_exit()
    raise TimeoutError("test ran longer than %d s" % WATCHDOG_S)


def write_key_file(directory, name, key):
    """A file holding `key`, mode 600 (as an operator keeps one)."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return path


def script_env(**extra):
    """A client script's environment: this one's without the connection
    variables (each case gives its own), plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PENUMBRA_API_KEY", "PENUMBRA_API_KEY_FILE", "PENUMBRA_TLS_CA", "PENUMBRA_TLS_CERT",
                        "PENUMBRA_TLS_KEY", "PENUMBRA_PORT", "PENUMBRA_ADDRESS")}
    env.update(extra)
    return env


class PythonClientTest(unittest.TestCase):
    svc = None

    @classmethod
    def setUpClass(cls):
        cls.svc = penumbra_local.LocalService(
            BUILD_DIR, MODEL_DIR, api_keys={KEY_A: TENANT_A, KEY_B: TENANT_B},
            worker_args=["--drain-seconds", "2"], coordinator_args=["--drain-seconds", "2"],
            start_timeout_s=60.0, data_dir=True, tls=True)  # <workdir>/data: batch jobs on
        cls.svc.start()
        cls.a = cls.svc.client(KEY_A, timeout_s=30.0, long_call_timeout_s=90.0)
        cls.b = cls.svc.client(KEY_B, timeout_s=30.0, long_call_timeout_s=90.0)
        cls.doc_text = penumbra_local.story_text(4000, seed=7)
        cls._doc = None

    @classmethod
    def tearDownClass(cls):
        for c in (getattr(cls, "a", None), getattr(cls, "b", None)):
            if c is not None:
                c.close()
        if cls.svc is not None:
            codes = cls.svc.stop(remove_workdir=False)
            sys.stderr.write("servers stopped: exit statuses %s\n" % codes)

    def doc(self):
        """Tenant A's document (put once)."""
        cls = type(self)
        if cls._doc is None:
            cls._doc = self.a.put_document("story", text=self.doc_text, wait=True)
        return cls._doc

    def other_ca(self):
        """Another deployment's CA and certificates (made once)."""
        other = os.path.join(self.svc.workdir, "other-ca")
        if not os.path.exists(os.path.join(other, "ca.pem")):
            topology = os.path.join(self.svc.workdir, "topology.yaml")
            subprocess.run([os.path.join(BUILD_DIR, "bin", "penumbra"), "cert", "init", other, "--topology",
                            topology], check=True, stdout=subprocess.DEVNULL, timeout=60)
        return other

    def logs(self):
        return "\n" + self.svc.logs(2000)

    def poll_until_done(self, client, request_id, offset=0):
        end = time.monotonic() + WAIT_S
        while True:
            chunk = client.poll(request_id, offset, 1000)
            offset = chunk.offset + len(chunk.ids or [])
            if chunk.done:
                return chunk
            self.assertLess(time.monotonic(), end, "request %s not done after %.0f s" % (request_id, WAIT_S))

    # ------------------------------------------------------------------ cases

    def test_health(self):
        # Public: serving and the model's name, nothing about hosts or paths.
        h = self.a.health()
        self.assertTrue(h.serving, h)
        self.assertFalse(h.workers, h)
        self.assertTrue(h.model, h)
        self.assertNotIn("/", h.model, h)

    def test_put_document(self):
        d = self.doc()
        self.assertEqual(pc.state_name(d.state), "READY", d)
        self.assertGreater(d.tokens, 0, d)
        self.assertLess(d.tokens, len(self.doc_text), d)
        self.assertEqual(d.name, "story")
        self.assertTrue(d.id)
        g = self.a.get_document(d.id)
        self.assertEqual((g.id, g.name, g.tokens, g.state), (d.id, d.name, d.tokens, d.state))

    def test_a_put_may_pin_its_kv_policy(self):
        d = self.a.put_document("pinned", text=penumbra_local.story_text(200, seed=41), kv_policy="full")
        self.assertEqual(pc.state_name(d.state), "READY", d)
        self.assertEqual(d.kv_policy, "full")
        self.assertEqual(self.a.get_document(d.id).kv_policy, "full")
        with self.assertRaises(pc.InvalidArgument):
            self.a.put_document("bad", text="Once upon a time.", kv_policy="sparse")
        self.a.delete_document(d.id)

    def test_ask_twice_reuses_document(self):
        d = self.doc()
        r1 = self.a.ask([d.id], text=QUESTION, max_new_tokens=16)
        r2 = self.a.ask([d.id], text=QUESTION, max_new_tokens=16)
        for r in (r1, r2):
            self.assertTrue(r.done, r)
            self.assertIn(r.finish_reason, ("stop", "length"), r)
            self.assertGreater(r.usage.generated_tokens, 0, r)
            self.assertLessEqual(r.usage.generated_tokens, 16, r)
            self.assertGreater(r.usage.prompt_tokens, d.tokens, r)
            self.assertTrue(r.request_id, r)
        self.assertEqual(r1.text, r2.text)
        self.assertEqual(r1.ids, r2.ids)
        self.assertEqual(r2.usage.cached_prompt_tokens, d.tokens, r2.usage)

    def test_stream_matches_ask(self):
        d = self.doc()
        rid = self.a.generate([d.id], text=QUESTION, max_new_tokens=16)
        self.assertTrue(rid)
        deltas, ids, last = [], [], None
        for delta, chunk in self.a.stream(rid, wait_ms=1000):
            deltas.append(delta)
            ids.extend(chunk.ids or [])
            last = chunk
        self.assertIsNotNone(last)
        self.assertTrue(last.done, last)
        self.assertEqual("".join(deltas), last.text)
        self.assertEqual(len(ids), last.usage.generated_tokens, last)
        full = self.a.ask([d.id], text=QUESTION, max_new_tokens=16)
        self.assertEqual(full.text, last.text)
        self.assertEqual(full.ids, ids)

    def test_stream_reconnects_at_its_offset(self):
        # Polls that fail on the transport (a coordinator restarting) are
        # retried at the same offset: the stream's ids are the uninterrupted
        # ones. With reconnect_s=0 the first failure is raised.
        d = self.doc()
        full = self.a.ask([d.id], text=QUESTION, max_new_tokens=16)
        rid = self.a.generate([d.id], text=QUESTION, max_new_tokens=16)
        real_poll = self.a.poll
        offsets, failures = [], [0]

        def flaky_poll(request_id, offset=0, wait_ms=1000):
            offsets.append(offset)
            if failures[0] < 3 and len(offsets) % 2 == 0:
                failures[0] += 1
                raise pc.Unavailable("UNAVAILABLE", "poll to the coordinator failed: connection reset")
            return real_poll(request_id, offset, wait_ms)

        self.a.poll = flaky_poll
        try:
            ids = []
            for _, chunk in self.a.stream(rid, wait_ms=200, reconnect_s=10):
                ids.extend(chunk.ids or [])
            self.assertEqual(ids, full.ids)
            self.assertGreater(failures[0], 0)
            rid2 = self.a.generate([d.id], text=QUESTION, max_new_tokens=16)
            failures[0], offsets[:] = 0, [None]  # the next poll fails
            with self.assertRaises(pc.Unavailable):
                for _ in self.a.stream(rid2, wait_ms=200, reconnect_s=0):
                    pass
        finally:
            del self.a.poll

    def test_stream_with_stop_string(self):
        # A stop string that spans two tokens: its first token's text must not
        # be streamed and then taken back (the streamed text only grows).
        d = self.doc()
        full = self.a.ask([d.id], text=QUESTION, max_new_tokens=24, ignore_eos=True)
        stop = None
        for k in range(2, 20):
            head = self.a.ask([d.id], text=QUESTION, max_new_tokens=k, ignore_eos=True).text
            nxt = self.a.ask([d.id], text=QUESTION, max_new_tokens=k + 1, ignore_eos=True).text
            if head and len(nxt) > len(head) and nxt.startswith(head) and full.text.startswith(nxt):
                cand = head[-1] + nxt[len(head)]
                if full.text.find(cand) == len(head) - 1:
                    stop = cand
                    break
        if stop is None:
            self.skipTest("no stop string spanning two tokens in %r" % full.text)
        expected = full.text[:len(head) - 1]
        rid = self.a.generate([d.id], text=QUESTION, max_new_tokens=24, ignore_eos=True, stop=[stop])
        texts, deltas, last = [], [], None
        for delta, chunk in self.a.stream(rid, wait_ms=1000):
            texts.append(chunk.text)
            deltas.append(delta)
            last = chunk
        self.assertEqual(last.finish_reason, "stop", last)
        self.assertEqual(last.text, expected, (stop, last))
        revised = [t for t in texts if not last.text.startswith(t)]
        self.assertEqual(revised, [], "streamed text later taken back (stop %r): chunk texts %r" % (stop, texts))
        self.assertEqual("".join(deltas), last.text)

    def test_list_documents_pages(self):
        docs = [self.b.put_document("page-%d" % i, text=penumbra_local.story_text(300, seed=100 + i))
                for i in range(3)]
        try:
            listed = [x.id for x in self.b.list_documents(page_size=1)]
            for x in docs:
                self.assertEqual(listed.count(x.id), 1, (x.id, listed))
            self.assertEqual(len(listed), len(set(listed)), listed)
            self.assertEqual(len(listed), 3, listed)  # tenant B has only these
        finally:
            for x in docs:
                self.b.delete_document(x.id)

    def test_other_tenant_cannot_use_document(self):
        d = self.doc()
        with self.assertRaises(pc.NotFound):
            self.b.get_document(d.id)
        with self.assertRaises(pc.NotFound):
            self.b.delete_document(d.id)
        with self.assertRaises(pc.NotFound):
            self.b.ask([d.id], text=QUESTION, max_new_tokens=4)
        with self.assertRaises(pc.NotFound):
            self.b.generate([d.id], text=QUESTION, max_new_tokens=4)
        self.assertNotIn(d.id, [x.id for x in self.b.list_documents()])
        self.assertEqual(self.a.get_document(d.id).id, d.id)  # still there for its tenant

    def test_other_tenant_cannot_see_request(self):
        d = self.doc()
        rid = self.a.generate([d.id], text=QUESTION, max_new_tokens=8)
        with self.assertRaises(pc.NotFound):
            self.b.poll(rid, 0, 0)
        with self.assertRaises(pc.NotFound):
            self.b.cancel(rid)
        self.assertIn(self.poll_until_done(self.a, rid).finish_reason, ("stop", "length"))

    def test_unknown_api_key(self):
        c = self.svc.client("no-such-key", timeout_s=30.0)
        with c:
            with self.assertRaises(pc.PermissionDenied):
                c.stats()
            with self.assertRaises(pc.PermissionDenied):
                list(c.list_documents())
            with self.assertRaises(pc.PermissionDenied):
                c.put_document("x", text="Once upon a time.")
            with self.assertRaises(pc.PermissionDenied):
                c.get_document(self.doc().id)
            with self.assertRaises(pc.PermissionDenied):
                c.ask([self.doc().id], text=QUESTION, max_new_tokens=4)
            self.assertTrue(c.health().serving)  # Health needs no key

    def test_tls_checks_the_server_and_the_key_comes_from_a_file(self):
        # Another CA's client refuses the coordinator; a plaintext one gets nothing.
        other = self.other_ca()
        with self.assertRaises(pc.PermissionDenied):
            PenumbraClient("127.0.0.1", self.svc.port, api_key=KEY_A, tls_ca=os.path.join(other, "ca.pem")).health()
        with self.assertRaises(pc.Unavailable):
            PenumbraClient("127.0.0.1", self.svc.port, api_key=KEY_A, timeout_s=5.0).health()
        # The key from $PENUMBRA_API_KEY_FILE (never on a command line).
        key_file = os.path.join(self.svc.workdir, "key-a")
        with open(key_file, "w") as f:
            f.write(KEY_A + "\n")
        os.chmod(key_file, 0o600)
        old = os.environ.get("PENUMBRA_API_KEY_FILE")
        os.environ["PENUMBRA_API_KEY_FILE"] = key_file
        try:
            with self.svc.client() as c:
                self.assertEqual(c.api_key, KEY_A)
                c.get_document(self.doc().id)  # tenant A's
        finally:
            if old is None:
                del os.environ["PENUMBRA_API_KEY_FILE"]
            else:
                os.environ["PENUMBRA_API_KEY_FILE"] = old

    def test_tls_client_certificates_and_the_servers_role(self):
        ca = os.path.join(self.svc.certs_dir, "ca.pem")
        other = self.other_ca()
        # A client certificate of the CA (role client) is accepted; one of another CA is refused.
        with PenumbraClient("127.0.0.1", self.svc.port, api_key=KEY_A, tls_ca=ca,
                            tls_cert=os.path.join(self.svc.certs_dir, "client.pem"),
                            tls_key=os.path.join(self.svc.certs_dir, "client.key")) as c:
            self.assertTrue(c.health().serving)
        with self.assertRaises((pc.PermissionDenied, pc.Unavailable)):
            PenumbraClient("127.0.0.1", self.svc.port, api_key=KEY_A, tls_ca=ca, timeout_s=5.0,
                           tls_cert=os.path.join(other, "client.pem"), tls_key=os.path.join(other, "client.key")).stats()
        # The worker's certificate is of the same CA and names 127.0.0.1, but its role is not coordinator.
        with self.assertRaises(pc.PermissionDenied) as cm:
            PenumbraClient("127.0.0.1", self.svc.worker.port, api_key=KEY_A, tls_ca=ca,
                           tls_cert=os.path.join(self.svc.certs_dir, "client.pem"),
                           tls_key=os.path.join(self.svc.certs_dir, "client.key")).health()
        self.assertIn("'worker'", cm.exception.message)
        # The certificate names localhost too.
        with PenumbraClient("localhost", self.svc.port, api_key=KEY_A, tls_ca=ca) as c:
            self.assertTrue(c.health().serving)

    def test_bad_key_and_tls_files_are_named(self):
        ca = os.path.join(self.svc.certs_dir, "ca.pem")
        missing = os.path.join(self.svc.workdir, "no-such-ca.pem")
        with self.assertRaises(ValueError) as cm:
            PenumbraClient("127.0.0.1", self.svc.port, api_key=KEY_A, tls_ca=missing)
        self.assertIn(missing, str(cm.exception))
        open_key = os.path.join(self.svc.workdir, "open-client.key")
        shutil.copy(os.path.join(self.svc.certs_dir, "client.key"), open_key)
        os.chmod(open_key, 0o644)
        with self.assertRaises(ValueError) as cm:
            PenumbraClient("127.0.0.1", self.svc.port, api_key=KEY_A, tls_ca=ca,
                           tls_cert=os.path.join(self.svc.certs_dir, "client.pem"), tls_key=open_key)
        self.assertIn("chmod 600", str(cm.exception))
        with self.assertRaises(ValueError):  # a certificate without its key
            PenumbraClient("127.0.0.1", self.svc.port, api_key=KEY_A, tls_ca=ca,
                           tls_cert=os.path.join(self.svc.certs_dir, "client.pem"))
        empty = write_key_file(self.svc.workdir, "empty-key", "")
        with self.assertRaises(ValueError) as cm:
            pc.read_api_key_file(empty)
        self.assertIn("empty", str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            pc.read_api_key_file(missing)
        self.assertIn(missing, str(cm.exception))

    def test_example_script_over_tls_and_no_key_on_its_command_line(self):
        self.doc()  # the model is warm
        ca = os.path.join(self.svc.certs_dir, "ca.pem")
        key_file = write_key_file(self.svc.workdir, "example-key", KEY_A)
        base = [sys.executable, os.path.join(CLIENT_DIR, "example.py"), "--port", str(self.svc.port),
                "--max-new-tokens", "4"]
        # TLS and the key from the environment, as ops/run.sh gives them.
        env = script_env(PENUMBRA_TLS_CA=ca, PENUMBRA_API_KEY_FILE=key_file)
        p = subprocess.run(base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=WAIT_S + 30, env=env)
        self.assertEqual(p.returncode, 0, p.stderr.decode("utf-8", "replace"))
        self.assertIn(b"finish:", p.stdout)
        # Without the CA: the TLS port gives a plaintext client nothing.
        p = subprocess.run(base + ["--api-key-file", key_file], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=WAIT_S + 30, env=script_env())
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn(b"UNAVAILABLE", p.stderr)
        # A key on the command line is refused without being repeated; a
        # prefix of --api-key-file is not taken for it.
        for script in ("example.py", "batch_job.py"):
            argv = [sys.executable, os.path.join(CLIENT_DIR, script), "--port", str(self.svc.port)]
            p = subprocess.run(argv + ["--api-key", KEY_A], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               timeout=WAIT_S, env=env)
            self.assertEqual(p.returncode, 2, (script, p.stderr))
            self.assertIn(b"never taken on the command line", p.stderr)
            self.assertNotIn(KEY_A.encode(), p.stdout + p.stderr)
            p = subprocess.run(argv + ["--api-key-f", KEY_A], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               timeout=WAIT_S, env=env)
            self.assertEqual(p.returncode, 2, (script, p.stderr))
            self.assertIn(b"unrecognized arguments: --api-key-f", p.stderr)
        # A key file that cannot be read is named (exit 2, before any call).
        p = subprocess.run(base + ["--api-key-file", os.path.join(self.svc.workdir, "no-such-key")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=WAIT_S, env=env)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn(b"no-such-key", p.stderr)

    def test_unknown_document(self):
        with self.assertRaises(pc.NotFound):
            self.a.get_document("no-such-document")
        with self.assertRaises(pc.NotFound):
            self.a.delete_document("no-such-document")
        with self.assertRaises(pc.NotFound):
            self.a.ask(["no-such-document"], text=QUESTION, max_new_tokens=4)

    def test_empty_question(self):
        with self.assertRaises(pc.InvalidArgument):
            self.a.ask([self.doc().id], text="", max_new_tokens=4)

    def test_negative_temperature(self):
        with self.assertRaises(pc.InvalidArgument):
            self.a.ask([self.doc().id], text=QUESTION, max_new_tokens=4, temperature=-1.0)
        with self.assertRaises(pc.InvalidArgument):
            self.a.generate([self.doc().id], text=QUESTION, max_new_tokens=4, temperature=-1.0)

    def test_delete_then_get(self):
        d = self.a.put_document("to-delete", text=penumbra_local.story_text(500, seed=3))
        self.assertEqual(pc.state_name(d.state), "READY", d)
        self.a.delete_document(d.id)
        with self.assertRaises(pc.NotFound):
            self.a.get_document(d.id)
        with self.assertRaises(pc.NotFound):
            self.a.ask([d.id], text=QUESTION, max_new_tokens=4)
        self.assertNotIn(d.id, [x.id for x in self.a.list_documents()])

    def test_cancel_running_request(self):
        d = self.doc()
        rid = self.a.generate([d.id], text=QUESTION, max_new_tokens=2000, ignore_eos=True)
        end = time.monotonic() + WAIT_S
        offset = 0
        while offset == 0:  # running: some tokens out
            chunk = self.a.poll(rid, 0, 1000)
            self.assertFalse(chunk.done, chunk)
            offset = len(chunk.ids or [])
            self.assertLess(time.monotonic(), end, "no token after %.0f s" % WAIT_S)
        self.a.cancel(rid)
        last = self.poll_until_done(self.a, rid, offset)
        self.assertEqual(last.finish_reason, "cancelled", last)
        self.assertLess(last.usage.generated_tokens, 2000, last)

    def test_stats_counts_requests(self):
        d = self.doc()
        s0 = self.a.stats()
        r = self.a.ask([d.id], text=QUESTION, max_new_tokens=4)
        s1 = self.a.stats()
        self.assertGreaterEqual(s1.requests, s0.requests + 1, (s0, s1))
        self.assertGreaterEqual(s1.generated_tokens, s0.generated_tokens + r.usage.generated_tokens, (s0, s1))
        self.assertGreaterEqual(s1.prompt_tokens, s0.prompt_tokens + r.usage.prompt_tokens, (s0, s1))
        self.assertGreaterEqual(s1.documents, 1, s1)
        self.assertFalse(s1.workers, s1)  # the workers are for an admin tenant (tenants file), not --api-keys ones

    def test_metrics(self):
        self.assertGreater(self.svc.metrics_port, 0)
        url = "http://127.0.0.1:%d/metrics" % self.svc.metrics_port
        with urllib.request.urlopen(url, timeout=10) as resp:
            self.assertEqual(resp.status, 200)
            body = resp.read().decode("utf-8")
        self.assertIn("penumbra_coordinator_", body)
        self.assertTrue(any(line.startswith("# TYPE penumbra_coordinator_") for line in body.splitlines()),
                        body[:2000])


    # ------------------------------------------------------------------ batch jobs

    def test_job_answers_match_complete(self):
        d = self.doc()
        questions = {
            "q-ben": QUESTION,
            "q-lily": "\n\nQuestion: Who is Lily?\nAnswer:",
            "q-park": "\n\nQuestion: Where did they play?\nAnswer:",
            "q-feel": "\n\nQuestion: How did Tom feel?\nAnswer:",
            "q-night": "\n\nQuestion: What happened at night?\nAnswer:",
        }
        ids = sorted(questions)
        items = [  # the three shapes submit_job takes
            {"custom_id": ids[0], "document_ids": [d.id], "text": questions[ids[0]], "max_new_tokens": 8},
            (ids[1], [d.id], questions[ids[1]], {"max_new_tokens": 8}),
            pc.job_item(ids[2], [d.id], questions[ids[2]], max_new_tokens=8),
        ] + [(cid, d.id, questions[cid], {"max_new_tokens": 8}) for cid in ids[3:]]
        job = self.a.submit_job(items, metadata="python-client-test")
        self.assertTrue(job.id, job)
        self.assertEqual(job.total, 5, job)
        self.assertEqual(job.metadata, "python-client-test", job)
        seen = []
        done = self.a.wait_job(job.id, poll_s=0.2, timeout_s=WAIT_S, on_progress=seen.append)
        self.assertEqual(pc.job_status_name(done.status), "COMPLETED", (done, self.logs()))
        self.assertEqual((done.total, done.completed, done.failed, done.cancelled, done.pending, done.running),
                         (5, 5, 0, 0, 0, 0), done)
        self.assertGreater(done.finished_unix_s, 0, done)
        self.assertTrue(seen, "on_progress never called")
        self.assertEqual(seen[-1].status, done.status, seen)
        self.assertEqual(self.a.get_job(job.id).status, done.status)

        results = list(self.a.job_results(job.id, page_size=2))  # 3 pages
        self.assertEqual([r.custom_id for r in results], ids, results)
        for r in results:
            self.assertTrue(r.ok, r)
            self.assertIsNone(pc.job_result_error(r), r)
            self.assertEqual(r.state, "succeeded", r)
            self.assertIn(r.finish_reason, ("stop", "length"), r)
            self.assertGreater(len(r.ids), 0, r)
            self.assertEqual(r.usage.generated_tokens, len(r.ids), r)
            alone = self.a.ask([d.id], text=questions[r.custom_id], max_new_tokens=8)  # greedy
            self.assertEqual(list(r.ids), list(alone.ids), (r.custom_id, r.text, alone.text))
            self.assertEqual(r.text, alone.text, r.custom_id)

        self.assertEqual([j.id for j in self.a.list_jobs(page_size=1)].count(job.id), 1)
        # Another tenant sees nothing of it.
        self.assertNotIn(job.id, [j.id for j in self.b.list_jobs()])
        with self.assertRaises(pc.NotFound):
            self.b.get_job(job.id)
        with self.assertRaises(pc.NotFound):
            list(self.b.job_results(job.id))
        with self.assertRaises(pc.NotFound):
            self.b.cancel_job(job.id)
        with self.assertRaises(pc.NotFound):
            self.b.delete_job(job.id)
        # Over: it cannot be cancelled; it can be deleted (once).
        with self.assertRaises(pc.FailedPrecondition):
            self.a.cancel_job(job.id)
        self.a.delete_job(job.id)
        with self.assertRaises(pc.NotFound):
            self.a.get_job(job.id)
        with self.assertRaises(pc.NotFound):
            list(self.a.job_results(job.id))
        with self.assertRaises(pc.NotFound):
            self.a.delete_job(job.id)
        self.assertNotIn(job.id, [j.id for j in self.a.list_jobs()])

    def test_job_with_a_bad_item_is_refused_whole(self):
        d = self.doc()
        before = [j.id for j in self.a.list_jobs()]
        good = ("good", [d.id], QUESTION, {"max_new_tokens": 4})
        with self.assertRaises(pc.NotFound) as cm:
            self.a.submit_job([good, ("bad", ["no-such-document"], QUESTION)])
        self.assertIn("bad", cm.exception.message)
        with self.assertRaises(pc.InvalidArgument):
            self.a.submit_job([good, good])  # custom_id twice
        with self.svc.client("no-such-key") as c:
            with self.assertRaises(pc.PermissionDenied):
                c.submit_job([good])
            with self.assertRaises(pc.PermissionDenied):
                list(c.list_jobs())
        with self.assertRaises(TypeError):  # refused here, before any call
            self.a.submit_job([{"custom_id": "x", "document_ids": [d.id], "question": QUESTION}])
        with self.assertRaises(TypeError):
            self.a.submit_job(good)  # one item, not a list of them
        self.assertEqual([j.id for j in self.a.list_jobs()], before)

    def test_job_item_that_fails(self):
        # A negative temperature: refused at submit, or (the coordinator leaves
        # sampling to the worker) that item's result is INVALID_ARGUMENT while
        # the other item succeeds and the job completes.
        d = self.doc()
        items = [("fine", [d.id], QUESTION, {"max_new_tokens": 4}),
                 ("negative", [d.id], QUESTION, {"max_new_tokens": 4, "temperature": -1.0})]
        try:
            job = self.a.submit_job(items)
        except pc.InvalidArgument as e:
            self.assertIn("negative", e.message)
            return
        try:
            done = self.a.wait_job(job.id, poll_s=0.2, timeout_s=WAIT_S)
            self.assertEqual(pc.job_status_name(done.status), "COMPLETED", done)
            self.assertEqual((done.completed, done.failed), (1, 1), done)
            fine, negative = list(self.a.job_results(job.id))
            self.assertEqual((fine.custom_id, fine.ok, fine.state), ("fine", True, "succeeded"), fine)
            self.assertEqual((negative.custom_id, negative.ok, negative.state), ("negative", False, "failed"),
                             negative)
            self.assertIsInstance(pc.job_result_error(negative), pc.InvalidArgument, negative)
            self.assertIn("temperature", negative.error, negative)
        finally:
            self.a.delete_job(job.id)

    def test_batch_job_example(self):
        self.doc()  # the model is warm
        script = os.path.join(CLIENT_DIR, "batch_job.py")
        key_file = os.path.join(self.svc.workdir, "batch-key")
        with open(key_file, "w") as f:
            f.write(KEY_A)
        os.chmod(key_file, 0o600)
        p = subprocess.run([sys.executable, script, "--port", str(self.svc.port), "--api-key-file", key_file,
                            "--tls-ca", os.path.join(self.svc.certs_dir, "ca.pem"),
                            "--max-new-tokens", "4", "--poll-s", "0.2", "--timeout-s", str(WAIT_S)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=WAIT_S + 30)
        out, err = p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
        self.assertEqual(p.returncode, 0, "stdout:\n%s\nstderr:\n%s" % (out, err))
        for cid in ("d0-q0", "d0-q1", "d0-q2"):
            self.assertIn("[%s]" % cid, out)
        self.assertIn("COMPLETED", err)
        self.assertNotIn("batch_job.py", [j.metadata for j in self.a.list_jobs()])  # it deleted its job


def main():
    penumbra_local.install_sigterm_exit(interrupt=True)
    signal.signal(signal.SIGALRM, _watchdog)
    signal.alarm(WATCHDOG_S)
    for name in ("penumbra-worker", "penumbra-coordinator"):
        path = os.path.join(BUILD_DIR, "bin", name)
        if not os.access(path, os.X_OK):
            sys.stderr.write("python_client_test: %s is missing (build it first)\n" % path)
            return 1
    prog = unittest.main(argv=[sys.argv[0]] + UNITTEST_ARGV, exit=False, verbosity=2)
    signal.alarm(0)
    ok = prog.result.wasSuccessful()
    svc = PythonClientTest.svc
    if svc is not None:
        if ok:
            shutil.rmtree(svc.workdir, ignore_errors=True)
        else:
            sys.stderr.write("server logs kept in %s\n" % svc.workdir)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

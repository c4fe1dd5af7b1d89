"""Starts a local Penumbra service (one penumbra-worker + penumbra-coordinator)
on loopback with OS-picked ports, for tests and ops/loadtest.py.

    from penumbra_local import LocalService

    with LocalService(build_dir, model_dir, api_keys={"key-a-0123456789ab": "tenant-a"}) as svc:
        client = PenumbraClient("127.0.0.1", svc.port, api_key="key-a")

Each process writes a port file ({"port", "metrics_port", "pid"}; the
coordinator's also "openai_port") once it is
serving; start() waits for it (bounded), failing with the process's stderr if
it exits first. stop() sends SIGTERM, then SIGKILL after a grace period;
processes are also stopped at interpreter exit (atexit) and, on Linux, when
the thread that started them dies (PR_SET_PDEATHSIG), so a killed test does
not leave servers behind. Logs go to files in the service's work directory.
"""

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
DEFAULT_BUILD_DIR = os.path.join(REPO_ROOT, "build")
DEFAULT_MODEL_DIR = os.path.join(REPO_ROOT, "models", "penumbra-eval")

_live = []  # LocalProcess objects not yet stopped


def _stop_all_at_exit():
    for p in list(_live):
        try:
            p.stop()
        except Exception:
            pass


atexit.register(_stop_all_at_exit)


def install_sigterm_exit(interrupt=False):
    """Makes SIGTERM (and SIGHUP) exit through SystemExit (interrupt: through
    KeyboardInterrupt, which unittest lets through instead of recording it as
    a test's error), so atexit handlers (which stop the started processes)
    run. Call from the main thread."""
    def handler(signum, frame):
        if interrupt:
            raise KeyboardInterrupt("signal %d" % signum)
        raise SystemExit(128 + signum)
    for s in (signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(s, handler)
        except (ValueError, OSError):
            pass


def _pdeathsig():
    """preexec_fn: the child gets SIGTERM when its parent thread dies (Linux)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except Exception:
        pass


def _tail(path, limit=4000):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


class ProcessError(RuntimeError):
    pass


class LocalProcess(object):
    """One server process started with --port-file."""

    def __init__(self, name, argv, workdir, env=None):
        self.name = name
        self.argv = list(argv)
        self.workdir = workdir
        self.env = env
        self.port_file = os.path.join(workdir, name + ".port.json")
        self.stdout_path = os.path.join(workdir, name + ".stdout.log")
        self.stderr_path = os.path.join(workdir, name + ".stderr.log")
        self.proc = None
        self.port = None
        self.metrics_port = None
        self.openai_port = None
        self.pid = None

    def start(self, timeout_s=60.0):
        """Starts the process and waits (at most timeout_s) for its port file."""
        if not os.access(self.argv[0], os.X_OK):
            raise ProcessError("%s: %s is missing or not executable" % (self.name, self.argv[0]))
        try:
            os.unlink(self.port_file)
        except FileNotFoundError:
            pass
        argv = self.argv + ["--port-file", self.port_file]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=self.env,
                                         preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None)
        _live.append(self)
        end = time.monotonic() + timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self._forget()
                raise ProcessError("%s exited with status %s before serving; command: %s\nstderr:\n%s" %
                                   (self.name, rc, " ".join(argv), _tail(self.stderr_path)))
            if os.path.exists(self.port_file):
                try:
                    with open(self.port_file) as f:
                        info = json.load(f)
                    self.port = int(info["port"])
                    self.metrics_port = int(info.get("metrics_port", -1))
                    self.openai_port = int(info.get("openai_port", -1))
                    self.pid = int(info.get("pid", self.proc.pid))
                    return self
                except (ValueError, KeyError, OSError):
                    pass  # written atomically; a bad one is reread until the timeout
            if time.monotonic() > end:
                self.stop()
                raise ProcessError("%s did not write %s within %.0f s; command: %s\nstderr:\n%s" %
                                   (self.name, self.port_file, timeout_s, " ".join(argv), _tail(self.stderr_path)))
            time.sleep(0.1)

    def running(self):
        return self.proc is not None and self.proc.poll() is None

    def stderr_tail(self, limit=4000):
        return _tail(self.stderr_path, limit)

    def stop(self, grace_s=10.0):
        """SIGTERM, then SIGKILL after grace_s; returns the exit status."""
        if self.proc is None:
            return None
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
            return self.proc.returncode
        finally:
            self._forget()

    def _forget(self):
        if self in _live:
            _live.remove(self)


def write_api_keys(path, api_keys):
    """Writes the coordinator's --api-keys YAML: keys: {KEY: TENANT, ...}."""
    with open(path, "w") as f:
        f.write("keys:\n")
        for key, tenant in api_keys.items():
            f.write("  %s: %s\n" % (json.dumps(key), json.dumps(tenant)))


class LocalService(object):
    """A worker (--device cpu by default) and a coordinator in front of it.

    api_keys: {key: tenant} (written to an --api-keys file), or None for the
    coordinator's default. port / metrics_port: the coordinator's; the
    worker's are in .worker. workdir: logs and port files (a temporary
    directory, removed by stop() unless keep_workdir). data_dir: the
    coordinator's --data-dir (batch jobs), True for <workdir>/data, or None
    (no jobs). tenants: a tenants YAML (configs/tenants.yaml: hashed keys,
    quotas, weights) passed as the coordinator's --tenants, or None (none).
    tls: every plane over TLS, with certificates `penumbra cert init` makes
    in <workdir>/certs (the coordinator's public API, mutual TLS to the
    worker); client() then gives clients that check the CA.
    """

    def __init__(self, build_dir=DEFAULT_BUILD_DIR, model_dir=DEFAULT_MODEL_DIR, api_keys=None, device="cpu",
                 worker_args=(), coordinator_args=(), workdir=None, keep_workdir=False, start_timeout_s=60.0,
                 data_dir=None, tenants=None, tls=False):
        self.build_dir = os.path.abspath(build_dir)
        self.model_dir = os.path.abspath(model_dir)
        self.api_keys = dict(api_keys) if api_keys else None
        self.device = device
        self.worker_args = list(worker_args)
        self.coordinator_args = list(coordinator_args)
        self._own_workdir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="penumbra-local-")
        self.keep_workdir = keep_workdir
        self.start_timeout_s = start_timeout_s
        self.data_dir = os.path.join(self.workdir, "data") if data_dir is True else data_dir
        self.tenants = os.path.abspath(tenants) if tenants else None
        self.tls = tls
        self.certs_dir = os.path.join(self.workdir, "certs") if tls else None
        self.worker = None
        self.coordinator = None

    def _make_certificates(self):
        """penumbra cert init for a topology of this service's names (w0 and
        the coordinator, on loopback)."""
        topology = os.path.join(self.workdir, "topology.yaml")
        with open(topology, "w") as f:
            f.write("workers:\n  - {name: w0, host: 127.0.0.1}\n")
        p = subprocess.run([self.binary("penumbra"), "cert", "init", self.certs_dir, "--topology", topology],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if p.returncode != 0:
            raise ProcessError("penumbra cert init failed: %s" % p.stdout.decode("utf-8", "replace"))

    def security_args(self, name):
        """The security flags of process `name` (w0, coordinator); none without TLS."""
        if not self.tls:
            return []
        d = self.certs_dir
        return ["--tls-ca", os.path.join(d, "ca.pem"), "--tls-cert", os.path.join(d, name + ".pem"),
                "--tls-key", os.path.join(d, name + ".key"), "--cluster-secret-file",
                os.path.join(d, "cluster.secret")]

    def client(self, api_key=None, **kwargs):
        """A PenumbraClient of this service (checking its CA under TLS; the API key
        of the environment when api_key is None)."""
        from penumbra_client import PenumbraClient
        if self.tls:
            kwargs.setdefault("tls_ca", os.path.join(self.certs_dir, "ca.pem"))
        return PenumbraClient("127.0.0.1", self.port, api_key=api_key, **kwargs)

    def binary(self, name):
        return os.path.join(self.build_dir, "bin", name)

    @property
    def port(self):
        return self.coordinator.port

    @property
    def metrics_port(self):
        return self.coordinator.metrics_port

    def start(self):
        try:
            if self.tls:
                self._make_certificates()
            self.worker = LocalProcess("worker", [
                self.binary("penumbra-worker"), "--model", self.model_dir, "--device", self.device,
                "--port", "0", "--metrics-port", "0"] + self.security_args("w0") + self.worker_args, self.workdir)
            self.worker.start(self.start_timeout_s)
            argv = [self.binary("penumbra-coordinator"), "--model", self.model_dir,
                    "--workers", "127.0.0.1:%d" % self.worker.port, "--port", "0", "--metrics-port", "0"]
            if self.api_keys:
                keys = os.path.join(self.workdir, "api_keys.yaml")
                write_api_keys(keys, self.api_keys)
                argv += ["--api-keys", keys]
            if self.data_dir:
                argv += ["--data-dir", self.data_dir]
            if self.tenants:
                argv += ["--tenants", self.tenants]
            argv += self.security_args("coordinator")
            self.coordinator = LocalProcess("coordinator", argv + self.coordinator_args, self.workdir)
            self.coordinator.start(self.start_timeout_s)
        except BaseException:
            self.stop(remove_workdir=False)
            raise
        return self

    def stop(self, remove_workdir=None):
        """Stops the coordinator, then the worker. Returns their exit statuses."""
        codes = {}
        for name in ("coordinator", "worker"):
            p = getattr(self, name)
            if p is not None:
                codes[name] = p.stop()
        if remove_workdir is None:
            remove_workdir = self._own_workdir and not self.keep_workdir
        if remove_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return codes

    def logs(self, limit=3000):
        """The stderr tails of both processes (for failure messages)."""
        out = []
        for name in ("worker", "coordinator"):
            p = getattr(self, name)
            if p is not None:
                out.append("--- %s stderr (%s) ---\n%s" % (name, p.stderr_path, p.stderr_tail(limit)))
        return "\n".join(out)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False


# --------------------------------------------------------------------------- text

_NAMES = ["Lily", "Tom", "Ben", "Sue", "Max", "Mia", "Sam", "Anna", "Tim", "Lucy"]
_ANIMALS = ["cat", "dog", "bird", "bunny", "frog", "duck", "bear", "fish"]
_THINGS = ["ball", "kite", "box", "toy car", "hat", "book", "cake", "flower", "shell", "boat"]
_PLACES = ["park", "garden", "forest", "house", "pond", "school", "beach", "farm"]
_ADJS = ["big", "small", "red", "blue", "happy", "shiny", "soft", "old", "funny", "pretty"]
_FEELINGS = ["happy", "sad", "scared", "excited", "tired", "surprised", "proud", "kind"]
_VERBS = ["found", "saw", "lost", "made", "shared", "painted", "hid", "carried"]


def _a(word):
    return "an" if word[0] in "aeiou" else "a"


def story_text(chars=4000, seed=1):
    """Deterministic English-like text (simple stories) of about `chars`
    characters, the kind the evaluation model was trained on."""
    import random
    r = random.Random(seed)
    out = []
    n = 0
    while n < chars:
        name, friend = r.sample(_NAMES, 2)
        animal, thing, place = r.choice(_ANIMALS), r.choice(_THINGS), r.choice(_PLACES)
        adj, feeling, verb = r.choice(_ADJS), r.choice(_FEELINGS), r.choice(_VERBS)
        sentences = [
            "Once upon a time, there was %s %s %s named %s." % (_a(adj), adj, animal, name),
            "%s lived near the %s with a friend called %s." % (name, place, friend),
            "One day, %s %s the %s %s in the %s." % (name, verb, r.choice(_ADJS), thing, place),
            "%s felt very %s and ran to tell %s." % (name, feeling, friend),
            "\"Look at my %s!\" said %s. %s smiled and said, \"It is so %s!\"" % (
                thing, name, friend, r.choice(_ADJS)),
            "They played with the %s all day until the sun went down." % thing,
            "At night, %s went home and dreamed about the %s." % (name, place),
        ]
        para = " ".join(sentences[:r.randint(4, len(sentences))]) + "\n\n"
        out.append(para)
        n += len(para)
    return "".join(out)[:chars].rsplit(" ", 1)[0] + "."

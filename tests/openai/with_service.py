#!/usr/bin/python3
"""Runs a command against a local Penumbra service with its OpenAI-compatible
API on: a CPU worker and a coordinator (models/penumbra-eval, the
question-answer chat template, request bodies of at most 1 MiB) on loopback with OS-picked ports, every plane
over TLS with certificates from `penumbra cert init`, tenants from a tenants
file whose keys are made here, and a --data-dir (batch jobs on).

    tests/openai/with_service.py [--build DIR] [--model DIR] -- CMD ARG...

CMD runs with, in its environment:
  OPENAI_BASE_URL      https://127.0.0.1:PORT/v1 (the OpenAI API)
  OPENAI_API_KEY       tenant "alpha"'s key (no quotas)
  PENUMBRA_KEY_TIGHT   tenant "tight"'s key (one concurrent sequence, 64 generated tokens a minute)
  PENUMBRA_KEY_BETA    tenant "beta"'s key (no quotas)
  NODE_EXTRA_CA_CERTS  the service's CA (Node's clients trust it)
  PENUMBRA_TLS_CA      the same, for curl (--cacert) and the Thrift clients
  PENUMBRA_PORT        the Thrift public API's port
  PENUMBRA_METRICS     http://127.0.0.1:M/metrics (the coordinator's admin endpoint)
  PENUMBRA_WORKER_METRICS  the same, of the worker
  PENUMBRA_COORDINATOR_PID
and its exit status is this script's. With --restart-coordinator, a
coordinator that exits while CMD runs (a test killed it) is started again
at once on the same data directory and the same ports, as a supervisor
(systemd's Restart=always) would: CMD's clients find it where it was. The service is stopped after it
(SIGTERM, then SIGKILL), also when this script is interrupted, and the whole
run is bounded by --timeout-s (default 240).
"""

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "coordinator", "client", "python"))

import penumbra_local  # noqa: E402


def new_key(build):
    """A tenant key and its hash (penumbra tenant new-key)."""
    out = subprocess.run([os.path.join(build, "bin", "penumbra"), "tenant", "new-key"], check=True,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout.decode().split()
    return out[0], out[1]


def supervise(svc, stopping):
    """Restarts the coordinator (same argv, its first ports) whenever it exits, until `stopping` is set."""
    first = svc.coordinator
    argv = list(first.argv)
    for flag, port in (("--port", first.port), ("--metrics-port", first.metrics_port),
                       ("--openai-port", first.openai_port)):
        argv[argv.index(flag) + 1] = str(port)
    restarts = 0
    while not stopping.wait(0.1):
        if svc.coordinator.running():
            continue
        restarts += 1
        sys.stderr.write("with_service.py: the coordinator exited (status %s); starting it again on the same "
                         "ports\n" % svc.coordinator.proc.returncode)
        p = penumbra_local.LocalProcess("coordinator-%d" % restarts, argv, svc.workdir)
        deadline = time.monotonic() + 30
        while True:
            try:
                p.start(60)
                break
            except penumbra_local.ProcessError as e:
                if time.monotonic() > deadline or stopping.is_set():  # its ports may linger a moment
                    sys.stderr.write("with_service.py: could not restart the coordinator: %s\n" % e)
                    return
                time.sleep(0.5)
        svc.coordinator = p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--model", default=os.path.join(REPO, "models", "penumbra-eval"))
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--restart-coordinator", action="store_true",
                    help="start the coordinator again (same ports) whenever it exits while the command runs")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command")
    penumbra_local.install_sigterm_exit()
    build = os.path.abspath(a.build)
    keys = {name: new_key(build) for name in ("alpha", "beta", "tight")}
    svc = penumbra_local.LocalService(
        build, os.path.abspath(a.model), tls=True, data_dir=True,
        coordinator_args=["--openai-port", "0", "--openai-max-body-mb", "1", "--chat-template",
                          os.path.join(REPO, "configs", "chat_templates", "question-answer.jinja")])
    tenants = os.path.join(svc.workdir, "tenants.yaml")
    with open(tenants, "w") as f:
        f.write("tenants:\n")
        for name, (_, digest) in keys.items():
            f.write("  - name: %s\n    api_keys: [%s]\n" % (name, digest))
            if name == "tight":
                f.write("    quotas: {max_concurrent_sequences: 1, generated_tokens_per_minute: 64}\n")
    svc.tenants = tenants
    rc = 1
    try:
        svc.start()
        ca = os.path.join(svc.certs_dir, "ca.pem")
        env = dict(os.environ)
        env.update({
            "OPENAI_BASE_URL": "https://127.0.0.1:%d/v1" % svc.coordinator.openai_port,
            "OPENAI_API_KEY": keys["alpha"][0],
            "PENUMBRA_KEY_BETA": keys["beta"][0],
            "PENUMBRA_KEY_TIGHT": keys["tight"][0],
            "NODE_EXTRA_CA_CERTS": ca,
            "PENUMBRA_TLS_CA": ca,
            "PENUMBRA_PORT": str(svc.port),
            "PENUMBRA_METRICS": "http://127.0.0.1:%d/metrics" % svc.metrics_port,
            "PENUMBRA_WORKER_METRICS": "http://127.0.0.1:%d/metrics" % svc.worker.metrics_port,
            "PENUMBRA_COORDINATOR_PID": str(svc.coordinator.pid),
        })
        stopping = threading.Event()
        if a.restart_coordinator:
            threading.Thread(target=supervise, args=(svc, stopping), daemon=True).start()
        try:
            rc = subprocess.run(cmd, env=env, timeout=a.timeout_s).returncode
        except subprocess.TimeoutExpired:
            sys.stderr.write("with_service.py: %s ran longer than %.0f s\n" % (" ".join(cmd), a.timeout_s))
            rc = 124
        finally:
            stopping.set()
        if rc != 0:
            sys.stderr.write(svc.logs() + "\n")
    finally:
        svc.stop()
    return rc


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())

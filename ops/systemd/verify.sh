#!/usr/bin/env bash
# Checks ops/systemd's units: each keeps the settings a deployment relies on
# (its user, its environment files, SIGTERM with a stop timeout above the
# drain, restart on failure, reload by SIGHUP, the hardening), and, where systemd-analyze is
# installed, `systemd-analyze verify` passes against a scratch root holding
# the units, stand-ins for the binaries and the example environment files.
# Exit 0: all good; 1: a problem (printed); 77: systemd-analyze missing
# (the settings were checked, verify was not run).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
fail=0
need() {  # unit, line that must be there (a whole line)
  grep -qxF -- "$2" "$here/$1" || { echo "$1: missing '$2'"; fail=1; }
}
for u in penumbra-coordinator.service penumbra-worker@.service penumbra-store@.service; do
  for line in User=penumbra Group=penumbra Restart=on-failure KillSignal=SIGTERM NoNewPrivileges=yes \
              ProtectSystem=strict ProtectHome=yes PrivateTmp=yes CapabilityBoundingSet= AmbientCapabilities= \
              LimitNOFILE=1048576 UMask=0077 'ExecReload=/bin/kill -HUP $MAINPID'; do
    need "$u" "$line"
  done
  grep -q '^EnvironmentFile=/etc/penumbra/' "$here/$u" || { echo "$u: no EnvironmentFile under /etc/penumbra"; fail=1; }
  grep -q '^ReadWritePaths=/var/lib/penumbra/' "$here/$u" || { echo "$u: no ReadWritePaths for its data"; fail=1; }
  grep -q '^RestartSec=' "$here/$u" || { echo "$u: no RestartSec (backoff)"; fail=1; }
  stop=$(sed -n 's/^TimeoutStopSec=\([0-9]*\)s$/\1/p' "$here/$u")
  # The coordinator and the workers drain for --drain-seconds (30 by
  # default), the workers 10 s more for the last answers to be read; a store
  # node only flushes.
  min=45; [ "$u" = penumbra-store@.service ] && min=10
  if [ -z "$stop" ] || [ "$stop" -le "$min" ]; then
    echo "$u: TimeoutStopSec (in s) must be above $min, got '${stop}'"; fail=1
  fi
done
need penumbra-worker@.service Environment=CUDA_VISIBLE_DEVICES=%i
for f in coordinator worker worker-0 store store-s0; do
  [ -f "$here/$f.env.example" ] || { echo "missing $f.env.example"; fail=1; }
done
[ "$fail" -eq 0 ] || exit 1

command -v systemd-analyze >/dev/null || { echo "systemd-analyze not installed: verify not run"; exit 77; }
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/usr/local/bin" "$root/etc/systemd/system" "$root/etc/penumbra" "$root/usr/lib/systemd" "$root/bin"
cp -r /usr/lib/systemd/system "$root/usr/lib/systemd/"
cp /bin/kill "$root/bin/kill"  # the units' ExecReload
for b in coordinator worker store; do
  printf '#!/bin/sh\n' > "$root/usr/local/bin/penumbra-$b"
  chmod 755 "$root/usr/local/bin/penumbra-$b"
done
cp "$here"/penumbra-*.service "$root/etc/systemd/system/"
for f in coordinator worker worker-0 store store-s0; do cp "$here/$f.env.example" "$root/etc/penumbra/$f.env"; done
out=$(cd "$root/etc/systemd/system" && systemd-analyze verify --man=no --root="$root" \
        penumbra-coordinator.service penumbra-worker@0.service penumbra-store@s0.service 2>&1) || {
  echo "$out"; echo "systemd-analyze verify failed"; exit 1; }
# systemd < 254 does not know the growing restart delay's keys: expected.
rest=$(printf '%s\n' "$out" | grep -v -e "Unknown key 'RestartSteps'" -e "Unknown key 'RestartMaxDelaySec'" | grep . || true)
[ -z "$rest" ] || { echo "$rest"; echo "systemd-analyze verify warned"; exit 1; }
echo "ops/systemd: units verified ($(systemd-analyze --version | head -1))"

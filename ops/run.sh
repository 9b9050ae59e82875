#!/usr/bin/env bash
# The run command: set up, then start the whole mesh of a cluster file. Ctrl-C stops it all.
#   ops/run.sh                                   # tiny default cluster, API on :8000
#   ops/run.sh --cluster ops/clusters/seed-case-study.toml
set -euo pipefail
cd "$(dirname "$0")/.."
ops/setup.sh
exec "${HETMESH_VENV:-.venv}/bin/python" -m hetmesh.launcher "$@"

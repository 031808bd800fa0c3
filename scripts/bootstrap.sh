#!/usr/bin/env bash
# Create .venv (when missing) and install rlhfkit with its dev extras. torch is pinned and installed first,
# so pip never swaps in a multi-GB CUDA build on a CPU machine. Re-runs are quick: a stamp file records
# the install and is refreshed when pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.rlhfkit-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  .venv/bin/python -m pip install -q -e ".[dev,tasks,textarena]"
  touch "$stamp"
fi

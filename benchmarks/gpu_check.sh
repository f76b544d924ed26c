#!/usr/bin/env bash
# Checks every jkv Pallas kernel against its reference and times decode attention on the GPU.
#   bash benchmarks/gpu_check.sh [--cpu] [--out DIR] [--budget-s SECONDS]
# --cpu: correctness only, in Pallas interpret mode, tiny shapes (about a minute).
# Installs nothing. Python: $PYTHON if set, else the repo's .venv if present, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
# Uninstalled checkout: `models/` and `pallas_kernels/` import as `jkv_models` and `jkv_kernels`
# (their installed names), so link them under those names in a scratch folder on the path.
names="$(mktemp -d)"
ln -s "$PWD/models" "$names/jkv_models"
ln -s "$PWD/pallas_kernels" "$names/jkv_kernels"
export PYTHONPATH="$PWD:$names${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n "${PYTHON:-}" ]]; then
  py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
  py=.venv/bin/python
else
  py=python3
fi
exec "$py" benchmarks/gpu_check.py "$@"

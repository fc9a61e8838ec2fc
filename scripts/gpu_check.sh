#!/usr/bin/env bash
# The one prepared command for a GPU machine: install the carried wheels (scripts/gpu_wheels.sh)
# without touching its torch/transformers/accelerate, then run the check and keep its table.
#   bash scripts/gpu_check.sh                        # results in benchmarks/results/<date>/
#   OUT=/some/dir bash scripts/gpu_check.sh --budget-seconds 200
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G "wheels/*.whl" >/dev/null; then
    python3 -m pip install --quiet --no-index --no-deps wheels/*.whl
fi
# The recipes import common/ from the repository; no install of the project is needed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
out="${OUT:-benchmarks/results/$(date -u +%Y-%m-%d)}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python3 scripts/gpu_check.py --out "$out" "$@"

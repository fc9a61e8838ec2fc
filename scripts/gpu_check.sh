#!/usr/bin/env bash
# The one prepared command for a GPU machine: install the carried wheels (scripts/gpu_wheels.sh)
# beside its torch/transformers/accelerate (never over them), start DeepSpeed's op build in the
# background so it is ready when the DeepSpeed runs come, then run the check and keep its table.
#   bash scripts/gpu_check.sh                               # results in benchmarks/results/gpu_check-<date>/
#   RESULTS=/some/dir bash scripts/gpu_check.sh --budget-seconds 200
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G "wheels/*.whl" >/dev/null; then
    # --target + PYTHONPATH: nothing the machine's own environment holds is replaced or upgraded.
    python3 -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target /tmp/gpu_check_site wheels/*.whl
    export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The recipes import common/ from the repository; no install of the project is needed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
out="${RESULTS:-benchmarks/results/gpu_check-$(date -u +%Y-%m-%d)}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
if python3 -c "import deepspeed" 2>/dev/null; then
    # DeepSpeed compiles its CPU Adam op on first use (~1 min); the runs before it keep the GPU busy meanwhile.
    python3 -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('CPUAdamBuilder').load()" \
        >"$out/deepspeed_op_build.log" 2>&1 &
fi
python3 scripts/gpu_check.py --out "$out" "$@"

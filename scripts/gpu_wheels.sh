#!/usr/bin/env bash
# Build or download, into a folder, the wheels the GPU check machine lacks. It has no network and
# its python3 (3.12, x86_64) already holds torch, transformers, accelerate, safetensors, tokenizers,
# pandas, pyarrow, xxhash, psutil, ninja, msgpack, py-cpuinfo (docs/toolchain.md#the-gpu-check-machine); it
# lacks deepspeed, datasets and a few of their pure-Python dependencies.
#   bash scripts/gpu_wheels.sh wheels        # then carry wheels/ with the working tree
set -euo pipefail
out="${1:-wheels}"
python_version="${GPU_PYTHON_VERSION:-3.12}"
mkdir -p "$out"

# deepspeed publishes no wheel: build one from its sdist, without dependencies. Its C++/CUDA ops
# are compiled just in time on first use, on the machine that runs them.
deepspeed_version="$(python3 -c 'from importlib.metadata import version; print(version("deepspeed"))' 2>/dev/null || echo 0.19.8)"
pip wheel --quiet --no-deps --no-build-isolation -w "$out" "deepspeed==${deepspeed_version}"

# Everything else as published wheels for the GPU machine's Python and platform.
pip download --quiet --no-deps --only-binary=:all: \
    --python-version "$python_version" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$out" \
    "datasets>=4.0,<6" dill multiprocess hjson pydantic pydantic-core annotated-types typing-inspection

du -sh "$out"
ls "$out"

# First version (not yet built: no Docker engine runs on the project's build machines; see the
# README's status table). Runs any recipe with any config on CUDA GPUs:
#   docker build -t accelerate-recipes .
#   docker run --gpus all --rm accelerate-recipes \
#       --config_file accelerate_configs/single_gpu.yaml recipes/train.py --preset small
# A devel image: DeepSpeed compiles its CUDA ops just in time and needs nvcc.
ARG BASE_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HOME=/data/hf_home

WORKDIR /workspace

# Dependencies first, from pyproject.toml alone, so a code change does not reinstall them.
# The base image's torch satisfies the torch requirement and is kept.
COPY pyproject.toml README.md ./
RUN mkdir common && touch common/__init__.py \
    && pip install ".[trackers]" \
    && pip uninstall -y accelerate-recipes \
    && rm -rf common

COPY common/ common/
COPY recipes/ recipes/
COPY accelerate_configs/ accelerate_configs/
RUN pip install --no-deps -e .

VOLUME ["/data"]
ENTRYPOINT ["accelerate", "launch"]
CMD ["recipes/train.py"]

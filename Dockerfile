# The training image: CUDA, PyTorch, DeepSpeed and the recipes, entry point `accelerate launch`.
# BUILT ONLY ON A LOCAL DEBIAN BASE WITH THE CPU TORCH: scripts/docker/drill.sh builds this file on
# a CPU build machine with BASE_IMAGE = Debian bookworm (debootstrap, imported) and torch 2.13.0+cpu
# from a local index, then trains, preempts and resumes in it (benchmarks/results/docker-drill-2026-12-01/).
# The CUDA base below (the default) has NEVER BEEN BUILT here: no registry can be reached from the
# project's machines, so neither the nvidia/cuda image nor the cu130 torch has been pulled or run.
# tests/test_deploy.py lints this file (hadolint), checks what it copies and launches, and replays
# its install steps (scripts/docker/install.sh) in a fresh virtual environment on CPU.
#   docker build -t accelerate-recipes .
#   docker run --gpus all --rm --ipc=host --stop-timeout 330 \
#       -v "$PWD/outputs:/workspace/outputs" -v hf_home:/hf_home -e WANDB_API_KEY \
#       accelerate-recipes --config_file accelerate_configs/fsdp.yaml recipes/train.py --preset 1b
#
# Assumed, not checked (no registry can be reached from here): that this base tag exists and that
# torch ${TORCH_VERSION} has a build on ${TORCH_INDEX_URL}. What is known: the GPU check machine ran
# torch 2.11.0+cu130 with driver 580 (benchmarks/results/gpu_check-2026-11-30/). Keep the CUDA major
# of the base equal to the torch build's (cu130 -> 13): DeepSpeed refuses to compile its ops when
# nvcc's CUDA major differs from torch's.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04
FROM ${BASE_IMAGE}

# A devel (not runtime) image: DeepSpeed compiles its ops just in time with nvcc, g++ and Python's
# headers. tini is PID 1 (see ENTRYPOINT). Apt versions are not pinned (DL3008): the base tag fixes
# the Ubuntu release, and exact versions leave Ubuntu's archive after updates, breaking rebuilds.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ tini ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# The user that trains: not root, uid 1000 (the usual first user of a host, so a bind-mounted host
# folder owned by that user is writable). Ubuntu's images already give uid 1000 to `ubuntu`.
ARG USER_UID=1000
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && groupadd --gid "${USER_UID}" trainer \
    && useradd --create-home --uid "${USER_UID}" --gid trainer --shell /bin/bash trainer \
    && mkdir -p /workspace/outputs /hf_home \
    && chown trainer:trainer /workspace/outputs /hf_home

# One virtual environment, owned by root: what the image installed cannot be changed by the run.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}
RUN python3 -m venv /opt/venv

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/hf_home \
    PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300 \
    TORCH_EXTENSIONS_DIR=/hf_home/torch_extensions
# HF_HOME: models, datasets and the tokenised-data cache on a volume, kept between runs.
# TORCH_EXTENSIONS_DIR: DeepSpeed's ops (CPU Adam for ZeRO offload), compiled at first use on the machine
# that runs them and kept on the same volume for every later container there. Not built into the image:
# DeepSpeed compiles them with -march=native and the SIMD width of the CPU it builds on, so ops built on
# the image's build machine could hit illegal instructions on another CPU (docs/clusters.md#docker).
# PET_SIGNALS_TO_HANDLE: torchelastic (accelerate launch with several processes) forwards SIGUSR1
# to the workers too (`docker kill -s USR1` = checkpoint and stop). TORCH_ELASTIC_SHUTDOWN_TIMEOUT:
# seconds the workers get to save after a forwarded signal before torchelastic SIGKILLs them
# (default 30); `docker stop`/`docker run --stop-timeout` and Kubernetes' grace period must be longer.

WORKDIR /workspace
# Install steps: all in scripts/docker/install.sh, one phase per RUN, cheapest to change last, so
# that a code change reinstalls nothing and a dependency change does not download torch again.
COPY scripts/docker/install.sh scripts/docker/install.sh

# 1. torch, pinned, from PyTorch's CUDA index: the multi-GB layer.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
RUN bash scripts/docker/install.sh torch

# 2. Every other dependency, from pyproject.toml alone.
ARG EXTRAS=deepspeed,trackers,lora
COPY pyproject.toml ./
RUN bash scripts/docker/install.sh deps

# 3. The code, installed in place (editable) without touching the dependencies.
COPY README.md ./
COPY common/ common/
COPY train_extras/ train_extras/
COPY recipes/ recipes/
COPY accelerate_configs/ accelerate_configs/
COPY configs/ configs/
COPY tools/ tools/
COPY scripts/docker/entrypoint.sh scripts/docker/entrypoint.sh
RUN bash scripts/docker/install.sh project

# Numeric, so that Kubernetes' runAsNonRoot can check it (it cannot resolve a user name).
USER ${USER_UID}:${USER_UID}
# Runs write to /workspace/outputs (train.py's default --output_dir outputs/run is relative to the
# working folder); mount a host folder or a named volume on both, or they die with the container.
VOLUME ["/workspace/outputs", "/hf_home"]

# tini as PID 1 reaps zombies and, with -g, passes `docker stop`'s SIGTERM to the whole process
# group; entrypoint.sh runs `accelerate launch "$@"` and keeps the container alive until a signalled
# worker has saved its checkpoint (see the script for why tini alone is not enough).
ENTRYPOINT ["tini", "-g", "--", "bash", "/workspace/scripts/docker/entrypoint.sh"]
CMD ["--config_file", "accelerate_configs/single_gpu.yaml", "recipes/train.py"]

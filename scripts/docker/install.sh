#!/usr/bin/env bash
# The image's install steps, one phase per Dockerfile RUN, so that tests/test_deploy.py replays
# exactly what the image does (in a fresh virtual environment, on CPU). Runs in the image's
# working folder (/workspace) with the target environment's `python` first on PATH.
#   torch    torch==$TORCH_VERSION from $TORCH_INDEX_URL (empty: pip's own index)
#   deps     every dependency of the project, from pyproject.toml alone (+ the extras in $EXTRAS)
#   project  the project itself, editable, without touching the dependencies
set -euo pipefail

case "${1:-}" in
torch)
    # Its own phase and layer: the multi-GB download changes only with the torch version.
    # A pinned version: an open range would let a later step swap the build for another one.
    python -m pip install "torch==${TORCH_VERSION:?}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    ;;
deps)
    # pip resolves `.[extras]` only for a buildable project, and the code is not copied yet (so
    # that a code or README change does not invalidate this layer): empty stand-ins for common/
    # and the README that pyproject.toml names are installed, then removed again together with
    # the metadata that building them left behind.
    if [[ -e common ]]; then
        echo "install.sh deps: run it before the code is copied (common/ exists in $PWD)" >&2
        exit 1
    fi
    stand_ins=(common build)
    if [[ ! -e README.md ]]; then
        touch README.md
        stand_ins+=(README.md)
    fi
    mkdir common && touch common/__init__.py
    python -m pip install ".[${EXTRAS:?}]"
    python -m pip uninstall --yes accelerate-recipes
    rm -rf "${stand_ins[@]}" ./*.egg-info
    ;;
project)
    # Editable: the image runs the copied files in place, as a checkout does.
    python -m pip install --no-deps --editable .
    ;;
*)
    echo "usage: install.sh torch|deps|project" >&2
    exit 2
    ;;
esac

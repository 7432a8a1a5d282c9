#!/usr/bin/env bash
# Re-lock the exact versions (and sha256 of every file PyPI serves for them) of each install set, one file per set,
# under requirements/: after changing a dependency in pyproject.toml, run this, then the suite from a fresh venv
# installed from requirements/test.lock (.ci/run does that). Needs uv (`pip install uv`).
#
#   runtime.lock  the runtime and a server (serve, postgres, objectstore): no torch
#   cuda.lock     the same on NVIDIA GPUs (the cuda extra: jax's CUDA 12 plugin and CUDA wheels)
#   tpu.lock      the same on TPU hosts, and `runtime fit` on any machine (the tpu extra: libtpu)
#   export.lock   the runtime and the export side (torch's CPU wheel, torchax, diffusers, transformers)
#   test.lock     what CI installs: export, serve, test, savedmodel, postgres, objectstore, tpu
#
# Linux x86_64, Python 3.11. torch is the CPU build (2.13.0+cpu): PyPI's torch wheel for Linux is the CUDA one,
# which pulls several GB of CUDA libraries; TORCH_CPU says where the CPU wheel is (default: this machine's
# /opt/wheels if present, else PyTorch's CPU index).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${TORCH_CPU:-}" ]; then
    if [ -d /opt/wheels ]; then TORCH_CPU="--find-links /opt/wheels"
    else TORCH_CPU="--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match"; fi
fi
lock() {  # NAME EXTRA...
    local name=$1; shift
    local extras=()
    for e in "$@"; do extras+=(--extra "$e"); done
    # shellcheck disable=SC2086  # TORCH_CPU is several arguments
    uv pip compile pyproject.toml "${extras[@]}" --generate-hashes --python-version 3.11 \
        --python-platform x86_64-manylinux_2_31 $TORCH_CPU --no-emit-find-links --no-emit-index-url \
        --custom-compile-command "tools/lock.sh" -o "requirements/$name.lock" -q
}
mkdir -p requirements
lock runtime serve postgres objectstore
lock cuda serve cuda
lock tpu serve postgres objectstore tpu
lock export export
lock test export serve test savedmodel postgres objectstore tpu

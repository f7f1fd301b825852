#!/usr/bin/env bash
# NVRTC, CUDA's run-time compiler, for machines without CUDA: installs NVIDIA's wheel from PyPI
# (nvidia-cuda-nvrtc-cu12, about 90 MB to download, 220 MB installed) into a virtual environment
# of its own and prints the folder holding libnvrtc.so.12, for LD_LIBRARY_PATH. NVRTC needs no
# GPU and no driver: with it, the compression kernels (compiled at run time on a GPU machine)
# are compiled and their PTX checked here too (psnet-compression's
# the_kernels_compile_with_the_launches_parameters_and_no_fused_or_flushed_arithmetic):
#
#   LD_LIBRARY_PATH=$(bash scripts/nvrtc.sh) PSNET_REQUIRE_NVRTC=1 \
#       cargo test -p psnet-compression --features cuda --lib cuda::
#
# Env: PSNET_NVRTC_VENV (default $CARGO_TARGET_DIR or target/, then nvrtc-venv), PSNET_NVRTC
# (the pip requirement, default nvidia-cuda-nvrtc-cu12==12.9.86: CUDA 12.9, whose NVRTC still
# targets every architecture from Maxwell on). Needs Python's venv module (Debian:
# python3-venv, which scripts/setup.sh installs).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${PSNET_NVRTC_VENV:-${CARGO_TARGET_DIR:-$ROOT/target}/nvrtc-venv}
REQ=${PSNET_NVRTC:-nvidia-cuda-nvrtc-cu12==12.9.86}

find_lib() { find "$VENV" -name 'libnvrtc.so.*' ! -name '*builtins*' -print -quit 2>/dev/null || true; }

lib=$(find_lib)
if [ -z "$lib" ]; then
    [ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV" >&2
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$REQ" >&2
    lib=$(find_lib)
fi
[ -n "$lib" ] || { echo "nvrtc.sh: $REQ installed no libnvrtc.so.* under $VENV" >&2; exit 1; }
dirname "$lib"

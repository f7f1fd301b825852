#!/usr/bin/env bash
# psnet's Python package (python/: pyo3 + maturin): builds its wheel, installs it with NumPy
# and pytest in a virtual environment of its own, and runs python/tests. The tests start real
# jobs on 127.0.0.1: collectives ranks as Python processes, kv jobs (scheduler, servers,
# workers) under psnet-launch, which this script builds.
#
#   bash scripts/test-python.sh            every test
#   bash scripts/test-python.sh -k kvstore pytest's arguments
#
# Env: PYTHON (the interpreter to build for, default python3), PSNET_VENV (default
# target/python-venv), PSNET_TORCH (the torch requirement, default torch==2.15.0; none: skip),
# CARGO_TARGET_DIR. Needs the PyPI registry the first time (maturin,
# numpy, pytest) and Python's venv module (Debian: python3-venv, which scripts/setup.sh
# installs).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
VENV=${PSNET_VENV:-$TARGET/python-venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "== a virtual environment in $VENV (${PYTHON:-python3})"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check \
  "maturin>=1.9.4,<2" "numpy>=1.21" "pytest>=7"
# PyTorch for the torch.distributed backend's tests: PyPI's Linux wheel brings CUDA's
# libraries (about 5.5 GB installed, 3 GB more in pip's cache, which later runs reuse).
# Without that much room the tests skip and say why.
TORCH=${PSNET_TORCH:-torch==2.15.0}
if "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  :
elif [ "$TORCH" = none ]; then
  echo "SKIPPED: torch not installed (PSNET_TORCH=none): the torch backend's tests skip"
elif [ "$(df -Pm "$VENV" | awk 'NR == 2 { print $4 }')" -lt 12000 ]; then
  echo "SKIPPED: torch not installed: it needs about 12 GB of free disk here; the torch backend's tests skip"
else
  echo "== $TORCH (the torch backend's tests)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH"
fi
echo "== psnet-launch and psnet-doctor (the tests' launcher, the flight recorder's reader)"
cargo build --locked -p psnet-launch -p psnet-recorder
echo "== the wheel (maturin build)"
rm -rf "$TARGET/wheels"
"$VENV/bin/maturin" build --locked -m python/Cargo.toml -o "$TARGET/wheels"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps \
  "$TARGET"/wheels/psnet-*.whl
echo "== pytest python/tests"
# From the repository's root: python/ on sys.path would shadow the installed package with its
# sources (which lack the native module).
PSNET_LAUNCH="$TARGET/debug/psnet-launch" "$VENV/bin/python" -m pytest -q python/tests "$@"

#!/usr/bin/env bash
# psnet.mxnet against MXNet 1.9.1 (python/tests/test_mxnet.py): MXNet's last release has wheels
# for Python 3.10 and older only, so this makes a Python 3.10 (or 3.9) virtual environment
# with MXNet 1.9.1 and NumPy 1.23.5, builds psnet's wheel for it, and runs the tests, among
# them a gluon script trained over psnet and over MXNet's own dist_sync, whose weights must
# match bit for bit.
#
#   bash scripts/test-mxnet.sh            every test of python/tests/test_mxnet.py
#   bash scripts/test-mxnet.sh -k gluon   pytest's arguments
#
# Env: PYTHON310 (the interpreter; default: python3.10, python3.9, then pyenv's),
# PSNET_MXNET_VENV (default target/mxnet-venv), CARGO_TARGET_DIR. Needs PyPI the first time.
# Where no such Python exists or MXNet cannot be installed, prints SKIPPED with the reason and
# exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
VENV=${PSNET_MXNET_VENV:-$TARGET/mxnet-venv}
fits() { "$1" -c 'import sys; sys.exit(not ((3, 9) <= sys.version_info[:2] <= (3, 10)))' 2>/dev/null; }
PY=
for c in "${PYTHON310:-}" python3.10 python3.9 "$HOME"/.pyenv/versions/3.10*/bin/python3 \
         "$HOME"/.pyenv/versions/3.9*/bin/python3; do
  # pyenv's shims exist on PATH even when no such version is selected: each is tried.
  if [ -n "$c" ] && fits "$c"; then PY=$c; break; fi
done
if [ ! -x "$VENV/bin/python" ]; then
  if [ -z "$PY" ]; then
    echo "SKIPPED: psnet.mxnet's tests: no Python 3.9 or 3.10 here (MXNet 1.9.1 has no wheel for newer ones); set PYTHON310"
    exit 0
  fi
  echo "== a Python $("$PY" -c 'import platform; print(platform.python_version())') environment in $VENV"
  "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check mxnet==1.9.1 numpy==1.23.5 \
     "pytest>=7" "maturin>=1.9.4,<2"; then
  echo "SKIPPED: psnet.mxnet's tests: MXNet 1.9.1 could not be installed in $VENV"
  exit 0
fi
echo "== psnet-launch (the tests' launcher)"
cargo build --locked -p psnet-launch
echo "== psnet's wheel for $VENV/bin/python"
rm -rf "$TARGET/mxnet-wheels"
"$VENV/bin/maturin" build --locked -m python/Cargo.toml -i "$VENV/bin/python" -o "$TARGET/mxnet-wheels"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps \
  "$TARGET"/mxnet-wheels/psnet-*.whl
echo "== pytest python/tests/test_mxnet.py"
PSNET_LAUNCH="$TARGET/debug/psnet-launch" "$VENV/bin/python" -m pytest -q python/tests/test_mxnet.py "$@"

#!/usr/bin/env bash
# Puts psnet-launch, psnet-train and psnet-perf on PATH (cargo's bin directory, usually
# ~/.cargo/bin, which rustup adds to PATH), so that the commands in README.md and docs/ work as pasted.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
for crate in launcher train perf; do
  cargo install --locked --quiet --path "$crate"
done
bin="${CARGO_INSTALL_ROOT:-${CARGO_HOME:-$HOME/.cargo}}/bin"
echo "install: psnet-launch, psnet-train and psnet-perf are in $bin"
case ":$PATH:" in
  *":$bin:"*) ;;
  *) echo "install: add it to PATH: export PATH=\"$bin:\$PATH\"" ;;
esac

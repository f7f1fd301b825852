#!/usr/bin/env bash
# Installs what building and testing psnet needs on Debian 12 (apt packages only; nothing is
# downloaded from outside the package registries). Run as root, or with sudo available.
#   iproute2              the network-namespace tests (ib0/eth0 veth pairs)
#   cmake make clang libclang-dev
#                         building sideway's rdma-mummy-sys (libibverbs is loaded at run time,
#                         so rdma-core is needed neither to build nor to run the tests)
#   gcc                   the linker rustc calls, and the raw TCP ping-pong reference of the
#                         benchmarks
#   ca-certificates       cargo's HTTPS downloads of the crates
#   python3 python3-venv  the Python package's build and tests (scripts/test-python.sh)
# Already installed packages are left alone; a machine without apt-get is told what to install.
set -euo pipefail
PACKAGES=(iproute2 cmake make clang libclang-dev gcc ca-certificates python3 python3-venv)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} = 0 ]; then
  echo "setup: ${PACKAGES[*]} already installed"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: no apt-get here; install these (or your system's equivalents): ${missing[*]}" >&2
  exit 1
fi
SUDO=
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "setup: run as root (apt-get needs it)" >&2; exit 1; }
  SUDO=sudo
fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null

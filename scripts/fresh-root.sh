#!/usr/bin/env bash
# Proves the README's first command on a clean Debian 12: builds a minimal Debian 12 root with
# debootstrap, lends it this machine's Rust toolchain and crate cache (a fresh machine "with
# the Rust toolchain", as CI's) and this checkout, and runs there exactly
#     bash scripts/setup.sh && cargo run --release -p psnet-train
# with a target directory of its own, so every system package the build needs must come from
# scripts/setup.sh. Needs root (debootstrap, chroot, mounts). Exit status: the command's.
# Env: FRESH_ROOT (default /var/tmp/psnet-fresh-root), MIRROR (a Debian mirror).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
ROOT=${FRESH_ROOT:-/var/tmp/psnet-fresh-root}
# The host's own Debian mirror first (as scripts/rxe-vm/run.sh does), else Debian's.
MIRROR=${MIRROR:-$(grep -h -m1 '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}')}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
RUSTUP=${RUSTUP_HOME:-$HOME/.rustup}
CARGO=${CARGO_HOME:-$HOME/.cargo}
say() { echo "fresh-root: $*"; }
[ "$(id -u)" = 0 ] || { say "needs root (debootstrap, chroot)"; exit 1; }
command -v debootstrap >/dev/null || {
  say "installing debootstrap"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap
}

mounts=()
cleanup() {
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount -l "${mounts[i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
bind() { # bind SRC DST [ro]
  mkdir -p "$2"
  mount --bind "$1" "$2"
  mounts+=("$2")
  if [ "${3:-}" = ro ]; then mount -o remount,bind,ro "$2"; fi
}

t0=$(date +%s)
say "debootstrap --variant=minbase bookworm $ROOT ($MIRROR)"
rm -rf "$ROOT"
debootstrap --variant=minbase bookworm "$ROOT" "$MIRROR" > /tmp/psnet-fresh-root.log 2>&1 \
  || { tail -20 /tmp/psnet-fresh-root.log; exit 1; }
say "root built in $(( $(date +%s) - t0 )) s"
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
mount -t proc proc "$ROOT/proc"; mounts+=("$ROOT/proc")
bind /dev "$ROOT/dev"
bind /sys "$ROOT/sys"
bind "$RUSTUP" "$ROOT/opt/rustup" ro
bind "$CARGO" "$ROOT/opt/cargo"
bind "$REPO" "$ROOT/psnet"

t1=$(date +%s)
rc=0
chroot "$ROOT" /usr/bin/env -i HOME=/root TERM=dumb \
  PATH=/opt/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  RUSTUP_HOME=/opt/rustup CARGO_HOME=/opt/cargo CARGO_TARGET_DIR=/root/target \
  CARGO_TERM_COLOR=never \
  /bin/bash -c 'cd /psnet && bash scripts/setup.sh && cargo run --release -p psnet-train' \
  || rc=$?
say "the README's first command exited $rc after $(( $(date +%s) - t1 )) s in the fresh root"
# The root (its packages and its build output, GBs) is not needed after this run: each run
# builds it anew. Unmount first, and delete only once nothing is mounted under it any more
# (the checkout and the toolchain are bind mounts in there).
cleanup
mounts=()
if grep -q " $ROOT/" /proc/mounts; then
  say "something is still mounted under $ROOT: left in place"
else
  rm -rf "$ROOT"
fi
exit $rc

#!/bin/bash
# psnet: run real verbs (Soft-RoCE / rdma_rxe) inside a Debian 12 qemu guest.
#
# The CI host has no RDMA hardware and its kernel has no InfiniBand stack, so the
# guest brings its own: debootstrap'd Debian 12 + stock kernel + rdma-core/perftest.
# Steps (each under `timeout`):
#   1. host packages (qemu-system-x86, debootstrap) if missing
#   2. guest rootfs, cached in $W/rootfs (rebuilt only if the recipe below changes)
#   3. ext4 image from that directory (mke2fs -d: no loop mount)
#   4. boot under qemu TCG, guest-init.sh as PID 1, $W/share exported over 9p
# Exit status 0 only if the guest printed `RXE-RESULT: PASS`.
#
# Usage (as root):  bash scripts/rxe-vm/run.sh
# Env: W (work dir, default /var/tmp/psnet-rxe-vm), SHARE (dir exported to the guest,
#      default $W/share; put hook.sh + test binaries there), MIRROR, SMP, MEM,
#      GUEST_DEADLINE (guest watchdog, s), QEMU_TIMEOUT (host-side kill, s), ACCEL.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
W=${W:-/var/tmp/psnet-rxe-vm}
SHARE=${SHARE:-$W/share}
SMP=${SMP:-2}
MEM=${MEM:-2048}
# TCG only: /dev/kvm on these machines is kvm_pvm, and a stock Debian kernel hangs at
# boot under -accel kvm. Override only on a host with real KVM.
ACCEL=${ACCEL:-tcg}
GUEST_DEADLINE=${GUEST_DEADLINE:-600}
QEMU_TIMEOUT=${QEMU_TIMEOUT:-$((GUEST_DEADLINE + 120))}
# Use the Debian mirror this host already uses (first URIs: line of its deb822 sources).
MIRROR=${MIRROR:-$(grep -h -m1 '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}')}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
GUEST_PKGS=linux-image-amd64,rdma-core,ibverbs-providers,ibverbs-utils,rdmacm-utils,perftest,iproute2,kmod,procps
# Bump when the rootfs recipe changes in a way the package list doesn't show.
ROOTFS_RECIPE="v1 bookworm minbase $GUEST_PKGS"

say() { echo "rxe-vm: $*"; }
die() { echo "rxe-vm: ERROR: $*" >&2; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$(now)" -v b="$1" 'BEGIN{printf "%.1f", a-b}'; }
# run NAME TIMEOUT CMD... : run a step under timeout, die with a clear message on failure
run() {
  local name=$1 t=$2; shift 2
  local rc=0
  timeout -k 10 "$t" "$@" || rc=$?
  if [ $rc -ne 0 ]; then
    [ $rc -eq 124 ] && die "$name timed out after ${t}s"
    die "$name failed (exit $rc)"
  fi
}

[ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot, apt-get)"
mkdir -p "$W" "$SHARE"
# one run at a time per work dir (the rootfs cache is shared)
exec 9>"$W/.lock"
flock -n 9 || die "another run.sh holds $W/.lock"
cd "$W"
T0=$(now)

# ---- 1. host packages ------------------------------------------------------------
# The host ships qemu-utils from bookworm-backports, which Breaks bookworm's own
# qemu-system (7.2): qemu-system-x86 must come from bookworm-backports as well.
t=$(now)
if ! command -v qemu-system-x86_64 >/dev/null || ! command -v debootstrap >/dev/null \
   || ! command -v mke2fs >/dev/null; then
  say "installing host packages (qemu-system-x86, debootstrap from bookworm-backports)"
  if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    cat > /etc/apt/sources.list.d/psnet-rxe-vm-backports.sources <<SRC
Types: deb
URIs: $MIRROR
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  fi
  run "apt-get update" 300 apt-get update -q
  run "apt-get install" 600 env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
      --no-install-recommends -t bookworm-backports qemu-system-x86 debootstrap e2fsprogs
fi
say "TIMING host_packages=$(since "$t")s ($(qemu-system-x86_64 --version | head -1))"

# ---- 2. guest rootfs (cached) ----------------------------------------------------
t=$(now)
if [ ! -e rootfs/.done ] || [ "$(cat rootfs/.done)" != "$ROOTFS_RECIPE" ]; then
  say "building guest rootfs with debootstrap from $MIRROR (1.5-4 min)"
  rm -rf rootfs rootfs.tmp
  run debootstrap 1200 debootstrap --variant=minbase --include="$GUEST_PKGS" \
      bookworm rootfs.tmp "$MIRROR"
  # a headless test guest needs no docs, apt caches, or GPU/sound/wifi/media drivers
  rm -rf rootfs.tmp/var/cache/apt/archives/*.deb rootfs.tmp/var/lib/apt/lists/* \
         rootfs.tmp/usr/share/doc/* rootfs.tmp/usr/share/man/* rootfs.tmp/usr/share/locale/*
  KV=$(basename "$(echo rootfs.tmp/usr/lib/modules/*)")
  KM=rootfs.tmp/usr/lib/modules/$KV/kernel
  [ -d "$KM" ] || die "no kernel modules in the rootfs (linux-image-amd64 missing?)"
  rm -rf "$KM"/drivers/gpu "$KM"/drivers/net/wireless "$KM"/drivers/media "$KM"/sound \
         "$KM"/drivers/staging "$KM"/drivers/bluetooth "$KM"/drivers/iio
  run depmod 120 chroot rootfs.tmp depmod -a "$KV"
  # Small initrd: only what is needed to mount the root disk. Boot to init drops from
  # ~20 s to ~12 s under TCG. Everything else (rdma_rxe, 9p, dummy) is modprobed by
  # guest-init.sh from the root fs.
  echo 'MODULES=list' > rootfs.tmp/etc/initramfs-tools/conf.d/psnet-rxe.conf
  printf 'virtio_pci\nvirtio_blk\next4\n' >> rootfs.tmp/etc/initramfs-tools/modules
  run update-initramfs 300 chroot rootfs.tmp update-initramfs -u -k "$KV"
  echo "$ROOTFS_RECIPE" > rootfs.tmp/.done
  mv rootfs.tmp rootfs
else
  say "using cached rootfs in $W/rootfs"
fi
say "TIMING rootfs=$(since "$t")s"

KV=$(basename "$(echo rootfs/usr/lib/modules/*)")
cp "rootfs/boot/vmlinuz-$KV" vmlinuz
cp "rootfs/boot/initrd.img-$KV" initrd.img
install -m 0755 "$HERE/guest-init.sh" rootfs/psnet-rxe-init.sh

# ---- 3. root image ---------------------------------------------------------------
# Rebuilt every run (a few seconds) so guest-init.sh changes are always picked up;
# qemu opens it with snapshot=on, so the guest never modifies it.
t=$(now)
rm -f rootfs.img
run mke2fs 300 mke2fs -q -t ext4 -L psnetrxe -d rootfs rootfs.img 1200M
say "TIMING image=$(since "$t")s"

# ---- 4. boot and run the guest checks --------------------------------------------
rm -f "$SHARE/guest-result"
if [ -e "$SHARE/hook.sh" ]; then say "share/hook.sh present: the guest will run it"; fi
CPU=max; [ "$ACCEL" = kvm ] && CPU=host
APPEND="root=LABEL=psnetrxe rw console=ttyS0 panic=-1 quiet loglevel=4"
APPEND="$APPEND init=/psnet-rxe-init.sh rxe_deadline=$GUEST_DEADLINE"
say "booting guest (accel=$ACCEL smp=$SMP mem=${MEM}M, guest watchdog ${GUEST_DEADLINE}s, host timeout ${QEMU_TIMEOUT}s)"
t=$(now)
set +e
# No NIC: everything RDMA runs on a dummy interface inside the guest.
# -no-reboot + panic=-1: if init dies, qemu exits instead of looping.
timeout -k 10 "$QEMU_TIMEOUT" qemu-system-x86_64 -accel "$ACCEL" -cpu "$CPU" \
    -smp "$SMP" -m "$MEM" -kernel vmlinuz -initrd initrd.img -append "$APPEND" \
    -drive file=rootfs.img,if=virtio,format=raw,snapshot=on \
    -virtfs local,path="$SHARE",mount_tag=share,security_model=none,id=share \
    -nic none -nographic -no-reboot < /dev/null 2>&1 | tr -d '\r' | tee guest.log
QRC=${PIPESTATUS[0]}
set -e
say "TIMING qemu=$(since "$t")s (qemu exit $QRC)"
say "TIMING total=$(since "$T0")s"
[ "$QRC" = 124 ] && say "qemu was killed after ${QEMU_TIMEOUT}s (guest hung?)"

# The verdict is the exact line the guest prints last; anything else is a failure.
if grep -qx 'RXE-RESULT: PASS' guest.log; then
  say "PASS (log: $W/guest.log)"
  exit 0
fi
say "FAIL: $(grep -m1 '^RXE-RESULT:' guest.log || echo 'guest printed no RXE-RESULT line') (log: $W/guest.log)"
exit 1

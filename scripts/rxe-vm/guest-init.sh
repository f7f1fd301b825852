#!/bin/sh
# psnet rxe-vm guest init: runs as PID 1 in the qemu guest (init=/psnet-rxe-init.sh).
# Creates a Soft-RoCE device rxe0 on a dummy interface, checks it with perftest,
# runs the host's share/hook.sh if present, prints `RXE-RESULT: PASS|FAIL`, powers off.
# Kernel cmdline: rxe_deadline=SECONDS (watchdog).
# No `set -e`: PID 1 must never exit early (the kernel would panic); failures are counted.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
IFACE=dummy0
ADDR=192.168.77.1        # exists only inside the guest (the guest has no NIC at all)
FAIL=0

up() { cut -d' ' -f1 /proc/uptime; }
log() { echo "GUEST[$(up)]: $*"; }
poweroff_now() { sync; echo o > /proc/sysrq-trigger; sleep 30; }
# step NAME TIMEOUT CMD... : run under timeout, log rc and duration, count failures
step() {
  name=$1; t=$2; shift 2
  s=$(up); log "BEGIN $name: $*"
  timeout -k 5 "$t" "$@"; rc=$?
  log "END $name rc=$rc took=$(awk -v a="$(up)" -v b="$s" 'BEGIN{printf "%.1f", a-b}')s"
  [ $rc -eq 0 ] || FAIL=$((FAIL + 1))
  return $rc
}
# pair NAME TIMEOUT "SERVER CMD" "CLIENT CMD" : server in the background, then the
# client, which is retried while the server is still starting up (TCG is slow).
# Both outputs are printed (perftest prints its result table on both sides).
pair() {
  name=$1; t=$2; srv=$3; cli=$4
  timeout -k 5 "$t" $srv > /tmp/$name.srv 2>&1 & sp=$!
  sleep 2
  s=$(up); log "BEGIN $name: server: $srv | client: $cli"
  i=0
  while :; do
    timeout -k 5 "$t" $cli > /tmp/$name.cli 2>&1; rc=$?
    i=$((i + 1))
    # retry only "could not connect" failures, and only while the server is alive
    [ $rc -ne 0 ] && [ $i -lt 10 ] && kill -0 $sp 2>/dev/null \
      && grep -qiE "connect|Couldn't" /tmp/$name.cli || break
    sleep 1
  done
  [ $rc -eq 0 ] || kill $sp 2>/dev/null
  wait $sp; src=$?
  log "--- $name client output"; cat /tmp/$name.cli
  log "--- $name server output"; cat /tmp/$name.srv
  log "END $name client_rc=$rc server_rc=$src tries=$i took=$(awk -v a="$(up)" -v b="$s" 'BEGIN{printf "%.1f", a-b}')s"
  [ $rc -eq 0 ] && [ $src -eq 0 ] || FAIL=$((FAIL + 1))
}

mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sys /sys
mountpoint -q /dev || mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp; mount -t tmpfs tmpfs /run
log "init started (kernel $(uname -r), nproc=$(nproc), $(awk '/MemTotal/{print $2" kB"}' /proc/meminfo))"

# Watchdog: whatever hangs, the guest powers off by the deadline.
DEADLINE=600
for a in $(cat /proc/cmdline); do case $a in rxe_deadline=*) DEADLINE=${a#rxe_deadline=};; esac; done
( sleep "$DEADLINE"; echo "GUEST: WATCHDOG after ${DEADLINE}s"; echo "RXE-RESULT: FAIL (watchdog)"
  poweroff_now ) &

# Host share (9p): hook.sh and test binaries; the result is also written back here.
SHARE=
if modprobe 9pnet_virtio && modprobe 9p && mkdir -p /mnt/share \
   && mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 share /mnt/share; then
  SHARE=/mnt/share; log "9p share mounted at $SHARE"
else
  log "no 9p share (continuing without hook)"
fi

# Soft-RoCE on a dummy interface. Not lo: on lo plain verbs work but rdma_cm fails
# (rdma_resolve_route: No such device), and psnet uses rdma_cm.
ip link set lo up
# (modprobe dummy already creates dummy0: numdummies defaults to 1)
step dummy 30 sh -c "modprobe dummy && { ip link show $IFACE >/dev/null 2>&1 \
  || ip link add $IFACE type dummy; } && ip addr add $ADDR/24 dev $IFACE && ip link set $IFACE up"
step modprobe_rxe 60 modprobe rdma_rxe
modprobe ib_uverbs 2>/dev/null
if ! step rdma_link_add 30 rdma link add rxe0 type rxe netdev $IFACE; then
  log "no rxe0 device, nothing else can run"
  echo "RXE-RESULT: FAIL (rdma link add)"; poweroff_now
fi
rdma link show; rdma dev show
G=/sys/class/infiniband/rxe0/ports/1
# The port goes ACTIVE (and the GID table fills) asynchronously after the link comes up.
st=; i=0
while [ $i -lt 20 ]; do read -r st < $G/state; case $st in *ACTIVE*) break;; esac; sleep 0.5; i=$((i + 1)); done
log "rxe0 port 1 state: $st"
case $st in *ACTIVE*) ;; *) FAIL=$((FAIL + 1)); log "port not ACTIVE (is $IFACE up?)";; esac

# GIDs: read only the first few entries, with shell builtins. The table has 1024
# entries and forking a `cat` per entry takes ~60 s under TCG.
# Pick the RoCE v2 GID holding $ADDR as an IPv4-mapped address (::ffff:c0a8:4d01).
GIDX=
for i in 0 1 2 3 4 5 6 7; do
  read -r v < $G/gids/$i || continue
  case $v in 0000:0000:0000:0000:0000:0000:0000:0000) continue;; esac
  ty=; read -r ty < $G/gid_attrs/types/$i 2>/dev/null
  log "gid[$i]=$v type=$ty"
  case "$v:$ty" in 0000:0000:0000:0000:0000:ffff:c0a8:4d01:"RoCE v2") [ -z "$GIDX" ] && GIDX=$i;; esac
done
if [ -z "$GIDX" ]; then log "no RoCE v2 GID for $ADDR found, trying index 1"; GIDX=1; FAIL=$((FAIL + 1)); fi
log "using dev=rxe0 netdev=$IFACE addr=$ADDR gid_index=$GIDX"

step ibv_devices 30 ibv_devices
step ibv_devinfo 30 ibv_devinfo -d rxe0

# perftest, server and client in this guest, out-of-band exchange over TCP on $ADDR.
# Small volumes: under TCG code runs many times slower than on the host.
# -F: don't fail because the cpufreq governor isn't "performance" (it's a VM).
BW="ib_write_bw -d rxe0 -x $GIDX -F -s 65536 -n 1000 --report_gbits"
pair ib_write_bw 120 "$BW" "$BW $ADDR"
LAT="ib_write_lat -d rxe0 -x $GIDX -F -s 8 -n 1000"
pair ib_write_lat 120 "$LAT" "$LAT $ADDR"
# rdma_cm end to end (address + route resolution through the dummy interface).
pair rping 60 "rping -s -a $ADDR -C 10 -v" "rping -c -a $ADDR -C 10 -v"

# Soft-RoCE packet counters: evidence the traffic really went through rxe.
for c in sent_pkts rcvd_pkts; do [ -r $G/hw_counters/$c ] && log "rxe0 $c=$(cat $G/hw_counters/$c)"; done

# psnet's hook: test binaries put in the share by the host (see README.md).
if [ -n "$SHARE" ] && [ -e $SHARE/hook.sh ]; then
  RXE_DEV=rxe0 RXE_GID_INDEX=$GIDX RXE_ADDR=$ADDR RXE_NETDEV=$IFACE RXE_SHARE=$SHARE \
    step hook "$DEADLINE" sh $SHARE/hook.sh   # the watchdog bounds it anyway
else
  log "no share/hook.sh, skipping"
fi

if [ $FAIL -eq 0 ]; then R=PASS; else R="FAIL ($FAIL checks failed)"; fi
[ -n "$SHARE" ] && echo "$R" > $SHARE/guest-result
log "done"
echo "RXE-RESULT: $R"
poweroff_now

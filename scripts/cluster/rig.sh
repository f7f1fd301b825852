#!/usr/bin/env bash
# An emulated cluster on one machine: H "hosts" as network namespaces on a switch (a bridge in
# a namespace of its own), each with an `eth0` shaped both ways to a rate (tc tbf), optionally a
# second interface `ib0` on a second bridge, so that DMLC_INTERFACE picks between them as on a
# real ib0/eth0 machine. Latency is NOT emulated: this kernel has no netem, so a message's
# time is its size over the rate plus the kernel's own few microseconds.
#
#   rig.sh up [--name N] [--hosts H] [--rate RATE] [--ib RATE] [--mtu BYTES]
#   rig.sh down [--name N]                  everything named psnet-N-*, also after a failure
#   rig.sh exec [--name N] HOST CMD...      CMD inside host HOST (0-based index or h0, h1, ...),
#                                           with the ssh stand-in first on PATH
#   rig.sh counters [--name N]              bytes sent and received on each host's eth0
#   rig.sh hostfile [--name N]              the path of the job's hostfile (h1.. hH-1, h0 last)
#   rig.sh status [--name N]
#
# RATE is tc's syntax (1gbit, 200mbit). Hosts are named h0..h{H-1}; eth0 has 10.240.X.(i+1)
# and ib0 10.241.X.(i+1), X derived from the rig's name, so several rigs can coexist. Nothing
# here reaches an address outside these namespaces. State lives in /run/psnet-cluster/N/.
# Each host has its own temporary directory, /run/psnet-cluster/N/hI/tmp, as TMPDIR in
# `rig.sh exec` and through the ssh stand-in: the namespaces share one /tmp and one host name,
# and Open MPI's daemons, which name their session directories by host name, removed each
# other's (mpirun failed about one start in 15).
# Jobs start through psnet's own launcher: scripts/cluster/bin/ssh, first on PATH inside
# `rig.sh exec`, runs `ssh hI CMD` in host hI's namespace, so `psnet-launch --launcher ssh -H
# HOSTFILE` (and mpirun with it as plm_rsh_agent) run across the hosts unchanged.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NAME=${PSNET_CLUSTER:-rig}
HOSTS=4
RATE=1gbit
IB_RATE=
MTU=1500

die() { echo "rig: $*" >&2; exit 1; }

cmd=${1:-}
[ -n "$cmd" ] || die "usage: rig.sh up|down|exec|counters|hostfile|status [--name N] ... (see the header)"
shift
while [ $# -gt 0 ]; do
  case "$1" in
    --name) NAME=$2; shift 2 ;;
    --hosts) HOSTS=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --ib) IB_RATE=$2; shift 2 ;;
    --mtu) MTU=$2; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[[ "$NAME" =~ ^[a-z0-9]{1,8}$ ]] || die "--name takes 1-8 lowercase letters or digits (interface names are short), got '$NAME'"
[[ "$HOSTS" =~ ^[0-9]+$ ]] && [ "$HOSTS" -ge 1 ] && [ "$HOSTS" -le 32 ] || die "--hosts takes 1..32, got '$HOSTS'"

STATE=/run/psnet-cluster/$NAME
SW=psnet-$NAME-sw
ns_of() { echo "psnet-$NAME-h$1"; }
# The third octet of the rig's subnets: a checksum of its name, so rigs of other names differ.
OCTET=$(( $(printf '%s' "$NAME" | cksum | cut -d' ' -f1) % 250 + 1 ))
eth_addr() { echo "10.240.$OCTET.$(( $1 + 1 ))"; }
ib_addr() { echo "10.241.$OCTET.$(( $1 + 1 ))"; }

# tbf's bucket: 2 ms of the rate, at least 64 KiB (a GSO packet must fit, or tbf drops it);
# its queue: 20 ms of the rate, like a switch port's buffer rather than an unbounded one.
shape() { # NS DEV RATE
  local bits burst
  bits=$(rate_bits "$3")
  burst=$(( bits / 8 / 500 )); [ "$burst" -ge 65536 ] || burst=65536
  ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$3" burst "$burst" latency 20ms
}

# RATE in bits per second (tc's units: bit, kbit, mbit, gbit; k = 1000).
rate_bits() {
  local r=${1,,}
  case "$r" in
    *gbit) echo $(( ${r%gbit} * 1000000000 )) ;;
    *mbit) echo $(( ${r%mbit} * 1000000 )) ;;
    *kbit) echo $(( ${r%kbit} * 1000 )) ;;
    *bit) echo "${r%bit}" ;;
    *) die "rate '$1': give it as Nbit, Nkbit, Nmbit or Ngbit" ;;
  esac
}

down() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^psnet-$NAME-(sw|h[0-9]+)$" || true); do
    # Processes left in a host are ended first: a namespace with processes outlives `del`.
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$STATE"
}

up() {
  command -v ip >/dev/null && command -v tc >/dev/null || die "needs iproute2 (ip, tc): bash scripts/setup.sh"
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces)"
  rate_bits "$RATE" >/dev/null
  [ -z "$IB_RATE" ] || rate_bits "$IB_RATE" >/dev/null
  down
  trap 'echo "rig: set-up failed; tearing down psnet-$NAME-*" >&2; down' ERR
  mkdir -p "$STATE"
  ip netns add "$SW"
  ip -n "$SW" link set dev lo up
  ip -n "$SW" link add name br0 type bridge
  ip -n "$SW" link set dev br0 up
  if [ -n "$IB_RATE" ]; then
    ip -n "$SW" link add name br1 type bridge
    ip -n "$SW" link set dev br1 up
  fi
  : > "$STATE/hosts"
  for ((i = 0; i < HOSTS; i++)); do
    local ns
    ns=$(ns_of "$i")
    ip netns add "$ns"
    mkdir -p "$STATE/h$i/tmp"
    chmod 1777 "$STATE/h$i/tmp"
    ip -n "$ns" link set dev lo up
    # eth0 in the host, its switch port `eI` on br0; both ends shaped, so the host's link is
    # RATE each way, as a NIC and its switch port are.
    ip -n "$ns" link add name eth0 type veth peer name "e$i" netns "$SW"
    ip -n "$ns" link set dev eth0 mtu "$MTU"
    ip -n "$SW" link set dev "e$i" mtu "$MTU" master br0
    ip -n "$ns" addr add "$(eth_addr "$i")/24" dev eth0
    ip -n "$ns" link set dev eth0 up
    ip -n "$SW" link set dev "e$i" up
    shape "$ns" eth0 "$RATE"
    shape "$SW" "e$i" "$RATE"
    if [ -n "$IB_RATE" ]; then
      ip -n "$ns" link add name ib0 type veth peer name "i$i" netns "$SW"
      ip -n "$SW" link set dev "i$i" master br1
      ip -n "$ns" addr add "$(ib_addr "$i")/24" dev ib0
      ip -n "$ns" link set dev ib0 up
      ip -n "$SW" link set dev "i$i" up
      shape "$ns" ib0 "$IB_RATE"
      shape "$SW" "i$i" "$IB_RATE"
    fi
    echo "h$i $ns $(eth_addr "$i") $( [ -n "$IB_RATE" ] && ib_addr "$i" || echo -)" >> "$STATE/hosts"
  done
  # The hostfile psnet-launch takes: h0 (where the launcher and the scheduler run) last, so
  # servers and workers start on the other hosts first, as on a cluster with a head node.
  { for ((i = 1; i < HOSTS; i++)); do echo "h$i"; done; echo h0; } > "$STATE/hostfile"
  echo "$RATE" > "$STATE/rate"
  echo "${IB_RATE:-none}" > "$STATE/ib_rate"
  trap - ERR
  echo "rig $NAME: $HOSTS hosts, eth0 $RATE each way$( [ -n "$IB_RATE" ] && echo ", ib0 $IB_RATE each way"), MTU $MTU; latency not emulated (no netem)"
  cat "$STATE/hosts"
}

host_index() { # h3 | 3 -> 3
  local h=${1#h}
  [[ "$h" =~ ^[0-9]+$ ]] || die "host '$1': give an index or hI"
  grep -q "^h$h " "$STATE/hosts" 2>/dev/null || die "rig $NAME has no host h$h (is it up? rig.sh up --name $NAME)"
  echo "$h"
}

case "$cmd" in
  up) up ;;
  down) down; echo "rig $NAME: down" ;;
  exec)
    [ $# -ge 2 ] || die "exec HOST CMD..."
    i=$(host_index "$1"); shift
    exec ip netns exec "$(ns_of "$i")" env PATH="$HERE/bin:$PATH" PSNET_CLUSTER="$NAME" \
      TMPDIR="$STATE/h$i/tmp" "$@"
    ;;
  counters)
    [ -f "$STATE/hosts" ] || die "rig $NAME is not up"
    while read -r host ns _; do
      printf '%s %s %s\n' "$host" \
        "$(ip netns exec "$ns" cat /sys/class/net/eth0/statistics/tx_bytes)" \
        "$(ip netns exec "$ns" cat /sys/class/net/eth0/statistics/rx_bytes)"
    done < "$STATE/hosts"
    ;;
  hostfile) [ -f "$STATE/hostfile" ] || die "rig $NAME is not up"; echo "$STATE/hostfile" ;;
  status)
    [ -f "$STATE/hosts" ] || { echo "rig $NAME: down"; exit 0; }
    echo "rig $NAME: eth0 $(cat "$STATE/rate"), ib0 $(cat "$STATE/ib_rate")"
    cat "$STATE/hosts"
    ;;
  *) die "unknown command '$cmd' (up, down, exec, counters, hostfile, status)" ;;
esac

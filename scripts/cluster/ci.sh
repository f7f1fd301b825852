#!/usr/bin/env bash
# CI's run on the emulated cluster: 3 hosts (network namespaces), eth0 shaped to RATE (200mbit)
# each way and a second interface ib0, jobs started across them by psnet-launch --launcher ssh
# through the rig's ssh stand-in. Checks:
#   1. a kv training job, 2 servers + 2 workers over eth0, its weights bit-identical to the
#      one-process reference, with MXNet's layout and with keys in pieces
#      (PSNET_PARTITION_BYTES=4096), every process on the host the hostfile gave it;
#   2. the same job with DMLC_INTERFACE=ib0: every process picks ib0's address; and 2-bit
#      jobs (pushes only, and compressed pulls too), their codes packed (across hosts, the
#      default) and not (PSNET_PACK_CODES=0), the two jobs' weights bit-identical;
#   3. an allreduce across the 3 hosts (one rank per host), every result checked;
#   4. mpirun through the ssh stand-in (plm_rsh_agent), where Open MPI is installed.
# Prints `CHECK ok|FAILED what` per check and `N passed, N failed` last; exits non-zero if any
# failed. Where namespaces cannot be made (not root, no iproute2), prints SKIPPED with the
# reason and exits 0. Every job has a time limit; the rig is torn down at exit.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"
RATE=${RATE:-200mbit}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
B=$TARGET/release
RIG="$HERE/rig.sh"
export PSNET_CLUSTER=ci
OUT=$(mktemp -d /tmp/psnet-cluster-ci.XXXXXX)
passed=0
failed=0
check() { # WHAT STATUS
  if [ "$2" = 0 ]; then echo "CHECK ok $1"; passed=$((passed + 1))
  else echo "CHECK FAILED $1"; failed=$((failed + 1)); fi
}

if [ "$(id -u)" != 0 ]; then
  echo "SKIPPED: the emulated cluster needs root (network namespaces)"; exit 0
fi
if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "SKIPPED: the emulated cluster needs iproute2 (ip, tc): bash scripts/setup.sh"; exit 0
fi
if ! ip netns add psnet-ci-probe 2>"$OUT/probe"; then
  echo "SKIPPED: network namespaces cannot be made here: $(cat "$OUT/probe")"; exit 0
fi
ip netns del psnet-ci-probe

echo "cluster-ci: release build"
cargo build --release --locked -q -p psnet-perf -p psnet-launch -p psnet-train || exit 1
trap 'bash "$RIG" down --name ci >/dev/null 2>&1; rm -rf "$OUT"' EXIT
bash "$RIG" up --name ci --hosts 3 --rate "$RATE" --ib 1gbit || exit 1
addr() { awk -v h="$1" -v c="$2" '$1 == h { print $c }' /run/psnet-cluster/ci/hosts; }

# 1 and 2. Small model: the job's shape, not its size, is what this checks.
MODEL=(--hidden 64 --features 32 --classes 5 --samples 2048 --batch 32 --epochs 2)
"$B/psnet-train" "${MODEL[@]}" --reference --workers 2 --dump "$OUT/ref.bin" > "$OUT/ref.log" 2>&1
check "one-process reference" $?
# Servers on h1 and h2, workers on h0 and h1 (psnet-launch takes the hostfile's lines in turn).
printf 'h1\nh2\nh0\nh1\n' > "$OUT/hosts"
TRAIN_ARGS=()
run_job() { # NAME IFACE ENV... (psnet-train's arguments past the model's: TRAIN_ARGS)
  local name=$1 iface=$2; shift 2
  bash "$RIG" exec --name ci h0 env DMLC_INTERFACE="$iface" PS_VERBOSE=1 "$@" timeout -k 5 240 \
    "$B/psnet-launch" --launcher ssh -H "$OUT/hosts" -s 2 -n 2 -- "$B/psnet-train" "${MODEL[@]}" \
    "${TRAIN_ARGS[@]}" --dump "$OUT/$name.bin" > "$OUT/$name.log" 2>&1
}
# The address each process chose, as "[role i] address" lines.
chosen() { sed -n 's/^\[\([a-z]* *[0-9]*\)\].*psnet transport selected address=\([0-9.]*\).*/\1 \2/p' "$1" | sort; }
for job in "mxnet-layout:PSNET_PARTITION_BYTES=0" "pieces:PSNET_PARTITION_BYTES=4096"; do
  name=${job%%:*}; env=${job#*:}
  run_job "$name" eth0 "$env"; rc=$?
  [ $rc = 0 ] || tail -20 "$OUT/$name.log"
  cmp -s "$OUT/ref.bin" "$OUT/$name.bin"; same=$?
  want="scheduler $(addr h0 3)
server 0 $(addr h1 3)
server 1 $(addr h2 3)
worker 0 $(addr h0 3)
worker 1 $(addr h1 3)"
  got=$(chosen "$OUT/$name.log")
  [ "$got" = "$want" ]; placed=$?
  [ $placed = 0 ] || printf 'wanted:\n%s\ngot:\n%s\n' "$want" "$got"
  check "kv 2+2 across 3 hosts by ssh ($name): exit $rc, weights identical to the reference: $([ $same = 0 ] && echo yes || echo no), each process on its host: $([ $placed = 0 ] && echo yes || echo no)" \
    $(( rc != 0 || same != 0 || placed != 0 ))
done
run_job ib0 ib0; rc=$?
[ $rc = 0 ] || tail -20 "$OUT/ib0.log"
cmp -s "$OUT/ref.bin" "$OUT/ib0.bin"; same=$?
n_ib=$(chosen "$OUT/ib0.log" | awk '{ print $NF }' | grep -c '^10\.241\.' || true)
check "kv over DMLC_INTERFACE=ib0: exit $rc, identical: $([ $same = 0 ] && echo yes || echo no), $n_ib of 5 processes on ib0's addresses" \
  $(( rc != 0 || same != 0 || n_ib != 5 ))
# Packed codes are lossless: the same job with them (across hosts, the default) and without.
# A wider model, so that the codes are most of the bytes the jobs send.
SMALL_MODEL=("${MODEL[@]}")
MODEL=(--hidden 256 --features 256 --classes 5 --samples 1024 --batch 32 --epochs 1)
# Each mode with the least saving packing must show (pushes only: their pulls carry floats).
for mode in "2bit:1:" "2bit-pull:5:--compression-pull"; do
  IFS=: read -r name saving flags <<< "$mode"
  TRAIN_ARGS=(--compression 2bit $flags)
  bash "$RIG" counters --name ci > "$OUT/c0"
  run_job "$name-packed" eth0 PSNET_PARTITION_BYTES=4096; rc1=$?
  bash "$RIG" counters --name ci > "$OUT/c1"
  run_job "$name-plain" eth0 PSNET_PARTITION_BYTES=4096 PSNET_PACK_CODES=0; rc2=$?
  bash "$RIG" counters --name ci > "$OUT/c2"
  # Bytes sent by every host's eth0 during each job.
  sent() { awk 'NR == FNR { tx[$1] = $2; next } { s += $2 - tx[$1] } END { printf "%.0f", s }' "$1" "$2"; }
  packed_bytes=$(sent "$OUT/c0" "$OUT/c1"); plain_bytes=$(sent "$OUT/c1" "$OUT/c2")
  [ $rc1 = 0 ] || tail -20 "$OUT/$name-packed.log"
  [ $rc2 = 0 ] || tail -20 "$OUT/$name-plain.log"
  cmp -s "$OUT/$name-packed.bin" "$OUT/$name-plain.bin"; same=$?
  check "kv $name across 3 hosts, codes packed and not: exits $rc1 and $rc2, weights identical: $([ $same = 0 ] && echo yes || echo no), bytes sent $packed_bytes packed against $plain_bytes (at least $saving% fewer)" \
    $(( rc1 != 0 || rc2 != 0 || same != 0 || packed_bytes * 100 > plain_bytes * (100 - saving) ))
done
TRAIN_ARGS=()
MODEL=("${SMALL_MODEL[@]}")

# 3. Allreduce, one rank per host, every size checked (psnet-perf -c 1 counts wrong elements).
root="$(addr h0 3):29500"
for i in 0 1 2; do
  bash "$RIG" exec --name ci "h$i" env PSNET_RANK=$i PSNET_WORLD_SIZE=3 PSNET_ROOT_ADDR="$root" \
    DMLC_INTERFACE=eth0 timeout -k 5 180 "$B/psnet-perf" allreduce -b 8 -e 4M -f 8 -n 3 -w 1 -c 1 --json \
    > "$OUT/ar.$i" 2> "$OUT/ar.$i.err" &
done
rcs=0
for job in $(jobs -p); do wait "$job" || rcs=$((rcs + 1)); done
rows=$(grep -c '"busbw_gb_s"' "$OUT/ar.0" || true)
wrong=$(grep -o '"wrong":[0-9]*' "$OUT/ar.0" | cut -d: -f2 | awk '{ s += $1 } END { print s + 0 }')
[ $rcs = 0 ] || tail -5 "$OUT"/ar.*.err
check "allreduce on 3 hosts: $rcs ranks failed, $rows sizes, $wrong wrong elements" $(( rcs != 0 || rows < 4 || wrong != 0 ))

# 4. mpirun through the stand-in.
if command -v mpirun >/dev/null && mpirun --version 2>/dev/null | grep -q "Open MPI"; then
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 bash "$RIG" exec --name ci h0 \
    timeout -k 5 60 mpirun --allow-run-as-root --mca plm_rsh_agent "$HERE/bin/ssh" -H h0,h1,h2 -np 3 \
    sh -c 'echo "$OMPI_COMM_WORLD_RANK $(hostname -I | cut -d" " -f1)"' > "$OUT/mpi" 2>"$OUT/mpi.err"
  rc=$?
  got=$(sort "$OUT/mpi" | tr '\n' ' ')
  want="0 $(addr h0 3) 1 $(addr h1 3) 2 $(addr h2 3) "
  check "mpirun with the ssh stand-in as plm_rsh_agent: rank i on host i ($got)" $(( rc != 0 )) 
  [ "$got" = "$want" ] || { echo "mpirun placed: $got, wanted: $want"; failed=$((failed + 1)); }
  [ $rc = 0 ] && [ "$got" = "$want" ] || tail -30 "$OUT/mpi.err"
else
  echo "SKIPPED: mpirun through the stand-in (no Open MPI here)"
fi

echo "cluster: $passed passed, $failed failed"
[ "$failed" = 0 ]

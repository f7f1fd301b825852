#!/usr/bin/env bash
# psnet where the link is the bottleneck: the emulated cluster (scripts/cluster/rig.sh, HOSTS
# network namespaces, every eth0 shaped both ways to RATE), jobs started across its hosts by
# psnet-launch --launcher ssh (and mpirun) through the rig's ssh stand-in. Prints, per section
# and in one run, psnet beside its reference and beside the wire bound: the bytes the busiest
# link must carry (in its busier direction, or both directions one after the other where the
# protocol makes them wait for each other) over RATE. Latency is not emulated (no netem here).
#
#   bash scripts/bench-cluster.sh [SECTION...]     SECTION: raw train kv rows allreduce compressed alltoall ddp fsdp2 (default all)
#
# raw        iperf3 between two hosts, one way and both ways at once (the link as TCP sees it)
# train      psnet-train seconds of communication per epoch, 2 servers + 2 workers: MXNet's key
#            layout (PSNET_PARTITION_BYTES=0), the default, the default with a job secret (every
#            frame tagged), with the secret and PSNET_ENCRYPT=1, 2-bit and 1-bit, each of those with
#            compressed pulls too (--compression-pull), and the default and compressed pulls again
#            with PSNET_TCP_CONGESTION=cubic; the bound is the busiest link's bytes in its
#            busier direction (counted by the kernel) per epoch; epoch s is the whole epoch.
#            by-layer / by-layer-fifo: a call per tensor, last layer's first, as backward hooks
#            start them (--by-layer), with priority scheduling (PSNET_KV_PRIORITY=1, the
#            default) and without: the last column is when the first layer was back
# kv         one key per op, push / pull / push then pull / pushpull, psnet's Python kvstore
#            against MXNet 1.9.1 (scripts/bench-mxnet.py, one script for both), uncompressed and
#            2-bit, KV_SIZES at each of KV_SHAPES (servers x workers; servers on hosts of their
#            own, workers over the other hosts in turn, so 2x4 puts two workers on each)
# rows       a sparse model's step on a ROWS_SHAPE (1000000x64) float32 embedding table, 1% of its
#            rows touched a step, 2 servers + 2 workers: the touched rows pushed and pulled back
#            (psnet's push_rows / pull_rows, MXNet's row_sparse push / row_sparse_pull; servers
#            run SGD) beside a dense push + pull of the table in the same job, psnet's Python
#            kvstore against MXNet 1.9.1 (scripts/bench-rows.py, one script for both), and
#            psnet-perf kv --sparse; the bound is a worker's link carrying its rows each way
# allreduce  psnet-perf allreduce, one rank per host, against Open MPI (mpi4py, btl tcp,self)
#            started by mpirun through the ssh stand-in; busbw against the link's rate
# compressed psnet-perf allreduce --compression 2bit and 1bit against the plain allreduce on the
#            same ranks, one and two ranks per host (HOSTS and 2 x HOSTS ranks): times, the
#            speed-up, and the code bytes each rank sends against 2(n-1)/n of the codes
# alltoall   torch's all_to_all_single, A2A_MIB (64) MiB sent by each rank, one rank per host, on
#            psnet's backend against gloo (python/benchmarks/alltoall.py, PSNET_SHM_RING=0);
#            busbw against the link's rate
# fsdp2      an FSDP2 step (python/benchmarks/fsdp2_step.py: the DDP MLP, each layer under
#            fully_shard), one rank per host, psnet's backend against gloo
# ddp        a DDP step (python/benchmarks/ddp_step.py's MLP, 9.45 M parameters, CPU), one rank
#            per host, on psnet's torch.distributed backend against gloo (sockets only:
#            PSNET_SHM_RING=0); needs torch in target/bench-venv (PSNET_TORCH, default
#            torch==2.15.0, is installed there when missing; none skips)
#
# Settings (environment): HOSTS (4), RATE (1gbit), EPOCHS (2), SAMPLES (4096), TRAIN_RUNS (the train
# runs to make, by name, e.g. "default 2bit-pull"; all when unset), TRAIN_EXTRA (more train runs,
# always made, each NAME:ENV,...:COMPRESSION:FLAGS, e.g. "big:PSNET_PARTITION_BYTES=1048576:2bit:
# --compression-pull"; commas in FLAGS part its flags), AR_ITERS (10), KV_SIZES
# (4M,16M), KV_SHAPES ("2x2 2x4"), KV_ITERS (20 timed operations of each kind per size; the
# median is reported), AR_MIN / AR_MAX (1M / 64M), MXNET_PY (target/mxnet-venv's
# python; made with python3.10, mxnet==1.9.1 and numpy==1.23.5 when missing; MXNET=0 skips),
# KEEP (a directory for the logs). Release builds only: the binaries are built here with
# --release, the Python wheel with maturin --release, and a debug wheel is refused.
# Needs root; the rig is named `bench` and torn down at exit, after a failure too.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
HOSTS=${HOSTS:-4}
RATE=${RATE:-1gbit}
EPOCHS=${EPOCHS:-2}
SAMPLES=${SAMPLES:-4096}
KV_SIZES=${KV_SIZES:-4M,16M}
KV_SHAPES=${KV_SHAPES:-"2x2 2x4"}
KV_ITERS=${KV_ITERS:-20}
AR_MIN=${AR_MIN:-1M}
AR_MAX=${AR_MAX:-64M}
AR_ITERS=${AR_ITERS:-10}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
B=$TARGET/release
RIG="$ROOT/scripts/cluster/rig.sh"
export PSNET_CLUSTER=bench
SECTIONS=("$@")
[ ${#SECTIONS[@]} -gt 0 ] || SECTIONS=(raw train kv rows allreduce compressed alltoall ddp fsdp2)
LOGS=${KEEP:-$(mktemp -d)}
mkdir -p "$LOGS"
say() { echo "bench-cluster: $*" >&2; }
# The allreduce sections' reader of psnet-perf's (and bench-mpi-allreduce.py's) JSON Lines:
# rows(path) is {bytes: row} of the lines that hold a measurement.
export BENCH_ROWS_PY='
def rows(path):
    out = {}
    for line in open(path):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "busbw_gb_s" in r:
            out[r["bytes"]] = r
    return out
'
wants() { local s; for s in "${SECTIONS[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
[ "$(id -u)" = 0 ] || { say "needs root (network namespaces)"; exit 1; }

say "release build (benchmarks never use a debug build)"
cargo build --release --locked -q -p psnet-train -p psnet-perf -p psnet-launch

bash "$RIG" up --name bench --hosts "$HOSTS" --rate "$RATE" >&2
trap 'bash "$RIG" down --name bench >/dev/null 2>&1 || true' EXIT
RATE_BITS=$(awk -v r="${RATE,,}" 'BEGIN { n = r + 0; u = substr(r, length(n "") + 1);
  m = (u == "gbit") ? 1e9 : (u == "mbit") ? 1e6 : (u == "kbit") ? 1e3 : 1; printf "%.0f", n * m }')
addr_of() { awk -v h="$1" '$1 == h { print $3 }' "/run/psnet-cluster/bench/hosts"; }
on() { local h=$1; shift; bash "$RIG" exec --name bench "$h" "$@"; }

# The busiest link in its busier direction between two `rig.sh counters` snapshots, in bytes.
busiest() { # BEFORE AFTER
  awk 'NR == FNR { tx[$1] = $2; rx[$1] = $3; next }
       { t = $2 - tx[$1]; r = $3 - rx[$1]; m = (t > r) ? t : r; if (m > best) best = m }
       END { printf "%.0f", best }' "$1" "$2"
}
ms_of_bytes() { awk -v b="$1" -v r="$RATE_BITS" 'BEGIN { printf "%.1f", b * 8 / r * 1000 }'; }

# A hostfile for S servers on hosts of their own and W workers over the other hosts in turn
# (psnet-launch gives servers, then workers, the hostfile's lines in order).
hostfile() { # S W FILE
  local s=$1 w=$2 f=$3 all=() rest=() i
  for ((i = 1; i < HOSTS; i++)); do all+=("h$i"); done
  all+=(h0)
  [ "$s" -lt "$HOSTS" ] || { say "$s servers need more than $HOSTS hosts"; return 1; }
  : > "$f"
  for ((i = 0; i < s; i++)); do echo "${all[$i]}" >> "$f"; done
  rest=("${all[@]:$s}")
  for ((i = 0; i < w; i++)); do echo "${rest[$((i % ${#rest[@]}))]}" >> "$f"; done
}

launch() { # S W HOSTFILE ENV... -- CMD...
  local s=$1 w=$2 hf=$3; shift 3
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  on h0 env DMLC_INTERFACE=eth0 "${envs[@]}" timeout -k 5 900 "$B/psnet-launch" --launcher ssh \
    -H "$hf" -s "$s" -n "$w" -- "$@"
}

VENV=$TARGET/bench-venv
# Runs a torch.distributed step script on every host, rank i on host i, and waits:
# torch_ranks PORT SCRIPT LOG ARGS... (rank i's output goes to LOG.i).
torch_ranks() {
  local port=$1 script=$2 log=$3; shift 3
  local i
  for ((i = 0; i < HOSTS; i++)); do
    on "h$i" env RANK=$i WORLD_SIZE=$HOSTS LOCAL_RANK=0 MASTER_ADDR="$(addr_of h0)" \
      MASTER_PORT=$port DMLC_INTERFACE=eth0 GLOO_SOCKET_IFNAME=eth0 PSNET_SHM_RING=0 \
      OMP_NUM_THREADS=1 timeout -k 5 600 "$VENV/bin/python" "$script" "$@" > "$log.$i" 2>&1 &
  done
  wait
}

WHEEL_BUILT=
# psnet's Python package, release build, in $VENV (a debug wheel is refused).
release_wheel() {
  [ -z "$WHEEL_BUILT" ] || return 0
  if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV"; fi
  "$VENV/bin/pip" install -q --disable-pip-version-check "maturin>=1.9.4,<2" "numpy>=1.21"
  rm -rf "$TARGET/bench-wheels"
  "$VENV/bin/maturin" build --release --locked -q -m python/Cargo.toml -o "$TARGET/bench-wheels" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps "$TARGET"/bench-wheels/psnet-*.whl
  local profile
  profile=$("$VENV/bin/python" -c 'import psnet._psnet as p; print(getattr(p, "BUILD_PROFILE", "unknown"))')
  [ "$profile" = release ] || { say "the psnet wheel is a $profile build: refused"; exit 1; }
  WHEEL_BUILT=1
}

echo "# psnet on the emulated cluster: $HOSTS hosts, eth0 $RATE each way (tc tbf), latency not emulated"
echo "# $(date -u +%FT%TZ), $(nproc) CPUs shared by every host; logs in $LOGS"
# The congestion control matters here: on this rig psnet-train was 1.22x the wire bound with
# BBR and 1.11x with cubic (PSNET_TCP_CONGESTION=cubic), the allreduce 0.86-0.96 of the link
# with BBR and 0.95-0.96 with cubic. Every side of a comparison runs with the system's.
echo "# TCP congestion control: $(sysctl -n net.ipv4.tcp_congestion_control 2>/dev/null || echo unknown) (the system's, for every side)"

if wants raw; then
  echo
  echo "## raw TCP between two hosts (iperf3)"
  if command -v iperf3 >/dev/null; then
    a2=$(addr_of h2)
    for mode in "" --bidir; do
      on h2 timeout 30 iperf3 -s -1 -B "$a2" >/dev/null 2>&1 &
      sleep 0.5
      rate=$(on h1 timeout 30 iperf3 -c "$a2" -t 4 -f m $mode 2>&1 | awk '/receiver/ { v = $(NF-2) " " $(NF-1); print v }' | paste -sd' ')
      wait
      echo "iperf3 ${mode:-one way}: $rate (receiver)"
    done
  else
    echo "SKIPPED: no iperf3 (apt-get install iperf3)"
  fi
fi

if wants train; then
  echo
  echo "## psnet-train, 2 servers + 2 workers (one per host), $EPOCHS epochs of $SAMPLES samples"
  printf '%-34s %14s %16s %8s %10s %10s  %s\n' "run" "comm s/epoch" "bound s/epoch" "ratio" "epoch s" "loss" \
    "first layer back (--by-layer), ms of the step's"
  hostfile 2 2 "$LOGS/train.hosts"
  # With a job secret every frame carries a session tag: its cost, in the same run.
  (umask 077; echo "bench-cluster secret $$ $RANDOM" > "$LOGS/secret")
  # With PSNET_ENCRYPT too, every data frame is also encrypted.
  for run in "mxnet-layout:PSNET_PARTITION_BYTES=0:none" "default::none" \
             "secret:PSNET_SECRET_FILE=$LOGS/secret:none" \
             "encrypted:PSNET_SECRET_FILE=$LOGS/secret,PSNET_ENCRYPT=1:none" "2bit::2bit" "1bit::1bit" \
             "2bit-pull::2bit:--compression-pull" "1bit-pull::1bit:--compression-pull" \
             "by-layer:PSNET_KV_PRIORITY=1:none:--by-layer" \
             "by-layer-fifo:PSNET_KV_PRIORITY=0:none:--by-layer" \
             "default-cubic:PSNET_TCP_CONGESTION=cubic:none" \
             "2bit-pull-cubic:PSNET_TCP_CONGESTION=cubic:2bit:--compression-pull" \
             "1bit-pull-cubic:PSNET_TCP_CONGESTION=cubic:1bit:--compression-pull" \
             ${TRAIN_EXTRA:-}; do
    IFS=: read -r name env comp extra <<< "$run"
    [ -z "${TRAIN_RUNS:-}" ] || [[ " $TRAIN_RUNS " == *" $name "* ]] \
      || [[ " ${TRAIN_EXTRA:-} " == *" $run "* ]] || continue
    IFS=, read -ra envs <<< "$env"
    bash "$RIG" counters --name bench > "$LOGS/c0"
    launch 2 2 "$LOGS/train.hosts" "${envs[@]}" -- "$B/psnet-train" --epochs "$EPOCHS" \
      --samples "$SAMPLES" --compression "$comp" ${extra//,/ } > "$LOGS/train.$name.log" 2>&1 \
      || { say "psnet-train $name failed:"; tail -20 "$LOGS/train.$name.log" >&2; exit 1; }
    bash "$RIG" counters --name bench > "$LOGS/c1"
    comm=$(grep -o 'communication [0-9.]* s of [0-9.]* s' "$LOGS/train.$name.log" | grep -v "^$" | head -n "$EPOCHS" \
      | awk '{ s += $2 } END { printf "%.2f", s / NR }')
    epoch=$(grep -o 'communication [0-9.]* s of [0-9.]* s' "$LOGS/train.$name.log" | head -n "$EPOCHS" \
      | awk '{ s += $5 } END { printf "%.2f", s / NR }')
    loss=$(grep -o 'loss [0-9.]*' "$LOGS/train.$name.log" | tail -1 | cut -d' ' -f2)
    first=$(grep -o 'first layer back after [0-9.]* ms of [0-9.]* ms' "$LOGS/train.$name.log" | tail -1 \
      | awk '{ printf "%s of %s (%.0f%%)", $5, $8, 100 * $5 / $8 }' || true)
    bound=$(awk -v b="$(busiest "$LOGS/c0" "$LOGS/c1")" -v r="$RATE_BITS" -v e="$EPOCHS" \
      'BEGIN { printf "%.2f", b * 8 / r / e }')
    printf '%-34s %14s %16s %8s %10s %10s  %s\n' "$name ($comp)" "$comm" "$bound" \
      "$(awk -v a="$comm" -v b="$bound" 'BEGIN { printf "%.2fx", a / b }')" "$epoch" "$loss" "${first:--}"
  done
  echo "(bound: the busiest link's bytes in its busier direction over the whole job, set-up included, per epoch, over $RATE)"
fi

if wants kv; then
  echo
  echo "## kv, one key, per worker: psnet's Python kvstore against MXNet 1.9.1 (scripts/bench-mxnet.py)"
  release_wheel
  MXNET_PY=${MXNET_PY:-$TARGET/mxnet-venv/bin/python}
  if [ "${MXNET:-1}" != 0 ] && [ ! -x "$MXNET_PY" ]; then
    py310=$(command -v python3.10 || ls /root/.pyenv/versions/3.10*/bin/python 2>/dev/null | head -1 || true)
    if [ -n "$py310" ]; then
      "$py310" -m venv "$TARGET/mxnet-venv" && "$TARGET/mxnet-venv/bin/pip" install -q \
        --disable-pip-version-check mxnet==1.9.1 numpy==1.23.5 || true
    fi
  fi
  libs=(psnet)
  if [ "${MXNET:-1}" != 0 ] && "$MXNET_PY" -c 'import mxnet' 2>/dev/null; then libs+=(mxnet)
  else echo "SKIPPED MXNet: no MXNet 1.9.1 at $MXNET_PY (python3.10 -m venv; pip install mxnet==1.9.1 numpy==1.23.5)"; fi
  printf '%-6s %-6s %-5s %9s  %-10s %9s %9s %7s\n' shape comp lib size op ms bound_ms ratio
  for shape in $KV_SHAPES; do
    s=${shape%x*}; w=${shape#*x}
    hostfile "$s" "$w" "$LOGS/kv.hosts"
    # Workers per host: the most any host has.
    k=$(tail -n "$w" "$LOGS/kv.hosts" | sort | uniq -c | awk '{ if ($1 > m) m = $1 } END { print m }')
    for comp in none 2bit; do
      for lib in "${libs[@]}"; do
        py=$VENV/bin/python; [ "$lib" = mxnet ] && py=$MXNET_PY
        out="$LOGS/kv.$shape.$comp.$lib"
        launch "$s" "$w" "$LOGS/kv.hosts" PS_VERBOSE=0 -- "$py" "$ROOT/scripts/bench-mxnet.py" "$KV_SIZES" \
          --lib "$lib" --compression "$comp" --iters "$KV_ITERS" > "$out.log" 2>&1 \
          || { say "kv $lib $shape $comp failed:"; tail -20 "$out.log" >&2; continue; }
        grep -h '"results"' "$out.log" | sed 's/^\[[^]]*\] //' | tail -1 > "$out.json"
        python3 - "$out.json" "$s" "$w" "$k" "$comp" "$RATE_BITS" "$shape" "$lib" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
s, w, k = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
comp, rate, shape, lib = sys.argv[5], float(sys.argv[6]), sys.argv[7], sys.argv[8]
for r in doc["results"]:
    b = r["bytes"]
    # The busiest link carries, each way, what its workers send or what its server receives.
    load = max(k * b, w * b / s)
    up = load / 16 if comp == "2bit" else load  # MXNet pulls full weights
    bound = {"push": up, "pull": load, "push+pull": up + load,
             # one pushpull: pieces' answers overlap later pieces' pushes (psnet)
             "pushpull1": max(up, load)}
    for op in ("push", "pull", "push+pull", "pushpull1"):
        if f"{op}_ms" not in r:
            continue
        bms = bound[op] * 8 / rate * 1e3
        print(f"{shape:<6} {comp:<6} {lib:<5} {b >> 20:>7}Mi  {op:<10} {r[op + '_ms']:9.1f} {bms:9.1f} {r[op + '_ms'] / bms:6.2f}x")
PY
      done
    done
  done
  echo "(bound: per op, the bytes the busiest link carries each way (max of a worker host's and a server's share) over $RATE; push then pull waits for the push, so its bound is their sum; 2-bit pushes 1/16 of the bytes, pulls are full)"
fi

if wants rows; then
  ROWS_SHAPE=${ROWS_SHAPE:-1000000x64}
  rows_n=${ROWS_SHAPE%x*}; rows_w=${ROWS_SHAPE#*x}
  echo
  echo "## a sparse model's step, $ROWS_SHAPE float32, 1% of the rows a step, 2 servers + 2 workers"
  release_wheel
  MXNET_PY=${MXNET_PY:-$TARGET/mxnet-venv/bin/python}
  hostfile 2 2 "$LOGS/rows.hosts"
  printf '%-12s %12s %12s %10s %12s %12s %12s
' lib dense_step_ms row_step_ms ratio dense_pull_ms row_pull_ms bound_ms
  # A worker's link carries its rows up (values and the 24-byte range list), then down.
  touched=$((rows_n / 100))
  bound=$(ms_of_bytes $((2 * touched * (rows_w * 4 + 24))))
  for lib in psnet mxnet perf; do
    py=$VENV/bin/python; [ "$lib" = mxnet ] && py=$MXNET_PY
    if [ "$lib" = mxnet ] && ! "$MXNET_PY" -c 'import mxnet' 2>/dev/null; then
      echo "SKIPPED MXNet: no MXNet 1.9.1 at $MXNET_PY"; continue
    fi
    out="$LOGS/rows.$lib.log"
    if [ "$lib" = perf ]; then
      launch 2 2 "$LOGS/rows.hosts" -- "$B/psnet-perf" kv --sparse "$ROWS_SHAPE" --json > "$out" 2>&1 \
        || { say "psnet-perf kv --sparse failed:"; tail -20 "$out" >&2; continue; }
    else
      launch 2 2 "$LOGS/rows.hosts" PS_VERBOSE=0 -- "$py" "$ROOT/scripts/bench-rows.py" --lib "$lib" \
        --rows "$rows_n" --width "$rows_w" > "$out" 2>&1 \
        || { say "bench-rows $lib failed:"; tail -20 "$out" >&2; continue; }
    fi
    python3 - "$out" "$lib" "$bound" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    line = line[line.find("{"):]
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if "row_step_ms" not in r:
        continue
    ratio = r["dense_step_ms"] / r["row_step_ms"]
    print(f"{sys.argv[2]:<12} {r['dense_step_ms']:12.1f} {r['row_step_ms']:12.1f} {ratio:9.1f}x "
          f"{r['dense_pull_ms']:12.1f} {r['row_pull_ms']:12.1f} {float(sys.argv[3]):12.1f}")
PY
  done
  echo "(psnet: scripts/bench-rows.py on psnet's Python kvstore; perf: psnet-perf kv --sparse; bound: a worker's rows up and back over $RATE)"
fi

if wants allreduce; then
  echo
  echo "## allreduce, float32 sum, $HOSTS ranks (one per host): psnet against Open MPI"
  port=29400
  root="$(addr_of h0):$port"
  for ((i = 0; i < HOSTS; i++)); do
    on "h$i" env PSNET_RANK=$i PSNET_WORLD_SIZE=$HOSTS PSNET_ROOT_ADDR="$root" DMLC_INTERFACE=eth0 \
      timeout -k 5 600 "$B/psnet-perf" allreduce -b "$AR_MIN" -e "$AR_MAX" -n "$AR_ITERS" -w 3 --json \
      > "$LOGS/ar.psnet.$i" 2> "$LOGS/ar.psnet.$i.err" &
  done
  wait
  grep -h '"in_place":true' "$LOGS/ar.psnet.0" > "$LOGS/ar.psnet.json" || true
  # Debian's mpi4py belongs to Debian's python3, whatever python3 is first on PATH.
  MPI_PY=${MPI_PY:-/usr/bin/python3}
  if command -v mpirun >/dev/null && "$MPI_PY" -c 'import mpi4py, numpy' 2>/dev/null; then
    hosts=$(for ((i = 0; i < HOSTS; i++)); do printf 'h%d,' "$i"; done)
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 on h0 timeout -k 5 600 mpirun \
      --allow-run-as-root --mca plm_rsh_agent "$ROOT/scripts/cluster/bin/ssh" -H "${hosts%,}" \
      -np "$HOSTS" --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include eth0 \
      --mca oob_tcp_if_include eth0 "$MPI_PY" "$ROOT/scripts/bench-mpi-allreduce.py" \
      -b "$AR_MIN" -e "$AR_MAX" -n "$AR_ITERS" -w 3 > "$LOGS/ar.mpi.json" 2> "$LOGS/ar.mpi.err" \
      || { say "Open MPI's run failed:"; tail -5 "$LOGS/ar.mpi.err" >&2; }
  else
    echo "SKIPPED Open MPI: needs openmpi-bin, python3-mpi4py, python3-numpy"
    : > "$LOGS/ar.mpi.json"
  fi
  python3 - "$LOGS/ar.psnet.json" "$LOGS/ar.mpi.json" "$RATE_BITS" <<'PY'
import json, os, sys
exec(os.environ["BENCH_ROWS_PY"])
ps, mpi, link = rows(sys.argv[1]), rows(sys.argv[2]), float(sys.argv[3]) / 8 / 1e9
print(f"{'bytes':>10} {'psnet busbw GB/s':>17} {'of link':>8} {'Open MPI busbw':>15} {'psnet/MPI':>10} {'wrong':>6}")
for b in sorted(ps):
    p = ps[b]["busbw_gb_s"]
    m = mpi.get(b, {}).get("busbw_gb_s")
    print(f"{b:>10} {p:>17.4f} {p / link:>8.2f} {m if m else float('nan'):>15.4f} "
          f"{(p / m if m else float('nan')):>10.2f} {ps[b].get('wrong', 0):>6}")
print(f"(link: {link:.4f} GB/s each way; busbw = algbw x 2(n-1)/n, nccl-tests' definition)")
PY
fi

if wants compressed; then
  echo
  echo "## compressed allreduce against the plain one, float32, the same ranks (psnet-perf allreduce --compression)"
  port=29600
  root="$(addr_of h0)"
  for per_host in 1 2; do
    n=$((HOSTS * per_host))
    for mode in none 2bit 1bit; do
      port=$((port + 1))
      args=()
      case $mode in 2bit) args=(--compression 2bit --threshold 0.5) ;; 1bit) args=(--compression 1bit --threshold 0) ;; esac
      for ((r = 0; r < n; r++)); do
        on "h$((r % HOSTS))" env PSNET_RANK=$r PSNET_WORLD_SIZE=$n PSNET_ROOT_ADDR="$root:$port" \
          DMLC_INTERFACE=eth0 timeout -k 5 900 "$B/psnet-perf" allreduce -b "$AR_MIN" -e "$AR_MAX" \
          -n "$AR_ITERS" -w 3 --json "${args[@]}" > "$LOGS/car.$n.$mode.$r" 2> "$LOGS/car.$n.$mode.$r.err" &
      done
      wait
      grep -h '"in_place":true' "$LOGS/car.$n.$mode.0" > "$LOGS/car.$n.$mode.json" \
        || { say "compressed allreduce $mode on $n ranks failed:"; tail -5 "$LOGS/car.$n.$mode.0.err" >&2; }
    done
    python3 - "$n" "$per_host" "$LOGS/car.$n.none.json" "$LOGS/car.$n.2bit.json" "$LOGS/car.$n.1bit.json" <<'PY'
import json, os, sys
exec(os.environ["BENCH_ROWS_PY"])
n, per_host = int(sys.argv[1]), int(sys.argv[2])
plain, two, one = (rows(p) for p in sys.argv[3:6])
print(f"{n} ranks, {per_host} per host (in place; ms per call; sent: code bytes per rank, and against 2(n-1)/n of the codes)")
print(f"{'bytes':>10} {'plain ms':>9} {'2bit ms':>8} {'speed-up':>9} {'sent/ideal':>10} {'1bit ms':>8} {'speed-up':>9} {'sent/ideal':>10} {'wrong':>6}")
for b in sorted(plain):
    p = plain[b]["time_us"] / 1e3
    cells = []
    for rows_, factor in ((two, 16), (one, 32)):
        r = rows_.get(b)
        if r is None:
            cells.append(f"{'-':>8} {'-':>9} {'-':>10}")
            continue
        t = r["time_us"] / 1e3
        ideal = 2 * (n - 1) / n * (b / factor)
        cells.append(f"{t:>8.1f} {p / t:>8.2f}x {r['sent_per_rank_bytes'] / ideal:>10.3f}")
    wrong = sum(r.get(b, {}).get("wrong", 0) for r in (plain, two, one))
    print(f"{b:>10} {p:>9.1f} {cells[0]} {cells[1]} {wrong:>6}")
PY
  done
fi

if wants alltoall; then
  echo
  echo "## all_to_all_single, $HOSTS ranks (one per host), ${A2A_MIB:=64} MiB sent by each: psnet's torch backend against gloo"
  release_wheel
  if ! "$VENV/bin/python" -c 'import torch, psnet.torch' 2>/dev/null; then
    echo "SKIPPED: no torch in $VENV"
  else
    "$VENV/bin/python" python/benchmarks/alltoall.py --write-step "$LOGS/alltoall_step.py"
    port=29750
    printf '%-8s %10s %12s %12s %10s\n' backend "ms" "algbw GB/s" "busbw GB/s" "of link"
    for backend in psnet gloo psnet gloo; do
      port=$((port + 1))
      torch_ranks "$port" "$LOGS/alltoall_step.py" "$LOGS/a2a.$backend.$port" 5 "$backend" "$A2A_MIB"
      line=$(grep '^RESULT' "$LOGS/a2a.$backend.$port.0" || true)
      [ -n "$line" ] || { say "all_to_all on $backend failed:"; tail -5 "$LOGS/a2a.$backend.$port.0" >&2; continue; }
      ms=$(sed -n 's/.* ms=\([0-9.]*\).*/\1/p' <<< "$line")
      alg=$(sed -n 's/.*algbw=\([0-9.]*\).*/\1/p' <<< "$line")
      bus=$(sed -n 's/.*busbw=\([0-9.]*\).*/\1/p' <<< "$line")
      # Each rank sends (n-1)/n of its bytes over its link: busbw against the link's rate.
      frac=$(awk -v b="$bus" -v r="$RATE_BITS" 'BEGIN { printf "%.2f", b * 8e9 / r }')
      printf '%-8s %10s %12s %12s %10s\n' "$backend" "$ms" "$alg" "$bus" "$frac"
    done
    echo "(busbw = bytes per rank x (n-1)/n over time: each link's busier direction; of link: busbw over $RATE)"
  fi
fi

if wants fsdp2; then
  echo
  echo "## FSDP2 step, $HOSTS ranks (one per host): fully_shard on psnet's backend against gloo"
  release_wheel
  if ! "$VENV/bin/python" -c 'import torch, psnet.torch' 2>/dev/null; then
    echo "SKIPPED: no torch in $VENV"
  else
    "$VENV/bin/python" python/benchmarks/fsdp2_step.py --write-step "$LOGS/fsdp2_step.py"
    port=29780
    printf '%-8s %12s\n' backend "ms per step"
    for backend in psnet gloo psnet gloo; do
      port=$((port + 1))
      torch_ranks "$port" "$LOGS/fsdp2_step.py" "$LOGS/fsdp2.$backend.$port" 5 "$backend"
      ms=$(sed -n 's/.*ms_per_step=\([0-9.]*\).*/\1/p' "$LOGS/fsdp2.$backend.$port.0")
      [ -n "$ms" ] || { say "FSDP2 on $backend failed:"; tail -5 "$LOGS/fsdp2.$backend.$port.0" >&2; continue; }
      printf '%-8s %12s\n' "$backend" "$ms"
    done
  fi
fi

if wants ddp; then
  echo
  echo "## DDP step, $HOSTS ranks (one per host): psnet's torch.distributed backend against gloo"
  release_wheel
  TORCH=${PSNET_TORCH:-torch==2.15.0}
  if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null && [ "$TORCH" != none ]; then
    "$VENV/bin/pip" install -q --disable-pip-version-check "$TORCH" || true
  fi
  if ! "$VENV/bin/python" -c 'import torch, psnet.torch' 2>/dev/null; then
    echo "SKIPPED: no torch in $VENV (PSNET_TORCH=$TORCH)"
  else
    "$VENV/bin/python" python/benchmarks/ddp_step.py --write-step "$LOGS/ddp_step.py"
    port=29700
    printf '%-8s %12s %16s\n' backend "ms per step" "allreduce bound"
    declare -A step_ms
    for backend in psnet gloo psnet gloo; do
      port=$((port + 1))
      torch_ranks "$port" "$LOGS/ddp_step.py" "$LOGS/ddp.$backend.$port" 10 "$backend"
      ms=$(sed -n 's/.*ms_per_step=\([0-9.]*\).*/\1/p' "$LOGS/ddp.$backend.$port.0")
      params=$(sed -n 's/.*params=\([0-9]*\).*/\1/p' "$LOGS/ddp.$backend.$port.0")
      [ -n "$ms" ] || { say "DDP on $backend failed:"; tail -5 "$LOGS/ddp.$backend.$port.0" >&2; continue; }
      # A ring allreduce of the float32 gradients: 2(n-1)/n of them over each link.
      bound=$(awk -v p="$params" -v n="$HOSTS" -v r="$RATE_BITS" 'BEGIN { printf "%.0f", p * 4 * 2 * (n - 1) / n * 8 / r * 1000 }')
      printf '%-8s %12s %16s\n' "$backend" "$ms" "$bound ms"
      step_ms[$backend]="${step_ms[$backend]:-} $ms"
    done
    echo "psnet runs:${step_ms[psnet]:-}; gloo runs:${step_ms[gloo]:-} (alternating, 10 timed steps each)"
  fi
fi


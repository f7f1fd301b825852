#!/usr/bin/env bash
# psnet's allreduce next to Open MPI's MPI_Allreduce on this host (127.0.0.1): float32, sum, in
# place, for 2 and 4 ranks, at 8 bytes and from 128 KiB to 64 MiB.
#
# Two pairings, like with like:
#   sockets  psnet with PSNET_SHM_RING=0 (TCP only)
#            vs  mpirun --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo
#   shm      psnet's default (between same-host peers every message goes through a shared-memory
#            queue, messages of 256 KiB and more through a shared-memory ring it describes)
#            vs  mpirun --mca pml ob1 --mca btl self,vader (Open MPI's shared memory)
# Both sides run the same warmup and timed iterations per size and report the same time: the
# average iteration, the slowest rank's. psnet: `psnet-perf allreduce --np N --json` (its
# in-place rows); Open MPI: scripts/bench-mpi-allreduce.py (mpi4py + numpy). Both check every
# size's result.
#
# Prints every run's figures, then the ratio table: psnet busbw / Open MPI busbw per size
# (above 1: psnet is faster) and the 8-byte time ratio psnet / Open MPI (above 1: psnet is
# slower).
#
# Needs Debian's openmpi-bin, python3-mpi4py and python3-numpy: installed with apt-get when
# run as root, otherwise named. Builds psnet-perf with `cargo build --release -p psnet-perf`
# (in $CARGO_TARGET_DIR if set).
#
# Settings (environment): REPEAT (1: how many times each pairing runs, psnet and Open MPI
# alternating; the tables then give the median of the runs' ratios, their range, and the
# ratio of each side's fastest run), RANKS ("2 4"), SMALL_ITERS / SMALL_WARMUP (1000 / 100, the 8-byte
# size), MID_ITERS / MID_WARMUP (400 / 40, sizes up to MIDBYTES, 4M), ITERS / WARMUP (50 / 10,
# the larger sizes), MINBYTES (128K), MAXBYTES (64M), FACTOR (2), KEEP (a directory to keep
# the raw JSON Lines in, and psnet's logs: PS_VERBOSE=1, so each rank's count of messages by
# path, queue, ring or socket, is there), PAIR_BY (size: each size measured by psnet and Open
# MPI back to back, which side goes first alternating by run; run: all of psnet's sizes, then
# all of Open MPI's, as before 2026-11-26). psnet's ranks are bound to CPUs as mpirun binds
# Open MPI's (PSNET_BIND, psnet-perf's default).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
RANKS=${RANKS:-"2 4"}
ITERS=${ITERS:-50}
WARMUP=${WARMUP:-10}
SMALL_ITERS=${SMALL_ITERS:-1000}
SMALL_WARMUP=${SMALL_WARMUP:-100}
MINBYTES=${MINBYTES:-128K}
MAXBYTES=${MAXBYTES:-64M}
FACTOR=${FACTOR:-2}
# 4M (was 1M): at 50 iterations a 2 MiB size ran for about 25 ms, so one stall of this host
# moved its figure by tens of percent (2-rank sockets 2 MiB: runs 0.81-1.28 at REPEAT=5).
MIDBYTES=${MIDBYTES:-4M}
REPEAT=${REPEAT:-1}
PAIR_BY=${PAIR_BY:-size}
case $PAIR_BY in size | run) ;; *) echo "bench-allreduce: PAIR_BY=$PAIR_BY: size or run" >&2; exit 2 ;; esac
MID_ITERS=${MID_ITERS:-400}
MID_WARMUP=${MID_WARMUP:-40}

say() { echo "bench-allreduce: $*" >&2; }

# --- Open MPI and mpi4py -------------------------------------------------------------------
# Debian's python3-mpi4py is for Debian's python3 (/usr/bin/python3), which may not be the
# first python3 on the PATH (pyenv, a virtualenv): take the first that has mpi4py and numpy.
find_python() {
    local py
    for py in ${PYTHON:-} python3 /usr/bin/python3; do
        if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import mpi4py, numpy' >/dev/null 2>&1; then
            command -v "$py"
            return 0
        fi
    done
    return 1
}
packages="openmpi-bin python3-mpi4py python3-numpy"
if ! command -v mpirun >/dev/null 2>&1 || ! find_python >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing $packages"
        log=$(mktemp)
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends $packages; } >"$log" 2>&1; then
            tail -n 30 "$log" >&2
            say "apt-get install $packages failed"
            exit 1
        fi
        rm -f "$log"
    else
        say "needs Open MPI and mpi4py; install them with: sudo apt-get install $packages"
        exit 1
    fi
fi
command -v mpirun >/dev/null 2>&1 || { say "no mpirun (install openmpi-bin)"; exit 1; }
PY=$(find_python) || { say "no python3 with mpi4py and numpy (install python3-mpi4py python3-numpy, or set PYTHON)"; exit 1; }
if ! mpirun --version 2>/dev/null | grep -q "Open MPI"; then
    say "mpirun is not Open MPI's ($(mpirun --version 2>&1 | head -1)); choose it with update-alternatives --config mpirun"
    exit 1
fi

# --- psnet-perf ----------------------------------------------------------------------------
say "building psnet-perf (cargo build --release -p psnet-perf)"
(cd "$ROOT" && cargo build --release -q -p psnet-perf)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
case "$TARGET" in /*) ;; *) TARGET="$ROOT/$TARGET" ;; esac
PERF="$TARGET/release/psnet-perf"
[ -x "$PERF" ] || { say "no $PERF after the build"; exit 1; }

OUT=${KEEP:-$(mktemp -d)}
mkdir -p "$OUT"
[ -n "${KEEP:-}" ] || trap 'rm -rf "$OUT"' EXIT

# Open MPI's own defaults otherwise (binding: to cores for 2 ranks, to the socket beyond).
MPIRUN=(mpirun --oversubscribe)
if [ "$(id -u)" = 0 ]; then
    MPIRUN+=(--allow-run-as-root)
fi
MPI_SOCKETS=(--mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo)
MPI_SHM=(--mca pml ob1 --mca btl self,vader)
MPI_PY="$ROOT/scripts/bench-mpi-allreduce.py"

# run NAME COMMAND...: the command's stdout (JSON Lines) into $OUT/NAME.jsonl, stderr into
# $OUT/NAME.log (shown if it fails).
run() {
    local name=$1
    shift
    if ! "$@" >>"$OUT/$name.jsonl" 2>>"$OUT/$name.log"; then
        say "failed: $*"
        tail -n 30 "$OUT/$name.log" >&2
        exit 1
    fi
}

# bytes SIZE: 64, 4K, 16M, 1G (powers of 1024) as a number of bytes.
bytes() {
    local t=${1^^} shift=0
    case $t in
        *K) shift=10 ;;
        *M) shift=20 ;;
        *G) shift=30 ;;
    esac
    [ "$shift" = 0 ] || t=${t%?}
    echo $((t << shift))
}

# Size bands, each "smallest largest iterations warmup": sizes up to MIDBYTES take MID_ITERS
# iterations, so that each runs for tens of milliseconds and one stall of the host does not
# decide its figure; the larger sizes take ITERS.
BANDS=()
min=$(bytes "$MINBYTES") mid=$(bytes "$MIDBYTES") max=$(bytes "$MAXBYTES")
if [ "$mid" -ge "$min" ]; then
    BANDS+=("$min $((mid < max ? mid : max)) $MID_ITERS $MID_WARMUP")
    next=$((mid * FACTOR))
    [ "$next" -gt "$max" ] || BANDS+=("$next $max $ITERS $WARMUP")
else
    BANDS+=("$min $max $ITERS $WARMUP")
fi

# Every size on its own, "size size iterations warmup", for PAIR_BY=size.
SIZES=()
for band in "${BANDS[@]}"; do
    read -r lo hi n w <<<"$band"
    for ((size = lo; size <= hi; size *= FACTOR)); do
        SIZES+=("$size $size $n $w")
    done
done

start=$(date +%s)
for np in $RANKS; do
    for pairing in sockets shm; do
        rm -f "$OUT/psnet-$np-$pairing".{jsonl,log} "$OUT/mpi-$np-$pairing".{jsonl,log}
    done
done
# psnet_at / mpi_at LO HI ITERS WARMUP: one side's measurement of the sizes LO..HI.
psnet_at() {
    run "psnet-$np-$pairing" "${psnet_env[@]}" "$PERF" allreduce --np "$np" -d float -o sum \
        -b "$1" -e "$2" -f "$FACTOR" -n "$3" -w "$4" --json
}
mpi_at() {
    run "mpi-$np-$pairing" "${mpi[@]}" -np "$np" "$PY" "$MPI_PY" \
        -b "$1" -e "$2" -f "$FACTOR" -n "$3" -w "$4"
}

for rep in $(seq 1 "$REPEAT"); do
for np in $RANKS; do
    for pairing in sockets shm; do
        if [ "$pairing" = sockets ]; then
            psnet_env=(env PS_VERBOSE=1 PSNET_SHM_RING=0)
            mpi=("${MPIRUN[@]}" "${MPI_SOCKETS[@]}")
        else
            psnet_env=(env -u PSNET_SHM_RING PS_VERBOSE=1)
            mpi=("${MPIRUN[@]}" "${MPI_SHM[@]}")
        fi
        if [ "$PAIR_BY" = run ]; then
            say "run $rep of $REPEAT, $np ranks, $pairing: psnet"
            psnet_at 8 8 "$SMALL_ITERS" "$SMALL_WARMUP"
            for band in "${BANDS[@]}"; do psnet_at $band; done
            say "run $rep of $REPEAT, $np ranks, $pairing: Open MPI"
            mpi_at 8 8 "$SMALL_ITERS" "$SMALL_WARMUP"
            for band in "${BANDS[@]}"; do mpi_at $band; done
            continue
        fi
        # Size by size, the two sides back to back, the first side alternating by run: a
        # stall of the host that lasts seconds then tends to hit both sides of a size.
        say "run $rep of $REPEAT, $np ranks, $pairing: psnet and Open MPI, size by size"
        for spec in "8 8 $SMALL_ITERS $SMALL_WARMUP" "${SIZES[@]}"; do
            read -r lo hi n w <<<"$spec"
            if [ $((rep % 2)) = 1 ]; then
                psnet_at "$lo" "$hi" "$n" "$w"
                mpi_at "$lo" "$hi" "$n" "$w"
            else
                mpi_at "$lo" "$hi" "$n" "$w"
                psnet_at "$lo" "$hi" "$n" "$w"
            fi
        done
    done
done
done
elapsed=$(($(date +%s) - start))

# --- the tables ----------------------------------------------------------------------------
echo "# psnet vs Open MPI allreduce on $(hostname) ($(nproc) cores), 127.0.0.1, float32 sum in place"
echo "# psnet $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'), $(mpirun --version 2>/dev/null | head -1), mpi4py $("$PY" -c 'import mpi4py; print(mpi4py.__version__)')"
echo "# iterations: 8 B: $SMALL_WARMUP warmup + $SMALL_ITERS timed; $MINBYTES..$MIDBYTES: $MID_WARMUP + $MID_ITERS; above: $WARMUP + $ITERS; time: average iteration, the slowest rank's"
echo "# TCP congestion control: the system's is $(cat /proc/sys/net/ipv4/tcp_congestion_control 2>/dev/null || echo unknown) (Open MPI's sockets use it); psnet's same-host connections: PSNET_TCP_CONGESTION=${PSNET_TCP_CONGESTION:-auto} (auto: cubic, else reno)"
echo "# sockets: psnet PSNET_SHM_RING=0 vs mpirun ${MPI_SOCKETS[*]}"
echo "# shm:     psnet default vs mpirun ${MPI_SHM[*]}"
echo "# measured in ${elapsed} s, each pairing $REPEAT time(s), paired by $PAIR_BY"
python3 - "$OUT" "$RANKS" <<'EOF'
import json, os, statistics, sys

out, ranks = sys.argv[1], sys.argv[2].split()
pairings = ["sockets", "shm"]


def rows(name, psnet):
    by_size = {}
    with open(os.path.join(out, name + ".jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if psnet and not r["in_place"]:
                continue
            if r.get("wrong", 0):
                sys.exit(f"{name}: {r['wrong']} wrong elements at {r['bytes']} bytes")
            # Runs append in order: the k-th row of a size is run k.
            by_size.setdefault(r["bytes"], []).append(r)
    return by_size


def median_row(runs):
    t = statistics.median(r["time_us"] for r in runs)
    bw = statistics.median(r["busbw_gb_s"] for r in runs)
    return {"time_us": t, "busbw_gb_s": bw}


def ratios(ps, mp, size, key):
    return [a[key] / b[key] for a, b in zip(ps[size], mp[size])]


def human(b):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift}{unit}"
    return str(b)


data = {}
for np_ in ranks:
    for p in pairings:
        data[(np_, p)] = (rows(f"psnet-{np_}-{p}", True), rows(f"mpi-{np_}-{p}", False))

print()
print("# every pairing (busbw in GB/s, 10^9 bytes/s; time in us; the median of the runs)")
print(f"{'ranks':>5} {'pairing':>8} {'size':>6} {'psnet us':>10} {'ompi us':>10} "
      f"{'psnet busbw':>12} {'ompi busbw':>11}")
for (np_, p), (ps, mp) in data.items():
    for size in sorted(ps):
        a, b = median_row(ps[size]), median_row(mp[size])
        print(f"{np_:>5} {p:>8} {human(size):>6} {a['time_us']:>10.2f} {b['time_us']:>10.2f} "
              f"{a['busbw_gb_s']:>12.3f} {b['busbw_gb_s']:>11.3f}")

cols = [(np_, p) for np_ in ranks for p in pairings]
heads = [f"{np_} ranks {p}" for np_, p in cols]
width = max(len(h) for h in heads) + 2
print()
print("# ratio table: psnet busbw / Open MPI busbw (above 1: psnet faster; the median of the runs' ratios)")
print(f"{'size':>6}" + "".join(f"{h:>{width}}" for h in heads))
sizes = sorted({s for ps, _ in data.values() for s in ps if s > 8})
for size in sizes:
    cells = []
    for c in cols:
        ps, mp = data[c]
        cells.append(f"{statistics.median(ratios(ps, mp, size, 'busbw_gb_s')):>{width}.2f}")
    print(f"{human(size):>6}" + "".join(cells))
print("# 8-byte time: psnet / Open MPI (above 1: psnet slower)")
cells = []
for c in cols:
    ps, mp = data[c]
    cells.append(f"{statistics.median(ratios(ps, mp, 8, 'time_us')):>{width}.2f}")
print(f"{'8':>6}" + "".join(cells))
if any(len(runs) > 1 for ps, _ in data.values() for runs in ps.values()):
    print()
    print("# range of the runs' ratios (lowest-highest)")
    print(f"{'size':>6}" + "".join(f"{h:>{width}}" for h in heads))
    for size in [8] + sizes:
        cells = []
        for c in cols:
            ps, mp = data[c]
            key = "time_us" if size == 8 else "busbw_gb_s"
            r = ratios(ps, mp, size, key)
            cells.append(f"{f'{min(r):.2f}-{max(r):.2f}':>{width}}")
        print(f"{human(size):>6}" + "".join(cells))
    # On a shared host a stall only ever adds time, to either side and for a whole run: the
    # fastest run of each side is the figure least touched by the host.
    print()
    print("# best runs: psnet's fastest run / Open MPI's fastest run, busbw (8 B: time, above 1: psnet slower)")
    print(f"{'size':>6}" + "".join(f"{h:>{width}}" for h in heads))
    for size in [8] + sizes:
        cells = []
        for c in cols:
            ps, mp = data[c]
            a = min(r["time_us"] for r in ps[size])
            b = min(r["time_us"] for r in mp[size])
            cells.append(f"{(a / b if size == 8 else b / a):>{width}.2f}")
        print(f"{human(size):>6}" + "".join(cells))
EOF

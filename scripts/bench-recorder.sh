#!/usr/bin/env bash
# What the flight recorder costs, on and off in the same run (issue 40's goal: under 1% at an
# 8-byte allreduce and a 4 KiB kv push+pull). Each round runs both settings, in an order that
# alternates round by round, so that drift of the machine falls on both:
#   allreduce  psnet-perf allreduce --np 2 -b 8 -e 8 (time per call, the slowest rank's)
#   kv         psnet-perf kv --servers 1 --workers 1 --sizes 4K (median push+pull time)
# "on" is the default ring (PSNET_RECORDER_ENTRIES unset: 4096 entries), "off" is
# PSNET_RECORDER_ENTRIES=0. Prints every round, then per benchmark the median of the rounds'
# on/off ratios and their range (above 1: the recorder costs time).
#
# Settings (environment): ROUNDS (40: the median ratio of 8 rounds moved by 1-2% from run to
# run), AR_ITERS (20000), KV_ITERS (20000). The same-host paths as psnet sets them, or as
# PSNET_SHM_RING / PSNET_SHM_QUEUE in the environment say.
# Builds psnet-perf with `cargo build --release -p psnet-perf` (in $CARGO_TARGET_DIR if set).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-40}
AR_ITERS=${AR_ITERS:-20000}
KV_ITERS=${KV_ITERS:-20000}
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
cargo build --release -q -p psnet-perf
PERF=$TARGET/release/psnet-perf
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

run() { # setting round
  local env=()
  [ "$1" = off ] && env=(PSNET_RECORDER_ENTRIES=0)
  local ar kv
  ar=$(env -u PSNET_RECORDER_ENTRIES "${env[@]}" timeout 300 "$PERF" allreduce --np 2 -b 8 -e 8 \
    -n "$AR_ITERS" -w $((AR_ITERS / 10)) --json 2>/dev/null | tail -1)
  kv=$(env -u PSNET_RECORDER_ENTRIES "${env[@]}" timeout 300 "$PERF" kv --servers 1 --workers 1 \
    --sizes 4K -n "$KV_ITERS" --json 2>/dev/null | tail -1)
  echo "$1 $2 $ar" >>"$OUT/allreduce"
  echo "$1 $2 $kv" >>"$OUT/kv"
}

for ((r = 1; r <= ROUNDS; r++)); do
  if ((r % 2)); then run on "$r"; run off "$r"; else run off "$r"; run on "$r"; fi
  echo "round $r of $ROUNDS done" >&2
done

python3 - "$OUT" <<'EOF'
import json, statistics, sys
out = sys.argv[1]
for bench, field, what in (("allreduce", "time_us", "8 B allreduce, 2 ranks, us per call"),
                           ("kv", "pushpull_median_us", "4 KiB kv push+pull, 1+1, median us")):
    rows = {}
    for line in open(f"{out}/{bench}"):
        setting, rnd, text = line.split(" ", 2)
        rows.setdefault(int(rnd), {})[setting] = json.loads(text)[field]
    print(f"{what}")
    print(f"{'round':>6} {'on':>9} {'off':>9} {'on/off':>8}")
    ratios = []
    for rnd in sorted(rows):
        on, off = rows[rnd]["on"], rows[rnd]["off"]
        ratios.append(on / off)
        print(f"{rnd:>6} {on:>9.3f} {off:>9.3f} {on / off:>8.4f}")
    print(f"median on/off {statistics.median(ratios):.4f} (range {min(ratios):.4f}-{max(ratios):.4f});"
          f" medians {statistics.median(r['on'] for r in rows.values()):.3f} on,"
          f" {statistics.median(r['off'] for r in rows.values()):.3f} off\n")
EOF

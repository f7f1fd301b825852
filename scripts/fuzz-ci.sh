#!/usr/bin/env bash
# Bounded fuzzing of psnet's wire decoders (the cargo-fuzz targets in fuzz/): builds every
# target, then runs each for FUZZ_SECONDS (default 20) from the committed seeds in
# fuzz/corpus/<target>/. Fails if any target panics, hangs (-timeout) or runs out of memory
# (-rss_limit_mb); the input that did it is left in fuzz/artifacts/<target>/, with the
# command that replays it.
#
#   bash scripts/fuzz-ci.sh                   all targets, 20 s each
#   FUZZ_SECONDS=300 bash scripts/fuzz-ci.sh  longer
#   bash scripts/fuzz-ci.sh kv_msg            some targets only
#
# Stable Rust is enough: `-s none` builds without a sanitizer (AddressSanitizer needs nightly's
# -Zsanitizer), so no -Z flag and no RUSTC_BOOTSTRAP. Debug assertions and overflow checks are
# on (cargo-fuzz's default), so an arithmetic overflow is a crash like a panic.
#
# The committed corpus is never written to: libFuzzer adds what it finds to the first corpus
# directory it is given, here a scratch directory that is removed afterwards.
#
# Time on a 2-core machine: installing cargo-fuzz about 1 min (skipped when present), building
# the targets about 2-3 min from scratch, then FUZZ_SECONDS per target.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

seconds="${FUZZ_SECONDS:-20}"
cargo_fuzz_version=0.13.2

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz $cargo_fuzz_version"
  cargo install cargo-fuzz --locked --version "$cargo_fuzz_version"
fi

echo "== building the fuzz targets (fuzz/, a workspace of its own)"
# libfuzzer-sys compiles libFuzzer (C++) with `c++`; scripts/setup.sh installs clang.
if ! command -v c++ >/dev/null 2>&1 && command -v clang++ >/dev/null 2>&1; then
  export CXX=clang++
fi
# fuzz/Cargo.lock is committed: refuse to run with one that would need changing.
cargo fetch --locked --manifest-path fuzz/Cargo.toml
cargo fuzz build -s none

if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo fuzz list)
fi

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
failed=()
summary=()
for target in "${targets[@]}"; do
  echo "== fuzzing $target for ${seconds}s"
  mkdir -p "$scratch/$target"
  args=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1)
  if [ -f "fuzz/dicts/$target.dict" ]; then
    args+=(-dict="fuzz/dicts/$target.dict")
  fi
  log="$scratch/$target.log"
  if cargo fuzz run -s none "$target" "$scratch/$target" "fuzz/corpus/$target" -- "${args[@]}" >"$log" 2>&1; then
    result=ok
  else
    result=FAILED
    failed+=("$target")
    # The panic and the artifact's replay command.
    grep -v -E '^#[0-9]+' "$log" | tail -40
  fi
  runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
  summary+=("$(printf '%-18s %-7s %12s runs in %ss' "$target" "$result" "${runs:-?}" "$seconds")")
done

echo "== fuzzing summary"
printf '%s\n' "${summary[@]}"
if [ "${CI:-}" = true ]; then
  # Disk on CI machines is scarce and a fresh clone never reuses the build.
  rm -rf fuzz/target
fi
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzzing found failures in: ${failed[*]} (inputs in fuzz/artifacts/)"
fi
echo "$((${#targets[@]} - ${#failed[@]})) passed, ${#failed[@]} failed"
[ "${#failed[@]}" -eq 0 ]

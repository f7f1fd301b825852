#!/usr/bin/env bash
# The GPU checks (GPU tensors end to end, compression on the GPU, GPU allreduce), in two halves,
# so that a machine lent with a GPU for a few minutes only runs them:
#
#   bash scripts/gpu-checks.sh build        here, no GPU needed: builds the `cuda` feature's
#                                           GPU test binaries, psnet-perf, the gpu_allreduce
#                                           example, psnet-launch and the Python wheel, strips
#                                           them into .gpu-checks/ (about 40 MiB; ignored by git
#                                           through .git/info/exclude)
#   bash scripts/gpu-checks.sh wheel        here: the Python wheel alone, again
#   bash scripts/gpu-checks.sh run [DIR]    on the GPU machine, from the repository's root with
#                                           .gpu-checks/ carried there: runs every check under a
#                                           time limit, writes a summary (summary.txt) and every
#                                           check's output (logs.txt) to DIR (default
#                                           .gpu-checks/out): two files, within what the device
#                                           tool brings back
#
# The device tool's call is then, for example:
#   run(command="bash scripts/gpu-checks.sh run $OUT", carry=[".gpu-checks"], timeout_s=540)
#
# Each check ends PASS, FAIL, or SKIP; SKIP is a test that said it skipped (no CUDA driver or
# device, no torch). Where a GPU is present a SKIP is a finding too: the summary says so. The
# run needs no Rust or network there: the Python checks install the wheel (built for the
# Python version in PSNET_GPU_PYTHON, default 3.12, that machine's) into a folder of their own.
#
# Env: CARGO_TARGET_DIR; PSNET_GPU_PYTHON (the GPU machine's Python, major.minor);
# CHECK_TIMEOUT (seconds per check, default 120); BUDGET (seconds for the whole run, default
# 480: a check that would start later is reported NOT RUN, so the device call, at most 600 s,
# always brings the summary back); CHECKS (a space-separated subset of the
# checks' names, default all; `bash scripts/gpu-checks.sh list` names them).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
STAGE=$ROOT/.gpu-checks
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
PYVER=${PSNET_GPU_PYTHON:-3.12}

say() { echo "gpu-checks: $*" >&2; }

# --- the checks ----------------------------------------------------------------------------
# name | what it runs (relative to .gpu-checks/) — each test binary runs its tests one at a
# time, with their output shown, so that a test's "skipped" line reaches the log.
CHECK_NAMES=(env compression-kernels compression-segments compression-borrowed kv-gpu collectives-gpu
    compress-bench bw-bench kv-bench allreduce-example python-cuda)

check_cmd() {
    local t="--test-threads=1 --nocapture"
    case $1 in
    env) echo "describe_env" ;;
    compression-kernels) echo "bin/test-compression-cuda $t" ;;
    compression-segments) echo "bin/test-compression-cuda_segments $t" ;;
    compression-borrowed) echo "bin/test-compression-cuda_borrowed $t" ;;
    kv-gpu) echo "bin/test-kv-gpu $t" ;;
    collectives-gpu) echo "bin/test-collectives-gpu $t" ;;
    # The kernel table: every kernel beside a device-to-device copy, 2^26 and 2^28 elements.
    compress-bench) echo "env PS_VERBOSE=1 bin/psnet-perf compress --gpu 0" ;;
    # Staged sends from GPU memory, and receives placed in GPU memory, against the same sizes
    # from host memory into host memory, same run.
    bw-bench) echo "env PS_VERBOSE=1 bin/psnet-perf bw --loopback --gpu 0 -a" ;;
    # A kv job (2 servers, 2 workers) pushing and pulling from host buffers, then GPU buffers.
    kv-bench) echo "env PS_VERBOSE=1 bin/psnet-perf kv --gpu 0 --sizes 64K,1M,16M" ;;
    allreduce-example) echo "env PS_VERBOSE=1 bin/gpu_allreduce" ;;
    python-cuda) echo "run_python" ;;
    *) return 1 ;;
    esac
}

# --- build (here) --------------------------------------------------------------------------
# Prints the executable of the test target $2 of package $1, built in release with the cuda
# features (cargo's JSON messages name it).
test_exe() {
    cargo test --release --locked -p "$1" --features "$1/cuda" --test "$2" --no-run \
        --message-format=json 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])
' "$2"
}

build() {
    rm -rf "$STAGE"
    mkdir -p "$STAGE/bin" "$STAGE/wheels"
    grep -qx '/.gpu-checks/' .git/info/exclude 2>/dev/null || echo '/.gpu-checks/' >>.git/info/exclude
    local pkg test exe
    for spec in psnet-compression:cuda psnet-compression:cuda_segments \
        psnet-compression:cuda_borrowed psnet-kv:gpu \
        psnet-collectives:gpu; do
        pkg=${spec%%:*} test=${spec#*:}
        say "building $pkg's test $test (release, cuda)"
        # Built once with visible errors, then asked for its path.
        cargo test --release --locked -p "$pkg" --features "$pkg/cuda" --test "$test" --no-run || return 1
        exe=$(test_exe "$pkg" "$test")
        [ -x "$exe" ] || { say "no executable for $pkg's test $test"; return 1; }
        cp "$exe" "$STAGE/bin/test-${pkg#psnet-}-$test"
    done
    say "building psnet-perf, the gpu_allreduce example and psnet-launch (release, cuda)"
    cargo build --release --locked -p psnet-perf --features psnet-perf/cuda || return 1
    cargo build --release --locked -p psnet-collectives --features psnet-collectives/cuda \
        --example gpu_allreduce || return 1
    cargo build --release --locked -p psnet-launch || return 1
    cp "$TARGET/release/psnet-perf" "$TARGET/release/examples/gpu_allreduce" \
        "$TARGET/release/psnet-launch" "$STAGE/bin/"
    strip "$STAGE"/bin/*
    build_wheel || return 1
    du -sh "$STAGE" | sed 's/^/gpu-checks: staged: /' >&2
    ls -l "$STAGE/bin" "$STAGE/wheels" >&2
}

# The wheel for the GPU machine's Python: maturin builds for a Python version that is not
# installed here from its own copy of that version's build settings.
build_wheel() {
    local venv=${PSNET_VENV:-$TARGET/python-venv}
    if [ ! -x "$venv/bin/maturin" ]; then
        "${PYTHON:-python3}" -m venv "$venv" &&
            "$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.9.4,<2" ||
            return 1
    fi
    say "building the Python wheel for CPython $PYVER"
    "$venv/bin/maturin" build --release --locked -m python/Cargo.toml -i "python$PYVER" \
        --target x86_64-unknown-linux-gnu --strip -o "$STAGE/wheels" || return 1
}

# --- run (on the GPU machine) --------------------------------------------------------------
# cudarc opens NVRTC as libnvrtc.so or libnvrtc.so.12 (and older): where only another major
# version's file is installed (CUDA 13: libnvrtc.so.13), a folder of our own on the loader's
# path names it libnvrtc.so, beside the folder it lives in (for its builtins library).
find_nvrtc() {
    ldconfig -p 2>/dev/null | grep -qE 'libnvrtc\.so( |\.12 )' && return 0
    local lib
    lib=$(ldconfig -p 2>/dev/null | awk '/libnvrtc\.so\.[0-9]+ /{print $NF; exit}')
    [ -n "$lib" ] || lib=$(find /usr/local/cuda*/ /usr/lib /opt -name 'libnvrtc.so*' \
        ! -name '*builtins*' 2>/dev/null | sort | head -n 1)
    [ -n "$lib" ] || { say "no libnvrtc found: the GPU kernels cannot be compiled"; return 0; }
    mkdir -p /tmp/psnet-nvrtc
    ln -sf "$lib" /tmp/psnet-nvrtc/libnvrtc.so
    export LD_LIBRARY_PATH=/tmp/psnet-nvrtc:$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    say "NVRTC: $lib, as libnvrtc.so"
}

describe_env() {
    nvidia-smi || return 1
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    ldconfig -p | grep -E 'libcuda\.so|libnvrtc' || true
    python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())' || true
}

run_python() {
    local site=/tmp/psnet-gpu-site
    rm -rf "$site"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
        "$STAGE"/wheels/psnet-*.whl || return 1
    # From the repository's root the sources in python/ are not on the path: the installed
    # package (with its native module) is what runs.
    PYTHONPATH=$site PSNET_LAUNCH=$STAGE/bin/psnet-launch PYTHONUNBUFFERED=1 \
        python3 -m pytest -q -rs -p no:cacheprovider python/tests/test_cuda_tensors.py \
        python/tests/test_torch.py
}

run_checks() {
    local out=${1:-$STAGE/out} limit=${CHECK_TIMEOUT:-120} budget=${BUDGET:-480} name cmd status rc
    local -a names
    read -r -a names <<<"${CHECKS:-${CHECK_NAMES[*]}}"
    local logs
    logs=$(mktemp -d)
    mkdir -p "$out"
    [ -d "$STAGE/bin" ] || { say "no $STAGE/bin: run 'bash scripts/gpu-checks.sh build' here and carry .gpu-checks"; return 2; }
    local summary=$out/summary.txt
    : >"$summary"
    find_nvrtc
    export STAGE
    export -f run_python describe_env say
    local gpu=no
    nvidia-smi -L >/dev/null 2>&1 && gpu=yes
    echo "# gpu-checks $(date -u +%FT%TZ) on $(hostname): GPU present: $gpu" | tee -a "$summary"
    for name in "${names[@]}"; do
        cmd=$(check_cmd "$name") || { say "unknown check $name"; return 2; }
        local log=$logs/$name.log start=$SECONDS
        if [ $((SECONDS + 10)) -gt "$budget" ]; then
            printf '%-22s %-18s %4ss  %s\n' "$name" "NOT RUN (budget)" 0 "$cmd" | tee -a "$summary"
            : >"$log"
            continue
        fi
        # A check gets at most what is left of the budget.
        local left=$((budget - SECONDS))
        [ "$left" -lt "$limit" ] && limit=$left
        if [ "$cmd" = run_python ] || [ "$cmd" = describe_env ]; then
            timeout -k 10 "$limit" bash -c "$cmd" >"$log" 2>&1
        else
            # shellcheck disable=SC2086 # the command's words
            (cd "$STAGE" && timeout -k 10 "$limit" $cmd) >"$log" 2>&1
        fi
        rc=$?
        if [ $rc = 124 ] || [ $rc = 137 ]; then
            status="FAIL (over ${limit}s)"
        elif [ $rc != 0 ]; then
            status="FAIL (exit $rc)"
        elif grep -qE ': skipped: |^SKIPPED' "$log"; then
            status=SKIP
        else
            status=PASS
        fi
        printf '%-22s %-18s %4ss  %s\n' "$name" "$status" $((SECONDS - start)) "$cmd" | tee -a "$summary"
        if [ "$status" = SKIP ]; then
            grep -E ': skipped: |^SKIPPED' "$log" | head -5 | sed 's/^/    /' | tee -a "$summary"
        fi
    done
    if [ $gpu = yes ] && grep -q ' SKIP ' "$summary"; then
        echo "# a GPU is present, yet checks skipped: see their lines above" | tee -a "$summary"
    fi
    # The logs of the benchmarks hold the tables the closing notes quote.
    for name in compress-bench bw-bench kv-bench allreduce-example; do
        [ -f "$logs/$name.log" ] && { echo "## $name"; grep -v ' INFO \| DEBUG ' "$logs/$name.log" | tail -40; }
    done >>"$summary"
    for name in "${names[@]}"; do
        echo "=================== $name: $(check_cmd "$name")"
        # The last 2,000 lines of each: a runaway log must not crowd out the others.
        tail -n 2000 "$logs/$name.log"
    done >"$out/logs.txt"
    rm -rf "$logs"
    ! grep -qE ' FAIL|NOT RUN' "$summary"
}

case ${1:-} in
build) build ;;
wheel) rm -f "$STAGE"/wheels/*.whl && build_wheel ;;
run) run_checks "${2:-}" ;;
list) for n in "${CHECK_NAMES[@]}"; do printf '%-22s %s\n' "$n" "$(check_cmd "$n")"; done ;;
*)
    echo "usage: bash scripts/gpu-checks.sh build | wheel | run [DIR] | list" >&2
    exit 2
    ;;
esac

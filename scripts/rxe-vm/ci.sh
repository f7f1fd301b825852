#!/bin/bash
# Builds psnet's binaries and verbs test binaries on the host, stages them with
# psnet-checks.sh as the guest's hook, and runs the Soft-RoCE guest (run.sh).
# Exit status 0 only if every check in the guest passed. Needs root (run.sh does).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
if [ -z "${SHARE:-}" ]; then
  SHARE=$(mktemp -d /tmp/psnet-rxe-share.XXXXXX)
  # The staged binaries are ~180 MB a run; the guest's log (run.log) stays.
  trap 'rm -rf "$SHARE/bin" "$SHARE/tests" "$SHARE/late"' EXIT
fi
cd "$ROOT"
echo "rxe-ci: building release binaries"
cargo build --release --locked -p psnet-perf -p psnet-launch -p psnet-train
test_binaries() { # test_binaries TARGET... -> paths of the built test executables
  cargo test --release --locked -p psnet-verbs $(printf -- '--test %s ' "$@") --no-run --message-format=json \
    | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p'
}
tests=$(test_binaries conformance offers rdma_cm device landing)
# Run after every other check: it takes the RDMA interface down and up.
late=$(test_binaries events)
mkdir -p "$SHARE/bin" "$SHARE/tests" "$SHARE/late"
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
cp "$TARGET/release/psnet-perf" "$TARGET/release/psnet-launch" "$TARGET/release/psnet-train" "$SHARE/bin/"
for t in $tests; do cp "$t" "$SHARE/tests/verbs-$(basename "$t" | sed 's/-[0-9a-f]*$//')"; done
for t in $late; do cp "$t" "$SHARE/late/verbs-$(basename "$t" | sed 's/-[0-9a-f]*$//')"; done
cp "$HERE/psnet-checks.sh" "$SHARE/hook.sh"
echo "rxe-ci: running the guest (share $SHARE)"
rc=0
SHARE="$SHARE" GUEST_DEADLINE=${GUEST_DEADLINE:-900} bash "$HERE/run.sh" | tee "$SHARE/run.log" || rc=$?
echo "rxe-ci: summary"
grep -E "CHECK |FIGURE " "$SHARE/run.log" | sed 's/^GUEST[^:]*: //' || true
exit $rc

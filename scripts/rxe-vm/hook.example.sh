#!/bin/sh
# Example share/hook.sh: copy to $W/share/hook.sh (or $SHARE/hook.sh) and put test
# binaries (e.g. from `cargo test --no-run`, built on a Debian 12 host) in share/tests/.
# Runs inside the guest after the built-in checks, via `sh`, under the guest's timeout.
# Env: RXE_DEV (rxe0) RXE_GID_INDEX RXE_ADDR (192.168.77.1) RXE_NETDEV RXE_SHARE.
# Non-zero exit => RXE-RESULT: FAIL => run.sh exits 1.
echo "hook: dev=$RXE_DEV gid_index=$RXE_GID_INDEX addr=$RXE_ADDR"
rc=0
for t in "$RXE_SHARE"/tests/*; do
  [ -x "$t" ] || continue
  echo "hook: running $t"
  "$t" --test-threads=1 --nocapture || { echo "hook: $t FAILED"; rc=1; }
done
exit $rc

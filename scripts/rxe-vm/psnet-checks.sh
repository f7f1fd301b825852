#!/bin/sh
# psnet's checks inside the Soft-RoCE guest (run as share/hook.sh by guest-init.sh).
# ci.sh stages the binaries in $RXE_SHARE/bin and the test binaries in $RXE_SHARE/tests.
# Env from guest-init.sh: RXE_DEV RXE_GID_INDEX RXE_ADDR RXE_NETDEV RXE_SHARE.
# Every check prints "CHECK <name> PASS|FAIL"; figures are printed as "FIGURE ..." lines.
# Exit status non-zero if any check failed (=> RXE-RESULT: FAIL => CI fails).
B=$RXE_SHARE/bin
OUT=/tmp/psnet-checks
mkdir -p $OUT
ulimit -l unlimited
FAILED=0
check() { # check NAME STATUS
  if [ "$2" = 0 ]; then echo "CHECK $1 PASS"; else echo "CHECK $1 FAIL (rc=$2)"; FAILED=1; fi
}
export PS_VERBOSE=0

# 1. The transport's integration tests (the conformance suite) over rxe0. Queue pairs
# connect through rdma_cm (the default where it works); the conformance suite runs again
# with them connected over the TCP control connection (PSNET_RDMA_CONNECT=socket).
run_tests() { # run_tests BINARY LOG CHECK-NAME
  timeout -k 5 300 "$1" --test-threads=1 > "$OUT/$2.log" 2>&1
  rc=$?
  grep -E "^test |test result" "$OUT/$2.log"
  [ $rc = 0 ] || tail -60 "$OUT/$2.log"
  check "$3" $rc
}
for t in "$RXE_SHARE"/tests/*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  run_tests "$t" "$name" "tests/$name"
done
if [ -x "$RXE_SHARE/tests/verbs-conformance" ]; then
  PSNET_RDMA_CONNECT=socket run_tests "$RXE_SHARE/tests/verbs-conformance" \
    verbs-conformance-socket "tests/verbs-conformance (PSNET_RDMA_CONNECT=socket)"
fi

# 2. Bandwidth: perftest's ib_write_bw and psnet-perf bw over the same device, same run.
# Both send 1 MiB / 4 MiB messages from one registered buffer to a server on this host.
bw_pair() { # bw_pair SIZE ITERS
  timeout -k 5 120 ib_write_bw -d $RXE_DEV -x $RXE_GID_INDEX -s $1 -n $2 -F > $OUT/ibbw-srv.$1 2>&1 &
  sleep 1
  timeout -k 5 120 ib_write_bw -d $RXE_DEV -x $RXE_GID_INDEX -s $1 -n $2 -F $RXE_ADDR > $OUT/ibbw.$1 2>&1
  rc1=$?; wait
  ib=$(awk '$1 ~ /^[0-9]+$/ && NF >= 5 {print $4}' $OUT/ibbw.$1 | tail -1)
  DMLC_INTERFACE=$RXE_NETDEV timeout -k 5 120 $B/psnet-perf bw --transport rdma > $OUT/psbw-srv.$1 2>&1 &
  sleep 1
  DMLC_INTERFACE=$RXE_NETDEV timeout -k 5 120 $B/psnet-perf bw --transport rdma -s $1 -n $2 --json $RXE_ADDR > $OUT/psbw.$1 2>&1
  rc2=$?; wait
  ps=$(sed -n '/"test":"bw"/s/.*"bw_avg_mib_s": *\([0-9.eE+-]*\).*/\1/p' $OUT/psbw.$1 | tail -1)
  [ $rc2 = 0 ] || { cat $OUT/psbw.$1 $OUT/psbw-srv.$1 | tail -30; }
  echo "FIGURE bw size=$1 ib_write_bw_MBps=$ib psnet_rdma_MiBps=$ps ratio=$(awk -v a="$ps" -v b="$ib" 'BEGIN{ if (b > 0) printf "%.2f", a/b; else print "n/a" }')"
  check "bw $1 (ib_write_bw rc=$rc1, psnet-perf rc=$rc2)" $(( rc1 != 0 || rc2 != 0 ))
}
bw_pair 1048576 200
bw_pair 4194304 50

# 3. Latency: ib_write_lat, ib_send_lat (the same verbs psnet's eager path uses) and psnet-perf
# lat, in one run. perftest prints one-way figures (half a round trip); psnet-perf round trips.
perftest_lat() { # perftest_lat TOOL -> prints its typical one-way latency in usec
  timeout -k 5 60 $1 -d $RXE_DEV -x $RXE_GID_INDEX -s 8 -n 1000 -F > $OUT/$1-srv 2>&1 &
  sleep 1
  timeout -k 5 60 $1 -d $RXE_DEV -x $RXE_GID_INDEX -s 8 -n 1000 -F $RXE_ADDR > $OUT/$1 2>&1
  rc=$?; wait
  grep -A3 "#bytes" $OUT/$1 | tail -2 >&2
  awk '$1 == 8 && NF >= 5 {print $5}' $OUT/$1 | tail -1
  return $rc
}
wlat=$(perftest_lat ib_write_lat); rc1=$?
slat=$(perftest_lat ib_send_lat); rc3=$?
DMLC_INTERFACE=$RXE_NETDEV timeout -k 5 60 $B/psnet-perf lat --transport rdma > $OUT/pslat-srv 2>&1 &
sleep 1
DMLC_INTERFACE=$RXE_NETDEV timeout -k 5 60 $B/psnet-perf lat --transport rdma -s 8 -n 1000 --json $RXE_ADDR > $OUT/pslat 2>&1
rc2=$?; wait
ps=$(sed -n '/"test":"lat"/s/.*"rtt_median_us": *\([0-9.eE+-]*\).*/\1/p' $OUT/pslat | tail -1)
[ $rc2 = 0 ] || { cat $OUT/pslat $OUT/pslat-srv | tail -30; }
echo "FIGURE lat size=8 ib_write_lat_typical_us=$wlat ib_send_lat_typical_us=$slat psnet_rdma_rtt_median_us=$ps one_way_ratio_vs_send_lat=$(awk -v a="$ps" -v b="$slat" 'BEGIN{ if (b > 0) printf "%.2f", a/2/b; else print "n/a" }')"
check "lat (ib_write_lat rc=$rc1, ib_send_lat rc=$rc3, psnet-perf rc=$rc2)" $(( rc1 != 0 || rc2 != 0 || rc3 != 0 ))

# 3b. psnet-perf lat and bw again with a job secret: every queue-pair message carries a session
# tag (RDMA writes do not). Compare with the rows above, same run.
secret_perf() { # secret_perf lat|bw SIZE ITERS JSON-FIELD -> prints the figure
  PSNET_SECRET="guest perf secret" DMLC_INTERFACE=$RXE_NETDEV timeout -k 5 120 $B/psnet-perf $1 --transport rdma > $OUT/ps$1-secret-srv 2>&1 &
  sleep 1
  PSNET_SECRET="guest perf secret" DMLC_INTERFACE=$RXE_NETDEV timeout -k 5 120 $B/psnet-perf $1 --transport rdma -s $2 -n $3 --json $RXE_ADDR > $OUT/ps$1-secret 2>&1
  rc=$?; wait
  [ $rc = 0 ] || { cat $OUT/ps$1-secret $OUT/ps$1-secret-srv | tail -30 >&2; }
  sed -n "/\"test\":\"$1\"/s/.*\"$4\": *\([0-9.eE+-]*\).*/\1/p" $OUT/ps$1-secret | tail -1
  return $rc
}
lat_secret=$(secret_perf lat 8 1000 rtt_median_us); rc1=$?
bw_secret=$(secret_perf bw 1048576 200 bw_avg_mib_s); rc2=$?
echo "FIGURE secret lat size=8 psnet_rdma_rtt_median_us=$lat_secret without_secret_us=$ps; bw size=1048576 psnet_rdma_MiBps=$bw_secret (without: the bw row above)"
check "psnet-perf lat and bw over rdma with PSNET_SECRET (rc=$rc1, $rc2)" $(( rc1 != 0 || rc2 != 0 ))

# 4. The kv store: 1 scheduler + 1 server + 2 workers, dist_sync training, on the rxe-bound
# interface (RDMA) and on an interface without RDMA (TCP); both must end bit-identical to
# the single-process reference.
ip link add eth1 type dummy 2>/dev/null; ip addr add 192.168.78.1/24 dev eth1 2>/dev/null; ip link set eth1 up
# A small perceptron (psnet-train's default model is sized for a real host, not the guest).
MODEL="--hidden 64 --features 32 --classes 5 --samples 2048 --batch 32"
$B/psnet-train $MODEL --reference --workers 2 --epochs 2 --dump $OUT/ref.bin > $OUT/ref.log 2>&1
check "train reference" $?
for pair in "$RXE_NETDEV:rdma" "eth1:tcp"; do
  iface=${pair%%:*}; want=${pair##*:}
  rm -f $OUT/w.$iface.bin
  DMLC_INTERFACE=$iface PS_VERBOSE=1 timeout -k 5 240 $B/psnet-train $MODEL --servers 1 --workers 2 --epochs 2 \
    --dump $OUT/w.$iface.bin > $OUT/train.$iface.log 2>&1
  rc=$?
  n=$(grep "psnet transport selected" $OUT/train.$iface.log | grep -c "$want")
  echo "train over $iface: $n processes chose $want"
  [ $rc = 0 ] || tail -30 $OUT/train.$iface.log
  cmp -s $OUT/ref.bin $OUT/w.$iface.bin; same=$?
  check "kv 1+1+2 over $iface ($want: $n of 4 processes, weights identical to reference: $([ $same = 0 ] && echo yes || echo no))" \
    $(( rc != 0 || same != 0 || n != 4 ))
done

# The same job over RDMA with a job secret: every control connection (registration, queue-pair
# exchange) opens with the HMAC exchange; the weights must not change.
rm -f $OUT/w.secret.bin
PSNET_SECRET="guest job secret" DMLC_INTERFACE=$RXE_NETDEV PS_VERBOSE=1 timeout -k 5 240 $B/psnet-train $MODEL \
  --servers 1 --workers 2 --epochs 2 --dump $OUT/w.secret.bin > $OUT/train.secret.log 2>&1
rc=$?
n=$(grep "psnet transport selected" $OUT/train.secret.log | grep -c rdma)
[ $rc = 0 ] || tail -30 $OUT/train.secret.log
cmp -s $OUT/ref.bin $OUT/w.secret.bin; same=$?
check "kv 1+1+2 over $RXE_NETDEV with PSNET_SECRET (rdma: $n of 4 processes, weights identical to reference: $([ $same = 0 ] && echo yes || echo no))" \
  $(( rc != 0 || same != 0 || n != 4 ))

# 5. kv throughput over RDMA (for the record), without and with standing offers
# (PSNET_RDMA_OFFER_BYTES=0: every large push and pull reply takes the rendezvous round trip).
for offers in 0 16777216; do
  PSNET_RDMA_OFFER_BYTES=$offers DMLC_INTERFACE=$RXE_NETDEV timeout -k 5 240 $B/psnet-perf kv \
    --servers 1 --workers 2 --sizes 4K,1M,4M > $OUT/kv.$offers 2>&1
  rc=$?
  grep -A4 "#bytes" $OUT/kv.$offers
  awk -v o=$offers '$1 ~ /^[0-9]+$/ && NF >= 6 {print "FIGURE kv offer_bytes=" o " size=" $1 " push_MBps=" $4 " pull_MBps=" $5 " pushpull_MBps=" $6}' $OUT/kv.$offers
  [ $rc = 0 ] || tail -30 $OUT/kv.$offers
  check "psnet-perf kv over $RXE_NETDEV (PSNET_RDMA_OFFER_BYTES=$offers)" $rc
done

# 5b. A key sharded over 2 servers (8 MiB: two 4 MiB parts), its parts sent to both servers at
# once against one after another (PSNET_KV_SERIAL_SENDS=1), alternating, twice (for the record:
# time ratio = serial goodput / parallel goodput).
for round in 1 2; do
  for serial in 0 1; do
    PSNET_KV_SERIAL_SENDS=$serial DMLC_INTERFACE=$RXE_NETDEV timeout -k 5 240 $B/psnet-perf kv \
      --servers 2 --workers 1 --sizes 8M > $OUT/kv-sharded.$serial 2>&1
    rc=$?
    [ $rc = 0 ] || tail -30 $OUT/kv-sharded.$serial
    check "psnet-perf kv, key sharded over 2 servers (PSNET_KV_SERIAL_SENDS=$serial, round $round)" $rc
  done
  par=$(awk '$1 ~ /^[0-9]+$/ && NF >= 6 {print $4}' $OUT/kv-sharded.0)
  ser=$(awk '$1 ~ /^[0-9]+$/ && NF >= 6 {print $4}' $OUT/kv-sharded.1)
  echo "FIGURE kv_sharded round=$round size=8388608 servers=2 push_MBps_parallel=$par push_MBps_serial=$ser time_ratio_parallel_over_serial=$(awk -v p="$par" -v s="$ser" 'BEGIN { if (p > 0) printf "%.2f", s / p; else print "n/a" }')"
done

# 5c. Collectives over RDMA: each collective on two ranks of this host over the RDMA device,
# every result checked against the known answer (nccl-tests' #wrong must be 0 in every row)
# and the transport confirmed as rdma; allreduce's bus bandwidth for the record.
port=29600
for coll in allreduce reducescatter allgather broadcast reduce; do
  port=$((port + 1))
  PSNET_TRANSPORT=rdma DMLC_INTERFACE=$RXE_NETDEV PSNET_ROOT_ADDR=$RXE_ADDR:$port timeout -k 5 240 \
    $B/psnet-perf $coll --np 2 -b 8 -e 4M -f 8 -n 5 -w 2 -c 1 --json > $OUT/coll.$coll 2>&1
  rc=$?
  rows=$(grep -c '^{"collective"' $OUT/coll.$coll)
  if [ $rc = 0 ] && { [ "$rows" = 0 ] || grep '^{"collective"' $OUT/coll.$coll | grep -q -v '"transport":"rdma"' \
      || grep '^{"collective"' $OUT/coll.$coll | grep -q -v '"wrong":0}'; }; then
    echo "rows: $rows; a row not over rdma or with wrong elements:"; rc=99
  fi
  [ $rc = 0 ] || tail -30 $OUT/coll.$coll
  check "psnet-perf $coll --np 2 over $RXE_NETDEV ($rows rows checked)" $rc
done
grep '^{"collective":"allreduce"' $OUT/coll.allreduce | grep '"in_place":true' \
  | sed 's/.*"bytes":\([0-9]*\).*"busbw_gb_s":\([0-9.e-]*\).*/FIGURE allreduce_rdma ranks=2 bytes=\1 busbw_GBps=\2/'

# 6. Tests that take the RDMA interface down and up again: last, so nothing else sees it.
for t in "$RXE_SHARE"/late/*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  timeout -k 5 300 "$t" --test-threads=1 --nocapture > $OUT/$name.log 2>&1
  rc=$?
  grep -E "^test |test result|lost their peer|SKIPPED" $OUT/$name.log
  [ $rc = 0 ] || tail -60 $OUT/$name.log
  check "tests/$name (after taking $RXE_NETDEV down and up)" $rc
done

[ $FAILED = 0 ] && echo "psnet-checks: all passed" || echo "psnet-checks: FAILED"
exit $FAILED

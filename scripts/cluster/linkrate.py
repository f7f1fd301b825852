#!/usr/bin/env python3
"""Samples a host's link while a job runs: bytes sent and received on DEV every INTERVAL ms,
for at most SECONDS, then prints the time series and how much of it both directions were
busy at once. Run inside a host: `rig.sh exec h3 python3 scripts/cluster/linkrate.py`.

    linkrate.py [--dev eth0] [--interval-ms 5] [--seconds 10] [--rate-bits 1e9] [--skip-idle]

A sample counts as busy in a direction when that direction moved at least 50% of what the
rate allows in the interval; "duplex" is the share of busy samples that were busy both ways.
"""
import argparse
import time


def read(dev):
    base = f"/sys/class/net/{dev}/statistics/"
    with open(base + "tx_bytes") as t, open(base + "rx_bytes") as r:
        return int(t.read()), int(r.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dev", default="eth0")
    ap.add_argument("--interval-ms", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rate-bits", type=float, default=1e9)
    ap.add_argument("--print", action="store_true", help="print every sample")
    a = ap.parse_args()
    interval = a.interval_ms / 1000.0
    full = a.rate_bits / 8 * interval
    samples = []
    t0 = time.monotonic()
    last = read(a.dev)
    n = int(a.seconds / interval)
    for i in range(n):
        time.sleep(max(0.0, t0 + (i + 1) * interval - time.monotonic()))
        now = read(a.dev)
        samples.append((time.monotonic() - t0, now[0] - last[0], now[1] - last[1]))
        last = now
    busy_tx = busy_rx = both = either = 0
    for t, tx, rx in samples:
        btx, brx = tx >= full / 2, rx >= full / 2
        busy_tx += btx
        busy_rx += brx
        both += btx and brx
        either += btx or brx
        if a.print:
            print(f"{t * 1000:9.1f} ms  tx {tx / full:5.2f}  rx {rx / full:5.2f}")
    tot_tx = sum(s[1] for s in samples)
    tot_rx = sum(s[2] for s in samples)
    span = samples[-1][0] if samples else 0
    print(
        f"linkrate {a.dev}: {len(samples)} samples of {a.interval_ms} ms; "
        f"tx {tot_tx / 1e6:.1f} MB rx {tot_rx / 1e6:.1f} MB in {span:.2f} s; "
        f"busy samples tx {busy_tx} rx {busy_rx} both {both} either {either}; "
        f"duplex {both / either if either else 0:.2f}"
    )


if __name__ == "__main__":
    main()

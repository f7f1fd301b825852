"""MXNet's dist_sync kvstore and psnet's Python kvstore, measured by one script of one shape, so
that both can be run side by side (on this host, or across the emulated cluster's hosts).

    python3 -m venv /tmp/mxvenv && /tmp/mxvenv/bin/pip install mxnet==1.9.1 numpy==1.23.5
    psnet-launch -n 2 -s 2 -- /tmp/mxvenv/bin/python scripts/bench-mxnet.py 4K,1M,16M
    psnet-launch -n 2 -s 2 -- python scripts/bench-mxnet.py 4M,16M --lib psnet --compression 2bit

Rank 0 prints one JSON line: per value size, push, pull, push then pull (`push+pull`), and
`pushpull1` (one `pushpull` call, where the library has it) goodput per worker (array bytes over the median time of one operation, 10^6 bytes per second),
and those median times in milliseconds. `--compression 2bit|1bit` sets MXNet's gradient
compression (threshold 0.5) before the keys are initialized, on either library.
"""
import argparse
import json
import os
import time

LIB = os.environ.get("KV_TWIN_LIB", "mxnet")


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sizes", help="value sizes, comma-separated (K, M, G: powers of 1024)")
    ap.add_argument("--lib", choices=["mxnet", "psnet"], default=LIB)
    ap.add_argument("--compression", choices=["none", "2bit", "1bit"], default="none")
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--iters", type=int, default=0, help="timed operations per size (0: by volume)")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]

    # A scheduler or server process runs its loop inside this import, and exits there.
    if args.lib == "mxnet":
        import mxnet as mx

        kv = mx.kv.create("dist_sync")
        zeros, ones = (lambda n: mx.nd.zeros((n,))), (lambda n: mx.nd.ones((n,)))
        wait = mx.nd.waitall
    else:
        import numpy as np
        import psnet

        kv = psnet.kvstore.create("dist_sync")
        zeros = lambda n: np.zeros((n,), dtype=np.float32)  # noqa: E731
        ones = lambda n: np.ones((n,), dtype=np.float32)  # noqa: E731
        wait = lambda: None  # noqa: E731  (psnet's calls return when done)
    if args.compression != "none":
        kv.set_gradient_compression({"type": args.compression, "threshold": args.threshold})

    def median_ms(op, iters, warmup=2):
        times = []
        for i in range(warmup + iters):
            wait()
            start = time.perf_counter()
            op()
            wait()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        kv._barrier()
        times.sort()
        return times[len(times) // 2] * 1e3

    rows = []
    for key, nbytes in enumerate(sizes):
        n = max(nbytes // 4, 1)
        value, out = ones(n), zeros(n)
        kv.init(key, value)
        iters = args.iters or max(5, min(200, (512 << 20) // nbytes))

        def push_then_pull():
            kv.push(key, value)
            kv.pull(key, out=out)

        ms = {
            "push": median_ms(lambda: kv.push(key, value), iters),
            "pull": median_ms(lambda: kv.pull(key, out=out), iters),
            "push+pull": median_ms(push_then_pull, iters),
        }
        # MXNet 1.9.1 refuses pushpull with compression ("Compression not supported with
        # PushPull"): that row is left out for it.
        if hasattr(kv, "pushpull") and (args.lib == "psnet" or args.compression == "none"):
            ms["pushpull1"] = median_ms(lambda: kv.pushpull(key, value, out=out), iters)
        row = {"bytes": n * 4, "iterations": iters}
        for op, t in ms.items():
            row[f"{op}_ms"] = t
            row[f"{op}_mb_s"] = n * 4 / t / 1e3
        rows.append(row)
    if kv.rank == 0:
        print(json.dumps({"test": f"{args.lib}-kv", "compression": args.compression,
                          "workers": kv.num_workers, "results": rows}), flush=True)


if __name__ == "__main__":
    main()

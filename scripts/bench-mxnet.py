"""MXNet's dist_sync kvstore, measured the way `psnet-perf kv` measures psnet, so that both can
be run side by side on one machine.

    python3 -m venv /tmp/mxvenv && /tmp/mxvenv/bin/pip install mxnet==1.9.1 numpy==1.23.5
    psnet-launch -n 2 -s 2 -- /tmp/mxvenv/bin/python scripts/bench-mxnet.py 4K,1M,16M

Rank 0 prints one JSON list: per value size, push, pull and push+pull goodput per worker
(array bytes over the median time of one operation, 10^6 bytes per second).
"""
import json
import sys
import time

import mxnet as mx  # a scheduler or server process runs its loop inside this import


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def median_time(op, iters, warmup=2):
    times = []
    for i in range(warmup + iters):
        mx.nd.waitall()
        start = time.perf_counter()
        op()
        mx.nd.waitall()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def main():
    sizes = [parse_size(s) for s in sys.argv[1].split(",")]
    kv = mx.kv.create("dist_sync")
    rows = []
    for key, nbytes in enumerate(sizes):
        n = max(nbytes // 4, 1)
        value = mx.nd.ones((n,))
        out = mx.nd.zeros((n,))
        kv.init(key, value)
        iters = max(5, min(200, (512 << 20) // nbytes))
        push = median_time(lambda: kv.push(key, value), iters)
        kv._barrier()
        pull = median_time(lambda: kv.pull(key, out=out), iters)
        kv._barrier()

        def push_then_pull():
            kv.push(key, value)
            kv.pull(key, out=out)

        both = median_time(push_then_pull, iters)
        kv._barrier()
        rows.append({
            "bytes": n * 4,
            "iterations": iters,
            "push_mb_s": n * 4 / push / 1e6,
            "pull_mb_s": n * 4 / pull / 1e6,
            "pushpull_mb_s": n * 4 / both / 1e6,
        })
    if kv.rank == 0:
        print(json.dumps({"test": "mxnet-kv", "workers": kv.num_workers, "results": rows}))


if __name__ == "__main__":
    main()

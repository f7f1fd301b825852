"""Row pulls and training steps of an embedding table, psnet against MXNet 1.9.1's row_sparse,
one script for both, next to a dense pull and a dense step of a table of the same size in the
same job:

    psnet-launch -n 2 -s 2 -- python scripts/bench-rows.py --lib psnet
    psnet-launch -n 2 -s 2 -- /tmp/mxvenv/bin/python scripts/bench-rows.py --lib mxnet

psnet's side is its compact row pull (`kv.pull_rows`: the rows land in an array of those rows
only, as MXNet's row_sparse result holds them); MXNet's is `row_sparse_pull` into a row_sparse
NDArray. Each timed pull asks for a fresh random set of `--touched` of the rows (unique,
sorted). A step is what a worker of a sparse model does each batch: push the gradient of the
rows it touched (a fresh random set of `--touched` of the rows, values drawn before timing)
and pull those rows back, updated by the servers' SGD (MXNet's lazy update); the dense step
pushes and pulls the whole table. psnet's row push is `kv.push_rows`, MXNet's a push of a
row_sparse NDArray. Rank 0 prints one JSON line: the medians, in milliseconds, and their
ratios. Only a release build of psnet's wheel means anything here.
"""
import argparse
import json
import os
import time

# NumPy's BLAS threads spin after a call and take the 2 cores' time from the job's processes:
# one thread for both libraries alike.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", choices=["psnet", "mxnet"], default="psnet")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--touched", type=float, default=0.01, help="fraction of rows per pull")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    shape = (args.rows, args.width)
    n = max(1, int(args.rows * args.touched))

    # A scheduler or server process runs its loop inside this import, and exits there.
    if args.lib == "mxnet":
        import mxnet as mx
        import numpy as np

        kv = mx.kv.create("dist_sync")
        kv.init(0, mx.nd.ones(shape).tostype("row_sparse"))
        kv.init(1, mx.nd.ones(shape))
        kv.init(2, mx.nd.ones(shape).tostype("row_sparse"))
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.01))
        dense_out = mx.nd.empty(shape)
        dense_grad = mx.nd.ones(shape) * 0.5
        rows_out = mx.nd.sparse.zeros("row_sparse", shape)
        step_out = mx.nd.sparse.zeros("row_sparse", shape)

        def dense_step():
            kv.push(1, dense_grad)
            kv.pull(1, out=dense_out)
            dense_out.wait_to_read()

        def row_step(ids, grad):
            ids_nd = mx.nd.array(ids, dtype="int64")
            g = mx.nd.sparse.row_sparse_array((mx.nd.array(grad), ids_nd), shape=shape)
            kv.push(2, g)
            kv.row_sparse_pull(2, out=step_out, row_ids=ids_nd)
            step_out.wait_to_read()

        def dense():
            kv.pull(1, out=dense_out)
            dense_out.wait_to_read()

        def rows(ids):
            kv.row_sparse_pull(0, out=rows_out, row_ids=mx.nd.array(ids, dtype="int64"))
            rows_out.wait_to_read()
            return rows_out.data.shape[0]
    else:
        import numpy as np
        import psnet

        kv = psnet.kvstore.create("dist_sync")
        kv.init(0, np.ones(shape, dtype=np.float32))
        kv.init(1, np.ones(shape, dtype=np.float32))
        kv.init(2, np.ones(shape, dtype=np.float32), stype="row_sparse")
        kv.set_optimizer(psnet.optimizer.SGD(learning_rate=0.01))
        dense_out = np.empty(shape, dtype=np.float32)
        dense_grad = np.full(shape, 0.5, dtype=np.float32)
        rows_out = np.empty((n, args.width), dtype=np.float32)
        step_out = np.empty((n, args.width), dtype=np.float32)

        def dense_step():
            kv.push(1, dense_grad)
            kv.pull(1, out=dense_out)

        def row_step(ids, grad):
            kv.push_rows(2, ids, grad)
            kv.pull_rows(2, ids, out=step_out)

        def dense():
            kv.pull(1, out=dense_out)

        def rows(ids):
            kv.pull_rows(0, ids, out=rows_out)
            return rows_out.shape[0]

    def median_ms(op, warmup=2):
        times = []
        for i in range(warmup + args.iters):
            start = time.perf_counter()
            op(i)
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1e3)
        times.sort()
        return times[len(times) // 2]

    def ids_of(i):
        rng = np.random.default_rng(1000 * kv.rank + i)
        return np.sort(rng.choice(args.rows, n, replace=False))

    got = rows(ids_of(0))
    assert got == n, f"{args.lib} pulled {got} rows, asked for {n}"
    dense_ms = median_ms(lambda i: dense())
    rows_ms = median_ms(lambda i: rows(ids_of(i)))
    # Every step's rows and gradient, drawn before the clock runs.
    steps = [(ids_of(10_000 + i), np.random.default_rng(i).standard_normal(
        (n, args.width)).astype(np.float32)) for i in range(2 + args.iters)]
    dense_step_ms = median_ms(lambda i: dense_step())
    row_step_ms = median_ms(lambda i: row_step(*steps[i]))
    if kv.rank == 0:
        print(json.dumps({
            "lib": args.lib, "workers": kv.num_workers, "rows": args.rows, "width": args.width,
            "rows_per_pull": n, "dense_pull_ms": round(dense_ms, 3),
            "row_pull_ms": round(rows_ms, 3), "dense_over_rows": round(dense_ms / rows_ms, 1),
            "dense_step_ms": round(dense_step_ms, 3), "row_step_ms": round(row_step_ms, 3),
            "dense_step_over_row_step": round(dense_step_ms / row_step_ms, 1),
        }), flush=True)


if __name__ == "__main__":
    main()

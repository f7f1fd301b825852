#!/usr/bin/env python3
"""Open MPI's MPI_Allreduce (float32, sum, in place), timed the way `psnet-perf allreduce` times
psnet's, for scripts/bench-allreduce.sh. Run it under mpirun:

    mpirun -np 4 python3 scripts/bench-mpi-allreduce.py -b 128K -e 64M -f 2 -n 20 -w 5

For each size (-b, -e, -f as nccl-tests and psnet-perf take them): -w untimed iterations, a
barrier, -n timed iterations; the time is the average iteration, the slowest rank's (an
allreduce of each rank's average with MPI_MAX). Then one more iteration on inputs whose sum is
known exactly (small integers), and the wrong elements are counted on every rank and summed.
Rank 0 prints JSON Lines with psnet-perf's field names: bytes, count, time_us, algbw_gb_s
(bytes / time, 10^9 bytes/s), busbw_gb_s (algbw x 2(n-1)/n), wrong.
"""

import argparse
import json
import sys

import numpy as np
from mpi4py import MPI


def parse_size(text):
    """64, 4K, 16M, 1G: powers of 1024, as psnet-perf reads them."""
    t = text.strip().upper()
    for suffix in ("IB", "B"):
        if t.endswith(suffix) and len(t) > len(suffix):
            t = t[: -len(suffix)]
            break
    shift = {"K": 10, "M": 20, "G": 30}.get(t[-1:], 0)
    if shift:
        t = t[:-1]
    return int(t) << shift


def sizes(minbytes, maxbytes, factor):
    size = minbytes
    while size <= maxbytes:
        yield size
        size *= factor


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("128M"))
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("--label", default="", help="put into every line as \"label\"")
    args = p.parse_args()
    if args.stepfactor < 2 or args.iters < 1 or args.minbytes < 1:
        sys.exit("bench-mpi-allreduce: -f must be at least 2, -n and -b at least 1")

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    top = args.maxbytes // 4
    work = np.zeros(max(top, 1), dtype=np.float32)
    # Rank r's input at index i: 1 + (r + i) % 4, and the exact sum over the ranks.
    index = np.arange(max(top, 1), dtype=np.int64)
    wrong_total = 0
    for size in sizes(args.minbytes, args.maxbytes, args.stepfactor):
        count = size // 4
        buf = work[:count]
        buf[:] = 1.0 + ((rank + index[:count]) % 4)
        for _ in range(args.warmup_iters):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        comm.Barrier()
        start = MPI.Wtime()
        for _ in range(args.iters):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        mine = (MPI.Wtime() - start) / args.iters
        seconds = comm.allreduce(mine, op=MPI.MAX)
        # The check: one more call on known inputs.
        buf[:] = 1.0 + ((rank + index[:count]) % 4)
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        want = sum(1 + ((r + index[:count]) % 4) for r in range(n)) if count else index[:0]
        wrong = int(np.count_nonzero(buf != want)) if count else 0
        wrong = comm.allreduce(wrong, op=MPI.SUM)
        wrong_total += wrong
        if rank == 0:
            algbw = count * 4 / seconds / 1e9
            print(
                json.dumps(
                    {
                        "collective": "allreduce",
                        "implementation": "openmpi",
                        "label": args.label,
                        "dtype": "float",
                        "op": "sum",
                        "ranks": n,
                        "in_place": True,
                        "iters": args.iters,
                        "warmup_iters": args.warmup_iters,
                        "bytes": count * 4,
                        "count": count,
                        "time_us": seconds * 1e6,
                        "algbw_gb_s": algbw,
                        "busbw_gb_s": algbw * 2 * (n - 1) / n,
                        "wrong": wrong,
                    }
                ),
                flush=True,
            )
    if wrong_total:
        if rank == 0:
            print(f"bench-mpi-allreduce: {wrong_total} wrong elements", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

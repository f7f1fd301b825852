"""torch.distributed's all_to_all_single on psnet's backend against gloo: N ranks on this host
over TCP (psnet with PSNET_SHM_RING=0: sockets only, as gloo's), CPU tensors, 64 MiB sent by
each rank by default; the two backends alternate, each run starting its own torchrun.

    python3 python/benchmarks/alltoall.py [--ranks 4] [--mib 64] [--rounds 2] [--iters 5]

Prints each run's time per call (the slowest rank's) and algbw / busbw as nccl-tests define
them for all-to-all (bytes per rank over time; busbw = algbw x (n-1)/n), and per round
psnet / gloo. `--write-step PATH` writes the per-rank script for launchers of their own
(scripts/bench-cluster.sh runs it on each host of the emulated cluster).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _compare import compare, write_step  # noqa: E402

STEP = """
import sys, time, torch, torch.distributed as dist
import psnet.torch
iters, backend, mib = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group(backend)
r, n = dist.get_rank(), dist.get_world_size()
elems = (mib << 20) // 4 // n * n
x = torch.full((elems,), float(r))
y = torch.empty_like(x)
dist.all_to_all_single(y, x)
block = elems // n
assert all(y[i * block].item() == float(i) for i in range(n)), "wrong result"
dist.barrier()
t = time.perf_counter()
for _ in range(iters):
    dist.all_to_all_single(y, x)
dist.barrier()
s = torch.tensor([(time.perf_counter() - t) / iters])
dist.all_reduce(s, op=dist.ReduceOp.MAX)
if r == 0:
    algbw = elems * 4 / s.item() / 1e9
    print(f"RESULT {backend} bytes={elems * 4} ms={s.item() * 1e3:.2f} algbw={algbw:.3f} "
          f"busbw={algbw * (n - 1) / n:.3f}", flush=True)
dist.destroy_process_group()
"""


def ms_of(line):
    return float(line.split("ms=")[1].split()[0])


def main():
    p = argparse.ArgumentParser(description="all_to_all_single: psnet against gloo")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--write-step", metavar="PATH")
    args = p.parse_args()
    if args.write_step:
        write_step(STEP, args.write_step)
        return
    compare(STEP, "alltoall", args.ranks, args.rounds, [args.iters, args.mib], 29650, ms_of,
            lambda p, g: f"psnet {p:.1f} ms, gloo {g:.1f} ms, "
                         f"gloo / psnet (throughput ratio) {g / p:.2f}")


if __name__ == "__main__":
    main()

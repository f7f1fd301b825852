"""A DDP step on psnet's torch.distributed backend against the same step on gloo: 2 ranks on
this host over TCP, a ~10 M-parameter MLP, CPU tensors; the two backends alternate, each
run starting its own torchrun.

    python3 python/benchmarks/ddp_step.py [--rounds 2] [--steps 20]

Prints each run's time per step (the slowest rank's) and, per round, psnet / gloo.
Needs torch; psnet's side runs with PSNET_SHM_RING=0 (sockets only, as gloo's TCP).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _compare import compare, write_step  # noqa: E402

STEP = """
import sys, time, torch, torch.distributed as dist
import psnet.torch
steps = int(sys.argv[1])
dist.init_process_group(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                            torch.nn.Linear(4096, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 10))
params = sum(p.numel() for p in model.parameters())
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
x = torch.randn(32, 1024)
y = torch.randint(0, 10, (32,))
def step():
    opt.zero_grad()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
for _ in range(3):
    step()
dist.barrier()
t = time.perf_counter()
for _ in range(steps):
    step()
dist.barrier()
ms = torch.tensor([(time.perf_counter() - t) / steps * 1e3])
dist.all_reduce(ms, op=dist.ReduceOp.MAX)
if dist.get_rank() == 0:
    print(f"RESULT {sys.argv[2]} params={params} ms_per_step={ms.item():.2f}", flush=True)
dist.destroy_process_group()
"""


def ms_of(line):
    return float(line.split("ms_per_step=")[1])


def main():
    p = argparse.ArgumentParser(description="DDP step time: psnet against gloo")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--write-step", metavar="PATH",
                   help="only write the per-rank step script to PATH (run as `python PATH STEPS "
                        "BACKEND` under torch.distributed's env:// variables, as "
                        "scripts/bench-cluster.sh does on each host) and exit")
    args = p.parse_args()
    if args.write_step:
        write_step(STEP, args.write_step)
        return
    compare(STEP, "ddp-step", 2, args.rounds, [args.steps], 29600, ms_of,
            lambda p, g: f"psnet {p:.2f} ms, gloo {g:.2f} ms, psnet / gloo {p / g:.2f}")


if __name__ == "__main__":
    main()

"""An FSDP2 (fully_shard) training step on psnet's torch.distributed backend against the same
step on gloo: N ranks on this host over TCP (psnet with PSNET_SHM_RING=0: sockets only), the
9.45 M-parameter MLP of ddp_step.py with each layer sharded, CPU tensors; the backends
alternate, each run starting its own torchrun.

    python3 python/benchmarks/fsdp2_step.py [--ranks 2] [--rounds 2] [--steps 10]

`--write-step PATH` writes the per-rank script (`python PATH STEPS BACKEND` under
torch.distributed's env:// variables), as scripts/bench-cluster.sh runs it on each host.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

STEP = """
import sys, time, torch, torch.distributed as dist
import psnet.torch
from torch.distributed.fsdp import fully_shard
steps = int(sys.argv[1])
dist.init_process_group(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                            torch.nn.Linear(4096, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 10))
params = sum(p.numel() for p in model.parameters())
for m in model:
    if isinstance(m, torch.nn.Linear):
        fully_shard(m)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 1024)
y = torch.randint(0, 10, (32,))
def step():
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
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


def run(backend, ranks, steps, script, port):
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PSNET_SHM_RING="0", OMP_NUM_THREADS="1")
    out = subprocess.run([torchrun, "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
                          "--master-port", str(port), script, str(steps), backend],
                         env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("RESULT"))
    print(line, flush=True)
    return float(line.split("ms_per_step=")[1])


def main():
    p = argparse.ArgumentParser(description="FSDP2 step time: psnet against gloo")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--write-step", metavar="PATH")
    args = p.parse_args()
    if args.write_step:
        with open(args.write_step, "w") as f:
            f.write(STEP)
        return
    script = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"psnet-fsdp2-step-{os.getpid()}.py")
    with open(script, "w") as f:
        f.write(STEP)
    port = 29680
    try:
        for r in range(args.rounds):
            ms = {}
            for backend in ("psnet", "gloo"):
                port += 1
                ms[backend] = run(backend, args.ranks, args.steps, script, port)
                time.sleep(1)
            print(f"round {r}: psnet {ms['psnet']:.2f} ms, gloo {ms['gloo']:.2f} ms, "
                  f"psnet / gloo {ms['psnet'] / ms['gloo']:.2f}", flush=True)
    finally:
        os.remove(script)


if __name__ == "__main__":
    main()

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
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _compare import compare, write_step  # noqa: E402
from ddp_step import STEP as DDP_STEP, ms_of  # noqa: E402

# The DDP step with each Linear layer, then the whole model, under fully_shard instead of DDP.
STEP = DDP_STEP.replace("import psnet.torch\n", "import psnet.torch\n"
                        "from torch.distributed.fsdp import fully_shard\n").replace(
    "ddp = torch.nn.parallel.DistributedDataParallel(model)\n",
    "for m in model:\n"
    "    if isinstance(m, torch.nn.Linear):\n"
    "        fully_shard(m)\n"
    "fully_shard(model)\n"
    "ddp = model\n")
assert "fully_shard(model)" in STEP, "ddp_step.py's step changed shape"


def main():
    p = argparse.ArgumentParser(description="FSDP2 step time: psnet against gloo")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--write-step", metavar="PATH")
    args = p.parse_args()
    if args.write_step:
        write_step(STEP, args.write_step)
        return
    compare(STEP, "fsdp2-step", args.ranks, args.rounds, [args.steps], 29680, ms_of,
            lambda p, g: f"psnet {p:.2f} ms, gloo {g:.2f} ms, psnet / gloo {p / g:.2f}")


if __name__ == "__main__":
    main()

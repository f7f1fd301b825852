"""A PyTorch DDP training script on psnet's torch.distributed backend.

    torchrun --nproc-per-node 2 python/examples/torch_ddp.py            # psnet
    torchrun --nproc-per-node 2 python/examples/torch_ddp.py --backend gloo
    torchrun --nproc-per-node 2 python/examples/torch_ddp.py --compress 0.01

The script is an ordinary DDP script: the only psnet line is ``import psnet.torch``, which
registers the backend. ``--compress T`` adds psnet's 2-bit communication hook (threshold T,
error feedback; lossy).
"""

import argparse
import time

import torch
import torch.distributed as dist

import psnet.torch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="psnet")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--compress", type=float, default=None, help="2-bit threshold")
    args = p.parse_args()

    dist.init_process_group(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if args.compress is not None:
        ddp.register_comm_hook(psnet.torch.CompressionState(threshold=args.compress),
                               psnet.torch.compressed_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(512, 64, generator=g)
    y = x[:, :10].argmax(dim=1)
    start = time.perf_counter()
    for step in range(args.steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if rank == 0:
        ms = (time.perf_counter() - start) / args.steps * 1e3
        print(f"{args.backend}: {size} ranks, {ms:.2f} ms per step", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

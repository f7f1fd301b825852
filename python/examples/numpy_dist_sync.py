"""Softmax regression trained with psnet's dist_sync kvstore, in NumPy.

Run it as a job of 2 workers and 2 servers on this host:

    psnet-launch -n 2 -s 2 python3 python/examples/numpy_dist_sync.py

Every process runs this file: in the scheduler and the servers, ``import psnet`` serves until
the job ends; each worker trains on its shard of a synthetic data set, pushes its gradients
and pulls the weights the servers' SGD computed from every worker's sum.
"""

import argparse

import numpy as np

import psnet


def data(n, features, classes, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((classes, features)).astype(np.float32) * 2
    labels = rng.integers(0, classes, n)
    x = centers[labels] + rng.standard_normal((n, features)).astype(np.float32)
    return x.astype(np.float32), labels


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--kvstore", default="dist_sync")
    args, _ = p.parse_known_args()

    kv = psnet.kvstore.create(args.kvstore)
    rank, workers = kv.rank, kv.num_workers
    features, classes = 32, 4
    x, y = data(4096, features, classes)
    shard = slice(rank * len(x) // workers, (rank + 1) * len(x) // workers)
    x, y = x[shard], y[shard]

    w = np.zeros((features, classes), dtype=np.float32)
    b = np.zeros(classes, dtype=np.float32)
    kv.set_optimizer(psnet.optimizer.SGD(learning_rate=args.lr, rescale_grad=1.0 / workers))
    kv.init(["weight", "bias"], [w, b])
    for epoch in range(args.epochs):
        losses = []
        for start in range(0, len(x) - args.batch + 1, args.batch):
            xb, yb = x[start:start + args.batch], y[start:start + args.batch]
            logits = xb @ w + b
            logits -= logits.max(axis=1, keepdims=True)
            prob = np.exp(logits)
            prob /= prob.sum(axis=1, keepdims=True)
            losses.append(-np.log(prob[np.arange(len(yb)), yb] + 1e-12).mean())
            prob[np.arange(len(yb)), yb] -= 1
            gw = (xb.T @ prob / len(yb)).astype(np.float32)
            gb = (prob.mean(axis=0)).astype(np.float32)
            kv.pushpull(["weight", "bias"], [gw, gb], out=[w, b])
        accuracy = ((x @ w + b).argmax(axis=1) == y).mean()
        print(f"worker {rank}: epoch {epoch} loss {np.mean(losses):.4f} accuracy {accuracy:.3f}",
              flush=True)


if __name__ == "__main__":
    main()

"""An unchanged MXNet 1.9.1 gluon training script whose kvstore is psnet's: a small network, SGD
with momentum, updates on the servers, one argument apart from MXNet's own ``dist_sync``::

    psnet-launch -n 2 -s 1 -- python python/examples/mxnet_gluon.py --kvstore dist_sync_psnet
    psnet-launch -n 2 -s 1 -- python python/examples/mxnet_gluon.py --kvstore dist_sync

(the second is MXNet's own parameter server, which psnet-launch starts as ps-lite's launcher
would). Both train the same model on the same data; ``--dump FILE`` writes rank 0's final
weights (float32, the parameters in order) to compare the two runs. Needs MXNet 1.9.1
(Python 3.10 or older: ``pip install mxnet==1.9.1 numpy==1.23.5``) and, for psnet's store,
psnet's wheel built for that Python.
"""
import argparse

ap = argparse.ArgumentParser()
ap.add_argument("--kvstore", default="dist_sync_psnet",
                help="dist_sync_psnet / dist_async_psnet (psnet) or dist_sync (MXNet's own)")
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--dump", help="rank 0 writes its final weights here")
args = ap.parse_args()

# psnet's scheduler and servers serve inside this import (and exit), before mxnet would start
# ps-lite's in them.
if "psnet" in args.kvstore:
    import psnet.mxnet  # noqa: F401

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

mx.random.seed(7)
np.random.seed(7)
net = gluon.nn.Sequential()
net.add(gluon.nn.Dense(32, activation="relu", in_units=16), gluon.nn.Dense(4, in_units=32))
net.initialize(mx.init.Xavier(), ctx=mx.cpu())
kv = mx.kv.create(args.kvstore)
trainer = gluon.Trainer(net.collect_params(), "sgd",
                        {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-4}, kvstore=kv)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

# Each worker its own shard of one fixed data set: a linear teacher's labels.
rank = kv.rank
teacher = np.random.RandomState(0).randn(16, 4).astype(np.float32)
data_rng = np.random.RandomState(100 + rank)
for step in range(args.steps):
    x = data_rng.randn(args.batch, 16).astype(np.float32)
    y = (x @ teacher).argmax(axis=1).astype(np.float32)
    x, y = mx.nd.array(x), mx.nd.array(y)
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(args.batch)
    if step % 10 == 0 or step == args.steps - 1:
        print(f"rank {rank} step {step} loss {loss.mean().asscalar():.6f}",
              flush=True)

if args.dump and rank == 0:
    weights = [p.data().asnumpy().ravel() for p in net.collect_params().values()]
    np.concatenate(weights).astype(np.float32).tofile(args.dump)

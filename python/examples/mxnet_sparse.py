"""An unchanged MXNet 1.9.1 gluon script with a row_sparse embedding
(``gluon.contrib.nn.SparseEmbedding``: its weight is row_sparse, and each batch fetches only
the rows it uses and pushes only their gradients), over psnet's store or MXNet's own::

    psnet-launch -n 2 -s 2 -- python python/examples/mxnet_sparse.py --kvstore dist_sync_psnet
    psnet-launch -n 2 -s 2 -- python python/examples/mxnet_sparse.py --kvstore dist_sync

``--dump FILE`` writes rank 0's final weights (float32, the embedding table, then the dense
layer's) to compare the two runs. Needs MXNet 1.9.1 and, for psnet's store, psnet's wheel
built for that Python.
"""
import argparse
import os

ap = argparse.ArgumentParser()
ap.add_argument("--kvstore", default="dist_sync_psnet")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--dump", help="rank 0 writes its final weights here")
args = ap.parse_args()

if "psnet" in args.kvstore:
    import psnet.mxnet  # noqa: F401

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

ROWS, DIM, CLASSES = 200, 8, 4
mx.random.seed(7)
np.random.seed(7)
embed = gluon.contrib.nn.SparseEmbedding(ROWS, DIM)
dense = gluon.nn.Dense(CLASSES, in_units=DIM)
params = gluon.ParameterDict()
params.update(embed.collect_params())
params.update(dense.collect_params())
params.initialize(mx.init.Xavier(), ctx=mx.cpu())
# The batch size is in rescale_grad from the start and step() is given 1: a row_sparse weight
# initializes the store in the first forward, before the first step could set it (gluon then
# refuses a step whose batch size changes the factor).
trainer = gluon.Trainer(params, "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3,
                                        "rescale_grad": 1.0 / 16},
                        kvstore=args.kvstore)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
# Gluon takes a store with row_sparse weights by name only; the launcher's worker index seeds
# each worker's data (with two workers a sum's order cannot change its bits).
rank = int(os.environ["DMLC_WORKER_ID"])
rng = np.random.RandomState(100 + rank)
for step in range(args.steps):
    # A batch uses a few rows of the table; the label is the row's class.
    ids = rng.randint(0, ROWS, size=(16,))
    x, y = mx.nd.array(ids), mx.nd.array(ids % CLASSES)
    with autograd.record():
        loss = loss_fn(dense(embed(x)), y)
    loss.backward()
    trainer.step(1)
    if step % 10 == 0 or step == args.steps - 1:
        print(f"rank {rank} step {step} loss {loss.mean().asscalar():.6f}", flush=True)

if args.dump and rank == 0:
    table = embed.weight.row_sparse_data(mx.nd.arange(ROWS)).asnumpy()
    weights = [table.ravel()] + [p.data().asnumpy().ravel() for p in dense.collect_params().values()]
    np.concatenate(weights).astype(np.float32).tofile(args.dump)

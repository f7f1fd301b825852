"""psnet: a communication backend for distributed deep learning, from Python.

- ``psnet.kvstore.create('dist_sync')``: MXNet's kvstore API (``init``, ``push``, ``pull``,
  ``pushpull``, ``set_optimizer``, ``set_gradient_compression``, ``barrier``, ...) on NumPy
  arrays, over psnet's parameter server (RDMA or TCP).
- ``psnet.init()`` then ``psnet.allreduce``, ``allgather``, ``reduce_scatter``,
  ``broadcast``, ``reduce``, ``barrier``, ``alltoall``, ``gather``, ``scatter``: collectives
  among the job's ranks, named by psnet's, torchrun's, mpirun's or Slurm's variables; ``send``
  / ``recv`` / ``isend`` / ``irecv`` between two of them, ``recv_any`` from whichever rank
  sends first.

As with ``import mxnet``, importing psnet in a process that a launcher started as the job's
scheduler or a server (``DMLC_ROLE=scheduler|server``) runs that role until the job ends and
exits the process: one training script serves every role under ``psnet-launch``.
"""

import sys as _sys

from . import _psnet
from ._psnet import CollectiveError, KvError, PeerLostError, PsnetError
from . import exchange, kvstore, optimizer
from .collectives import (
    allgather,
    allreduce,
    barrier,
    broadcast,
    init,
    is_initialized,
    rank,
    reduce,
    reduce_scatter,
    shutdown,
    size,
)
from .exchange import Request, alltoall, gather, irecv, isend, recv, recv_any, scatter, send

__version__ = _psnet.__version__

__all__ = [
    "CollectiveError",
    "Request",
    "alltoall",
    "exchange",
    "gather",
    "irecv",
    "isend",
    "recv",
    "recv_any",
    "scatter",
    "send",
    "KvError",
    "PeerLostError",
    "PsnetError",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "init",
    "is_initialized",
    "kvstore",
    "optimizer",
    "rank",
    "reduce",
    "reduce_scatter",
    "shutdown",
    "size",
]


def _serve_if_launched_as_server():
    role = _psnet.role()
    if role in ("scheduler", "server"):
        _sys.exit(_psnet.run_role())


_serve_if_launched_as_server()

"""MXNet 1.9.1's trainer over psnet: ``import psnet.mxnet`` registers psnet's parameter server in
MXNet's kvstore registry, so that an MXNet script trains over psnet with one changed argument::

    import psnet.mxnet            # before mxnet: see below
    import mxnet as mx
    trainer = mx.gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                               kvstore='dist_sync_psnet')

Names (MXNet looks them up in ``mx.kv.create`` and ``gluon.Trainer``):

- ``dist_sync_psnet`` (also ``psnet``) and ``dist_async_psnet``: psnet's ``dist_sync`` and
  ``dist_async`` stores. Their ``type`` is ``dist_sync`` / ``dist_async``, so the trainer
  updates on the servers (``update_on_kvstore``) as it does with MXNet's own ``dist_*``
  stores. Gluon keeps a kvstore for one device only when its name contains ``dist``: pass
  ``kvstore='dist_sync_psnet'`` by name, or ``mx.kv.create('psnet')`` as an object.

Import ``psnet.mxnet`` (or ``psnet``) before ``mxnet``. Under a launcher, a process started as
the job's scheduler or a server serves psnet's role inside that import and exits; importing
``mxnet`` first would start MXNet's own ps-lite server in it, which cannot speak to psnet's
scheduler.

Row_sparse weights (``gluon.contrib.nn.SparseEmbedding``) work too: the trainer initializes
them as psnet's row-sparse keys, pushes only the rows a batch's gradient holds, and fetches
only the rows the next batch uses (``row_sparse_pull``); the servers update those rows only,
as MXNet's lazy update does. Gluon takes a store with row_sparse weights by name only
(``kvstore='dist_sync_psnet'``), not as an object. A dense weight with a row_sparse gradient
(``Embedding(sparse_grad=True)``) is refused: MXNet would update it lazily, and psnet's dense
keys update every row.

The trainer's MXNet optimizer object is translated to psnet's (:mod:`psnet.optimizer`):
``SGD``, ``Adam`` and ``Test``, with their learning rate, weight decay, ``rescale_grad``,
``clip_gradient``, momentum or betas. What psnet's servers do not run is refused by name:
a learning-rate schedule, per-parameter ``lr_mult`` / ``wd_mult`` other than 1, another
optimizer type. Values cross as NumPy copies of the NDArrays (``asnumpy``), which also waits
for MXNet's engine to have computed them; the results are written back with ``out[:] = ``.
"""

import numpy as np

from . import kvstore as _kvstore
from . import optimizer as _optimizer

import mxnet as _mx  # noqa: E402  (after psnet: a server process never gets here)
from mxnet.kvstore import KVStoreBase as _KVStoreBase  # noqa: E402
from mxnet.ndarray.sparse import row_sparse_array as _row_sparse_array  # noqa: E402
from mxnet.autograd import pause as _pause_recording  # noqa: E402


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _translate(opt):
    """psnet's optimizer for MXNet optimizer object ``opt``; a clear error for what psnet's
    servers do not run."""
    name = type(opt).__name__
    if getattr(opt, "lr_scheduler", None) is not None:
        raise ValueError(
            f"{name}: a learning-rate schedule (lr_scheduler) is not run by psnet's servers; "
            "set the optimizer again with the new rate")
    params = getattr(opt, "param_dict", None) or {}
    for index, param in params.items():
        for mult in ("lr_mult", "wd_mult"):
            value = getattr(param, mult, 1.0)
            if value != 1.0:
                raise ValueError(
                    f"{name}: parameter {getattr(param, 'name', index)} has {mult}={value}: "
                    "psnet's servers apply one optimizer to every key (1.0 only)")
    for mult in ("lr_mult", "wd_mult"):
        if any(v != 1.0 for v in (getattr(opt, mult, None) or {}).values()):
            raise ValueError(f"{name}: {mult} other than 1.0 is not run by psnet's servers")
    common = dict(rescale_grad=float(opt.rescale_grad))
    if getattr(opt, "multi_precision", False):
        # What psnet's servers always do for float16 keys (a float32 master copy).
        common["multi_precision"] = True
    clip = getattr(opt, "clip_gradient", None)
    kind = name.lower()
    if kind == "sgd":
        return _optimizer.SGD(learning_rate=float(opt.lr), momentum=float(opt.momentum),
                              wd=float(opt.wd), clip_gradient=clip,
                              lazy_update=bool(getattr(opt, "lazy_update", True)), **common)
    if kind == "adam":
        return _optimizer.Adam(learning_rate=float(opt.lr), beta1=float(opt.beta1),
                               beta2=float(opt.beta2), epsilon=float(opt.epsilon),
                               wd=float(opt.wd), clip_gradient=clip,
                               lazy_update=bool(getattr(opt, "lazy_update", True)), **common)
    if kind == "test":
        return _optimizer.Test(**common)
    raise ValueError(f"optimizer {name} is not one psnet's servers run (SGD, Adam, Test)")


class _PsnetStore(_KVStoreBase):
    """An MXNet kvstore over psnet's (see the module's documentation)."""

    _mode = "dist_sync"

    def __init__(self):
        self._kv = _kvstore.create(self._mode)
        self._declared = set()

    @property
    def type(self):
        """``dist_sync`` or ``dist_async``: what gluon reads to choose where updates run."""
        return self._mode

    @property
    def rank(self):
        """This worker's rank."""
        return self._kv.rank

    @property
    def num_workers(self):
        """The job's workers."""
        return self._kv.num_workers

    @staticmethod
    def is_capable(capability):
        """psnet's servers run the optimizer (``update_on_kvstore``)."""
        return capability.lower() == _KVStoreBase.OPTIMIZER

    def broadcast(self, key, value, out, priority=0):
        """Rank 0's ``value`` becomes the key's value on the servers (MXNet's ``init``: the
        other workers' values are ignored), and every ``out`` receives it."""
        del priority
        host = np.ascontiguousarray(value.asnumpy())
        self._kv.init(key, host)
        self._declared.add(key)
        got = np.empty_like(host)
        self._kv.pull(key, got)
        for o in _as_list(out):
            o[:] = got.reshape(o.shape)

    def pushpull(self, key, value, out=None, priority=0):
        """Pushes ``value`` (a list is summed first, as MXNet sums devices' gradients) and
        pulls the result into ``out``, or into ``value`` when ``out`` is None. With an
        optimizer set, the result is the updated weight (``update_on_kvstore``)."""
        del priority
        values = _as_list(value)
        hosts = [np.ascontiguousarray(v.asnumpy()) for v in values]
        got = np.empty_like(hosts[0])
        self._kv.pushpull(key, hosts if len(hosts) > 1 else hosts[0], out=got)
        for o in _as_list(value if out is None else out):
            o[:] = got.reshape(o.shape)

    # Gluon's calls for row_sparse weights (gluon.contrib.nn.SparseEmbedding): it initializes
    # them with init, pushes their row_sparse gradients with push and fetches the rows a batch
    # needs with row_sparse_pull; MXNet's KVStoreBase has none of the three.
    def init(self, key, value):
        """Initializes ``key`` with ``value``; a row_sparse ``value`` makes it a row-sparse key
        (pushed by rows, updated lazily on the servers)."""
        if value.stype == "row_sparse":
            self._kv.init(key, value.tostype("default").asnumpy(), stype="row_sparse")
        else:
            self._kv.init(key, np.ascontiguousarray(value.asnumpy()))
        self._declared.add(key)

    def push(self, key, value, priority=0):
        """Pushes ``value`` (a list, one per device, is summed first): a row_sparse gradient
        of a row-sparse key sends its rows only."""
        del priority
        values = _as_list(value)
        if values[0].stype == "row_sparse":
            self._kv.push(key, values)
        else:
            hosts = [np.ascontiguousarray(v.asnumpy()) for v in values]
            self._kv.push(key, hosts if len(hosts) > 1 else hosts[0])

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Pulls ``key``'s value into every ``out``."""
        del priority, ignore_sparse
        outs = _as_list(out)
        got = np.empty(outs[0].shape, dtype=outs[0].dtype)
        self._kv.pull(key, got)
        for o in outs:
            o[:] = got.reshape(o.shape)

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        """Fetches only rows ``row_ids`` of ``key`` into each row_sparse ``out`` (a list of
        outs takes a list of row ids, or one for all)."""
        del priority
        outs = _as_list(out)
        ids = _as_list(row_ids)
        if len(ids) == 1:
            ids = ids * len(outs)
        for o, r in zip(outs, ids):
            rows = np.unique(r.asnumpy().astype(np.int64))
            values = self._kv.pull_rows(key, rows)
            # Gluon pulls the rows inside the forward pass: the copy is not part of the graph.
            with _pause_recording():
                o[:] = _row_sparse_array((values, rows), shape=o.shape, dtype=o.dtype)

    def set_optimizer(self, optimizer):
        """MXNet's optimizer object, translated to psnet's (see the module's documentation)."""
        self._kv.set_optimizer(_translate(optimizer))

    def set_gradient_compression(self, compression_params):
        """MXNet's ``{'type': '2bit', 'threshold': 0.5}`` (see
        :meth:`psnet.kvstore.KVStore.set_gradient_compression`)."""
        self._kv.set_gradient_compression(compression_params)

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Every server writes a snapshot of its shard, optimizer state included, to
        ``PSNET_CHECKPOINT_DIR`` (``fname`` is not used; a restarted server reloads its
        own)."""
        self._kv.save_optimizer_states(fname, dump_optimizer)

    def load_optimizer_states(self, fname):
        """Not provided: a server reloads its optimizer state itself when it restarts from
        ``PSNET_CHECKPOINT_DIR``."""
        raise NotImplementedError(
            "load_optimizer_states: psnet's servers reload their optimizer state from "
            "PSNET_CHECKPOINT_DIR when they restart; there is no file to load from a worker")


# MXNet registers a class under its name, lower-cased.
@_KVStoreBase.register
class Dist_Sync_Psnet(_PsnetStore):  # noqa: N801  (the registered name)
    """psnet's ``dist_sync`` store as MXNet's ``dist_sync_psnet``."""

    _mode = "dist_sync"


@_KVStoreBase.register
class Psnet(_PsnetStore):
    """psnet's ``dist_sync`` store as MXNet's ``psnet``."""

    _mode = "dist_sync"


@_KVStoreBase.register
class Dist_Async_Psnet(_PsnetStore):  # noqa: N801  (the registered name)
    """psnet's ``dist_async`` store as MXNet's ``dist_async_psnet``."""

    _mode = "dist_async"


__all__ = ["Dist_Sync_Psnet", "Dist_Async_Psnet", "Psnet"]
del _mx

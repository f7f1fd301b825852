"""MXNet's kvstore API over psnet: ``psnet.kvstore.create('dist_sync')``.

Types, as MXNet names them:

- ``'local'``: one process; a push of a list of arrays is summed, then stored (or, with an
  optimizer set, applied to the stored value); no network.
- ``'dist_sync'`` / ``'dist_sync_device'``: psnet's parameter server; each round's pushes of
  every worker are summed on the servers before the update. Bit-identical to MXNet's
  arithmetic (sums in worker-rank order).
- ``'dist_async'`` / ``'dist_async_device'``: every push updates at once.

The ``_device`` forms are accepted for MXNet scripts and behave as their plain forms.

Keys are ints or strs (not both in one store); values are float32 or float16 NumPy arrays
or torch tensors, pushed and pulled in place without copying when C-contiguous and on the
CPU. In a dist store, one contiguous CUDA tensor per key (of the key's size) is taken where it
lies, by device pointer: pushed from device memory, or with gradient compression quantized on
the GPU (the residual stays there, and only the compressed bytes cross PCIe); pulled values
are copied into it (``PSNET_CUDA_TENSORS=staged`` stages it instead). Other CUDA tensors go
through a host copy made for the call (a pulled value is copied back into it when the call
ends).
A key initialized with ``stype='row_sparse'`` (an embedding table) is pushed by rows:
``push_rows`` (or ``push`` of a row-sparse value, one with ``stype``, ``indices`` and ``data``
as MXNet's) sends each server only the rows in its part, and the servers update only those
rows (MXNet's lazy update). ``row_sparse_pull`` fetches only the rows asked for, of any key.

A dist store needs a job: run the script under ``psnet-launch -n W -s S python3 train.py``
(or mpirun, srun, ...), which starts the scheduler, servers and workers; ``import psnet`` in
the scheduler and server processes serves until the job ends.
"""

import atexit
import numbers

import numpy as np

from . import _psnet
from . import optimizer as _optimizer
from ._arrays import as_array, is_tensor, on_gpu, readable, staged, writable

_TYPES = ("local", "dist_sync", "dist_async", "dist_sync_device", "dist_async_device")
_worker = None


def create(name="local"):
    """A kvstore of type ``name`` (see the module's documentation)."""
    if not isinstance(name, str):
        raise TypeError("name must be a string")
    if name == "device":
        name = "local"
    if name not in _TYPES:
        raise ValueError(f"unknown kvstore type {name!r}: one of {', '.join(_TYPES)}")
    if name == "local":
        return KVStore(name, None)
    global _worker
    if _worker is None:
        _worker = _psnet.Worker.join()
        atexit.register(_finalize)
    store = KVStore(name, _worker)
    _worker.set_mode("async" if "async" in name else "sync")
    return store


def _finalize():
    global _worker
    if _worker is not None:
        # Forgotten only once it left the job: if finalize fails (another thread still in a
        # call), the exit handler tries again.
        _worker.finalize()
        _worker = None


def _is_key(k):
    return isinstance(k, (str, numbers.Integral)) and not isinstance(k, bool)


class KVStore:
    """A key-value store for synchronizing parameters (MXNet's ``mxnet.kvstore.KVStore``)."""

    def __init__(self, name, worker):
        self._type = name
        self._worker = worker
        self._key_kind = None
        self._shapes = {}
        self._sizes = {}
        self._dtypes = {}
        # int key per name, once checked (the hot path skips _key's checks).
        self._ints = {}
        # 'local' only: values, and the optimizer applied to them.
        self._values = {}
        self._updater = None
        self._int_of_str = {}
        self._compression = None
        # Keys initialized row-sparse, and whether the optimizer updates lazily.
        self._row_sparse = set()
        self._lazy = True

    # --- properties ------------------------------------------------------------------------
    @property
    def type(self):
        """The type given to :func:`create`."""
        return self._type

    @property
    def rank(self):
        """This worker's rank (0 for ``local``)."""
        return 0 if self._worker is None else self._worker.rank

    @property
    def num_workers(self):
        """The number of workers (1 for ``local``)."""
        return 1 if self._worker is None else self._worker.num_workers

    # --- keys and values -------------------------------------------------------------------
    def _key(self, k, assign=False):
        """The int key for name ``k``. A str key gets its number at ``init`` only
        (``assign``), in the order of first use as MXNet does, so a failed call with a
        misspelt key cannot shift the numbers of the keys that follow."""
        if type(k) in (int, str) and k in self._ints:
            return self._ints[k]
        if not _is_key(k):
            raise TypeError(f"a key is an int or a str, not {type(k).__name__}")
        kind = str if isinstance(k, str) else int
        if self._key_kind is None:
            self._key_kind = kind
        elif kind is not self._key_kind:
            raise TypeError(
                f"key {k!r}: this store's keys are {self._key_kind.__name__}s; "
                "int and str keys cannot be mixed (as in MXNet)"
            )
        if kind is str:
            if not assign:
                raise ValueError(f"key {k!r} is not initialized (call init first)")
            if self._worker is not None:
                i = self._worker.key(k)
            else:
                i = self._int_of_str.setdefault(k, len(self._int_of_str))
        else:
            if k < 0:
                raise ValueError(f"key {k}: keys are non-negative")
            i = int(k)
        self._ints[k] = i
        return i

    def _items(self, key, value, what, write=False):
        """(name, [arrays]) per key: a key with a value or a list of values (one per device),
        or a list of keys with one such entry each. A key named twice gets the values of
        both, as MXNet groups them. ``write``: the arrays are written (CUDA tensors' host
        copies go back at the end of the call)."""
        if isinstance(key, (list, tuple)):
            if not isinstance(value, (list, tuple)) or len(value) != len(key):
                raise ValueError(f"{what}: {len(key)} keys need a list of {len(key)} values")
            items = zip(key, value)
        else:
            items = [(key, value)]
        merged = {}
        for k, v in items:
            if not _is_key(k):
                raise TypeError(f"a key is an int or a str, not {type(k).__name__}")
            vs = list(v) if isinstance(v, (list, tuple)) else [v]
            if not vs:
                raise ValueError(f"{what}: key {k!r} has no value")
            # Written outputs are only written: their host copies start empty.
            merged.setdefault(k, []).extend(
                as_array(x, f"{what} {k!r}", write, read=not write) for x in vs
            )
        return list(merged.items())

    def _pairs(self, key, value, what, write=False):
        """(name, int key, [arrays]) per key (see _items)."""
        return [(k, self._key(k), arrays) for k, arrays in self._items(key, value, what, write)]

    def _check_shape(self, name, array, what):
        size = self._sizes.get(name)
        if size is None:
            raise ValueError(f"{what}: key {name!r} is not initialized (call init first)")
        if array.size != size:
            raise ValueError(
                f"{what}: key {name!r} holds shape {self._shapes[name]}, given an array of "
                f"shape {array.shape}"
            )

    @staticmethod
    def _check_dtype(array, what):
        if array.dtype.char not in "fe":
            raise TypeError(
                f"{what}: the kvstore holds float32 and float16 values, not {array.dtype}"
            )

    def _merged(self, name, arrays, what):
        """The sum of one key's per-device values, in list order, as one contiguous array."""
        for a in arrays:
            self._check_dtype(a, what)
            self._check_shape(name, a, what)
            if a.dtype != arrays[0].dtype:
                raise TypeError(f"{what}: key {name!r} has values of {a.dtype} and {arrays[0].dtype}")
        merged = readable(arrays[0], what)
        if len(arrays) > 1:
            merged = merged.copy()
            for a in arrays[1:]:
                merged += a.reshape(merged.shape)
        return merged

    # --- MXNet's calls ---------------------------------------------------------------------
    def init(self, key, value, stype="default"):
        """Initializes keys (rank 0's values count; every worker waits for the others).

        ``stype='row_sparse'`` (MXNet's storage type of its row_sparse arrays; a value with
        ``stype == 'row_sparse'`` says so itself): each key is a table of rows (its first
        dimension) pushed by rows only (:meth:`push_rows`); a dense push of it is refused."""
        if getattr(value, "stype", None) == "row_sparse":
            stype = "row_sparse"
            value = _dense_of(value)
        if stype not in ("default", "row_sparse"):
            raise ValueError(f"init: stype is 'default' or 'row_sparse', not {stype!r}")
        with staged():
            self._init(key, value, stype == "row_sparse")

    def _init(self, key, value, row_sparse=False):
        items = self._items(key, value, "init")
        for name, arrays in items:
            self._check_dtype(arrays[0], "init")
            if name in self._shapes and self._worker is None:
                raise ValueError(f"init: key {name!r} is already initialized")
            if row_sparse and arrays[0].ndim == 0:
                raise ValueError(f"init: key {name!r}: a row-sparse key has rows (a dimension)")
        pairs = [(name, self._key(name, assign=True), arrays) for name, arrays in items]
        for name, _, arrays in pairs:
            self._shapes[name] = arrays[0].shape
            self._sizes[name] = arrays[0].size
            self._dtypes[name] = np.dtype(arrays[0].dtype)
            if row_sparse:
                self._row_sparse.add(name)
            else:
                self._row_sparse.discard(name)
        if self._worker is None:
            for name, _, arrays in pairs:
                self._values[name] = np.array(arrays[0], copy=True, order="C")
            return
        if row_sparse:
            for name, k, arrays in pairs:
                rows = max(arrays[0].shape[0], 1)
                self._worker.init_rows(k, arrays[0].size // rows, readable(arrays[0], "init"))
            return
        self._grouped(self._worker.init, [(k, readable(a[0], "init")) for _, k, a in pairs])

    def push(self, key, value, priority=0):
        """Pushes values (a list per key is summed first, as MXNet sums devices' values).

        ``priority`` is accepted for MXNet's signature; psnet orders requests by the order the
        keys were initialized, first first, which is what Gluon's ``priority=-index`` gives
        (``PSNET_KV_PRIORITY``)."""
        del priority
        # One key's row-sparse value, or its list of them (one per device).
        rows = _row_sparse_values(value) if _is_key(key) else None
        if rows is not None:
            self.push_rows(key, *rows)
            return
        with staged():
            self._push(key, value)

    def push_rows(self, key, row_ids, values):
        """Pushes a row-sparse gradient of ``key`` (initialized with ``stype='row_sparse'``):
        row ``row_ids[i]`` is ``values[i]``, every other row zero. Each server is sent only the
        rows in its part, and updates only the rows the workers pushed (MXNet's lazy update;
        without an optimizer the sum replaces the table, every other row zero, as MXNet's
        server does). Ids come in any order, each at most once."""
        if not _is_key(key):
            raise TypeError(f"a key is an int or a str, not {type(key).__name__}")
        with staged():
            self._push_rows(key, row_ids, values)

    def _push_rows(self, name, row_ids, values):
        shape, rows, width, ids = self._rows_of(name, row_ids, "push_rows")
        if name not in self._row_sparse:
            # MXNet would update a dense weight lazily by a row_sparse gradient (an embedding
            # with sparse_grad=True); pushing it dense would update every row instead.
            raise ValueError(f"push_rows: key {name!r} is dense: push it with push, or "
                             "initialize it with stype='row_sparse' to push its rows")
        if not self._lazy:
            raise ValueError("push_rows: the optimizer was set with lazy_update=False, and "
                             "psnet's servers update only the rows pushed (MXNet's "
                             "lazy_update=True): initialize the key dense and push dense "
                             "gradients for updates of every row")
        array = readable(as_array(values, f"push_rows {name!r}", False), "push_rows")
        if array.dtype != self._dtypes[name]:
            raise TypeError(f"push_rows: key {name!r} holds {self._dtypes[name]} values, "
                            f"pushed {array.dtype}")
        if array.size != ids.size * width or (
                array.ndim > 1 and array.shape != (ids.size,) + tuple(shape[1:])):
            raise ValueError(f"push_rows: key {name!r}: {ids.size} rows of {width} elements "
                             f"need {ids.size * width} values of shape "
                             f"{(ids.size,) + tuple(shape[1:])}, given {array.shape}")
        unique, counts = np.unique(ids, return_counts=True)
        if unique.size != ids.size:
            raise ValueError(f"push_rows: key {name!r}: row {unique[counts > 1][0]} is pushed "
                             "twice in one row push: sum its gradients first")
        flat = np.ascontiguousarray(array).reshape(-1)
        if self._worker is not None:
            self._worker.push_rows(self._key(name), width, ids.astype(np.uint64).tolist(), flat)
            return
        stored = self._values[name].reshape(rows, width)
        order = np.argsort(ids, kind="stable")
        grad = flat.reshape(ids.size, width)[order]
        if self._updater is None:
            stored[...] = 0
            stored[ids[order]] = grad
            return
        if stored.dtype != np.float32:
            raise TypeError("the local store's optimizer updates float32 values only")
        self._updater.update_rows(self._key(name), width, ids[order].astype(np.uint64).tolist(),
                                  np.ascontiguousarray(grad).reshape(-1), stored.reshape(-1))

    def _on_gpu(self, key, *tensors):
        """``(int key, [(pointer, elements, dtype, device)...])`` when ``key`` is one key and each
        tensor a contiguous CUDA tensor of its size, all on one device and of one type, that
        psnet takes where it lies (see ``_arrays.on_gpu``); None otherwise (staged)."""
        if self._worker is None or not _is_key(key):
            return None
        size = self._sizes.get(key)
        gpus = [on_gpu(t) for t in tensors]
        if size is None or any(g is None or g[1] != size for g in gpus):
            return None
        if len({(g[2], g[3]) for g in gpus}) != 1:
            return None
        return self._key(key), gpus

    def _gpu_call(self, call, key, *tensors):
        """Runs ``call`` (``_psnet.kv_push_cuda`` and its kin) on CUDA tensors where they lie,
        with their device current; False when they must be staged (not such tensors, or,
        logged once, this process cannot)."""
        gpu = self._on_gpu(key, *tensors)
        if gpu is None:
            return False
        import torch

        k, gpus = gpu
        _, numel, dtype, device = gpus[0]
        with torch.cuda.device(tensors[0].device):
            return call(self._worker, k, *(g[0] for g in gpus), numel, dtype, device)

    def _device_list(self, key, tensors):
        """``tensors`` when they are one key's list of CUDA tensors of the key's size and one
        dtype that psnet may take where they lie; None otherwise."""
        if (self._worker is None or not _is_key(key) or not isinstance(tensors, (list, tuple))
                or not tensors or _psnet.cuda_tensors() != "device"):
            return None
        size = self._sizes.get(key)
        for t in tensors:
            if (not is_tensor(t) or getattr(t.device, "type", None) != "cuda"
                    or not hasattr(t, "data_ptr") or t.numel() != size
                    or t.dtype != tensors[0].dtype or not t.is_contiguous()):
                return None
        return tensors

    def _device_sum(self, tensors):
        """The sum of a list of CUDA tensors on the first one's device, added in list order
        (one rounding per addition: the bits the staged path's NumPy sum, and MXNet's sum of
        devices' values, give)."""
        if len(tensors) == 1:
            return tensors[0]
        import torch

        with torch.no_grad():
            first = tensors[0]
            total = first.detach().clone()
            for t in tensors[1:]:
                total += t.detach().to(first.device).reshape(total.shape)
        return total

    @staticmethod
    def _copy_to_rest(tensors):
        """Copies the first of a list of CUDA tensors into the others (a pull's value)."""
        import torch

        with torch.no_grad():
            for t in tensors[1:]:
                t.copy_(tensors[0].reshape(t.shape))

    def _push(self, key, value):
        if self._gpu_call(_psnet.kv_push_cuda, key, value):
            return
        devices = self._device_list(key, value)
        if devices is not None and self._gpu_call(
                _psnet.kv_push_cuda, key, self._device_sum(devices)):
            return
        if self._worker is not None and type(value) is np.ndarray:
            k = self._key(key)
            size = self._sizes.get(key)
            if (size is not None and value.size == size and value.dtype.char in "fe"
                    and value.flags.c_contiguous):
                self._worker.push([k], [value])
                return
        pairs = [(n, k, self._merged(n, a, "push")) for n, k, a in self._pairs(key, value, "push")]
        if self._worker is None:
            for name, k, merged in pairs:
                self._apply_local(name, k, merged)
            return
        self._grouped(self._worker.push, [(k, m) for _, k, m in pairs])

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Pulls each key's value into ``out`` (an array, or a list of arrays per key).

        ``priority``: as for :meth:`push`."""
        del priority, ignore_sparse
        if out is None:
            raise ValueError("pull: out is required (the arrays to pull into)")
        with staged():
            self._pull(key, out)

    def _pull(self, key, out):
        if self._gpu_call(_psnet.kv_pull_cuda, key, out):
            return
        devices = self._device_list(key, out)
        if devices is not None and self._gpu_call(_psnet.kv_pull_cuda, key, devices[0]):
            self._copy_to_rest(devices)
            return
        if self._worker is not None and type(out) is np.ndarray:
            k = self._key(key)
            size = self._sizes.get(key)
            if (size is not None and out.size == size and out.dtype.char in "fe"
                    and out.flags.c_contiguous and out.flags.writeable):
                self._worker.pull([k], [out])
                return
        pairs = self._pairs(key, out, "pull", write=True)
        for name, _, arrays in pairs:
            for a in arrays:
                self._check_dtype(a, "pull out")
                self._check_shape(name, a, "pull out")
        if self._worker is None:
            for name, _, arrays in pairs:
                for a in arrays:
                    writable(a, "pull out")[...] = self._values[name].reshape(a.shape)
            return
        firsts = [(k, writable(arrays[0], "pull out")) for _, k, arrays in pairs]
        self._grouped(self._worker.pull, firsts)
        for _, _, arrays in pairs:
            for a in arrays[1:]:
                writable(a, "pull out")[...] = arrays[0].reshape(a.shape)

    def pushpull(self, key, value, out=None, priority=0):
        """Pushes ``value`` and pulls the result into ``out`` (``value`` itself if None).

        ``priority``: as for :meth:`push`."""
        del priority
        with staged():
            self._pushpull(key, value, out)

    def _pushpull(self, key, value, out):
        if self._gpu_call(_psnet.kv_pushpull_cuda, key, value, value if out is None else out):
            return
        devices = self._device_list(key, value)
        outs = devices if out is None else self._device_list(key, out)
        if (devices is not None and outs is not None and outs[0].dtype == devices[0].dtype
                and self._gpu_call(_psnet.kv_pushpull_cuda, key, self._device_sum(devices),
                                   outs[0])):
            self._copy_to_rest(outs)
            return
        if (self._worker is not None and type(value) is np.ndarray
                and (out is None or type(out) is np.ndarray)):
            # One key, one array: the per-step call of a training loop, kept short.
            k = self._key(key)
            o = value if out is None else out
            size = self._sizes.get(key)
            if (size is not None and value.size == size and o.size == size
                    and value.dtype.char in "fe" and o.dtype == value.dtype
                    and value.flags.c_contiguous and o.flags.c_contiguous
                    and o.flags.writeable):
                self._worker.pushpull([k], [value], [o])
                return
        pairs = [(n, k, self._merged(n, a, "pushpull"))
                 for n, k, a in self._pairs(key, value, "pushpull")]
        outs = self._pairs(key, value if out is None else out, "pushpull out", write=True)
        for (name, _, merged), (_, _, arrays) in zip(pairs, outs):
            for a in arrays:
                self._check_shape(name, a, "pushpull out")
                if a.dtype != merged.dtype:
                    raise TypeError(f"pushpull out: {a.dtype} where {merged.dtype} was pushed")
        if self._worker is None:
            for (name, k, merged), (_, _, arrays) in zip(pairs, outs):
                self._apply_local(name, k, merged)
                for a in arrays:
                    writable(a, "pushpull out")[...] = self._values[name].reshape(a.shape)
            return
        firsts = [writable(arrays[0], "pushpull out") for _, _, arrays in outs]
        self._grouped3(self._worker.pushpull, [(k, m) for _, k, m in pairs], firsts)
        for _, _, arrays in outs:
            for a in arrays[1:]:
                writable(a, "pushpull out")[...] = arrays[0].reshape(a.shape)

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        """Pulls only rows ``row_ids`` of each key (an embedding table's rows a step touches):
        the servers send those rows and nothing else. A key's rows are its first dimension.

        ``out`` is an array of the key's shape (or a list, one per device, with a list of
        ``row_ids`` to match); it ends as MXNet's row_sparse result reads densely: the rows
        asked for hold the key's values, every other row zeros. Ids may repeat and come in
        any order; an id past the last row, or none given, is an error. A list of keys takes
        lists of outs and ids. ``priority``: as for :meth:`push`."""
        del priority
        if out is None:
            raise ValueError("row_sparse_pull: out is required (the arrays to pull into)")
        if row_ids is None:
            raise ValueError("row_sparse_pull: row_ids is required (the rows to pull)")
        keys, outs, ids = (key, out, row_ids) if isinstance(key, (list, tuple)) else (
            [key], [out], [row_ids])
        if not (isinstance(outs, (list, tuple)) and isinstance(ids, (list, tuple))
                and len(outs) == len(ids) == len(keys)):
            raise ValueError(f"row_sparse_pull: {len(keys)} keys need as many outs and row_ids")
        for k, o, r in zip(keys, outs, ids):
            per_device = isinstance(o, (list, tuple))
            os_ = list(o) if per_device else [o]
            # Row ids per device: a list of id lists or arrays; a plain list of ints is one
            # set of ids, for every device.
            ids_per_device = (per_device and isinstance(r, (list, tuple)) and len(r) > 0
                              and not any(isinstance(x, numbers.Integral) for x in r))
            rs = list(r) if ids_per_device else [r] * len(os_)
            if len(rs) != len(os_):
                raise ValueError(f"row_sparse_pull: key {k!r}: {len(os_)} outs, {len(rs)} row_ids")
            with staged():
                for a, rows in zip(os_, rs):
                    self._pull_rows(k, a, rows)

    def pull_rows(self, key, row_ids, out=None):
        """psnet's compact row pull: rows ``row_ids`` of ``key`` (its first dimension), row
        ``row_ids[i]`` in ``out[i]``; ``out`` (C-contiguous, of shape ``(len(row_ids),) +
        the key's other dimensions``) is made when not given, and returned. Unlike
        :meth:`row_sparse_pull`, nothing else of an embedding table's size is written."""
        if not _is_key(key):
            raise TypeError(f"a key is an int or a str, not {type(key).__name__}")
        with staged():
            return self._pull_rows_compact(key, row_ids, out)

    def _pull_rows_compact(self, key, row_ids, out):
        shape, rows, width, ids = self._rows_of(key, row_ids, "pull_rows")
        if out is None:
            out = np.empty((ids.size,) + tuple(shape[1:]), dtype=self._dtypes[key])
        target = writable(as_array(out, f"pull_rows {key!r}", True, read=False), "pull_rows out")
        self._check_dtype(target, "pull_rows out")
        if target.dtype != self._dtypes[key]:
            raise TypeError(f"pull_rows: key {key!r} holds {self._dtypes[key]} values, "
                            f"out is {target.dtype}")
        if target.size != ids.size * width or not target.flags.c_contiguous:
            raise ValueError(f"pull_rows: key {key!r}: {ids.size} rows of {width} elements go "
                             f"into a C-contiguous array of {ids.size * width}, not {target.shape}")
        if ids.size:
            if self._worker is None:
                target.reshape(ids.size, width)[...] = self._values[key].reshape(rows, width)[ids]
            else:
                self._worker.pull_rows(self._key(key), width, ids.astype(np.uint64).tolist(),
                                       target.reshape(-1))
        return out

    def _rows_of(self, name, row_ids, what):
        """The key's shape, rows, row width and the row ids checked, as int64."""
        size = self._sizes.get(name)
        if size is None:
            raise ValueError(f"{what}: key {name!r} is not initialized (call init first)")
        shape = self._shapes[name]
        rows = shape[0] if len(shape) else 1
        width = size // max(rows, 1)
        ids = np.asarray(row_ids.cpu() if is_tensor(row_ids) else row_ids)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"{what}: key {name!r}: row ids are integers, not {ids.dtype}")
        ids = ids.astype(np.int64).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= rows):
            bad = ids[(ids < 0) | (ids >= rows)][0]
            raise ValueError(f"{what}: key {name!r}: row {bad} asked for, it has {rows} rows")
        return shape, rows, width, ids

    def _pull_rows(self, name, out, row_ids):
        if not _is_key(name):
            raise TypeError(f"a key is an int or a str, not {type(name).__name__}")
        target = as_array(out, f"row_sparse_pull {name!r}", True, read=False)
        self._check_dtype(target, "row_sparse_pull out")
        self._check_shape(name, target, "row_sparse_pull out")
        _, rows, width, ids = self._rows_of(name, row_ids, "row_sparse_pull")
        unique = np.unique(ids)
        fetched = np.empty((unique.size, width), dtype=target.dtype)
        if unique.size:
            if self._worker is None:
                fetched[...] = self._values[name].reshape(rows, width)[unique]
            else:
                self._worker.pull_rows(self._key(name), width, unique.astype(np.uint64).tolist(),
                                       fetched)
        dense = writable(target, "row_sparse_pull out").reshape(rows, width)
        dense[...] = 0
        dense[unique] = fetched

    def set_gradient_compression(self, compression_params):
        """MXNet's ``{'type': '2bit', 'threshold': 0.5}`` (or ``'1bit'``; ``'pull': True``
        compresses pulls too); dist stores only.

        Set once per job, the same on every worker. MXNet lets a job change the threshold
        later; psnet's servers keep the first settings they get and refuse others, naming
        them: a server sums pushes quantized under one setting with its residuals, and could
        not tell which pushes a change applies to (to change it, start the job again, from a
        checkpoint if need be)."""
        if self._worker is None:
            raise ValueError(
                "gradient compression is for dist kvstores (as in MXNet), not 'local'"
            )
        import json

        params = {k: (float(v) if k == "threshold" else v) for k, v in dict(compression_params).items()}
        self._worker.set_gradient_compression(json.dumps(params))
        self._compression = params

    def set_optimizer(self, optimizer, **params):
        """The optimizer the servers (or, for ``local``, this process) apply to pushed
        gradients: a :mod:`psnet.optimizer` object, or a name and its parameters."""
        if isinstance(optimizer, str):
            optimizer = _optimizer.create(optimizer, **params)
        elif params:
            raise TypeError("set_optimizer: parameters go with an optimizer's name only")
        if not isinstance(optimizer, _optimizer.Optimizer):
            raise TypeError(
                "set_optimizer: a psnet.optimizer object (SGD, Adam, Test) or a name"
            )
        spec = optimizer.spec()
        if self._worker is None:
            self._updater = _psnet.Updater(spec)
        else:
            self._worker.set_optimizer(spec)
        self._lazy = optimizer.lazy_update

    def barrier(self):
        """Waits for every worker."""
        if self._worker is not None:
            self._worker.barrier()

    _barrier = barrier

    def save_optimizer_states(self, fname=None, dump_optimizer=False):
        """Dist stores: every server writes a snapshot of its shard, optimizer state included,
        to ``PSNET_CHECKPOINT_DIR`` (``fname`` is not used: each server writes its own files,
        and a restarted server reloads them). Not provided for ``local``."""
        del fname, dump_optimizer
        if self._worker is None:
            raise NotImplementedError(
                "save_optimizer_states: the local store keeps no optimizer checkpoint"
            )
        self._worker.save_checkpoint()

    def close(self):
        """Leaves the job (done at exit otherwise); the store cannot be used afterwards."""
        if self._worker is not None:
            _finalize()
            self._worker = None

    # --- helpers ---------------------------------------------------------------------------
    def _apply_local(self, name, k, merged):
        if name in self._row_sparse:
            raise ValueError(f"key {name!r} is row-sparse: push its rows with push_rows, not a "
                             "dense push")
        stored = self._values[name]
        if self._updater is None:
            stored[...] = merged.reshape(stored.shape)
            return
        if stored.dtype != np.float32:
            raise TypeError("the local store's optimizer updates float32 values only")
        self._updater.update(k, np.ascontiguousarray(merged, dtype=np.float32).reshape(-1),
                             stored.reshape(-1))

    @staticmethod
    def _runs(items, dtype_of):
        """Consecutive items of one element type (one native call each)."""
        run = []
        for item in items:
            if run and dtype_of(run[-1]) != dtype_of(item):
                yield run
                run = []
            run.append(item)
        if run:
            yield run

    def _grouped(self, call, pairs):
        for run in self._runs(pairs, lambda p: p[1].dtype):
            call([k for k, _ in run], [a for _, a in run])

    def _grouped3(self, call, pairs, outs):
        items = [(k, a, o) for (k, a), o in zip(pairs, outs)]
        for run in self._runs(items, lambda p: p[1].dtype):
            call([k for k, _, _ in run], [a for _, a, _ in run], [o for _, _, o in run])


def _host(x):
    """A NumPy view (or copy) of an MXNet NDArray, a torch tensor or an array."""
    if hasattr(x, "asnumpy"):
        return x.asnumpy()
    if is_tensor(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _dense_of(value):
    """The dense form of a row-sparse value (MXNet's ``tostype('default')``)."""
    if hasattr(value, "tostype"):
        return _host(value.tostype("default"))
    return _host(value)


def _row_sparse_values(value):
    """``(row_ids, values)`` of a row-sparse value (MXNet's RowSparseNDArray: ``stype``,
    ``indices``, ``data``), or of a list of them (one per device: concatenated, a row given
    by several devices summed as MXNet sums devices' gradients); None for anything else."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items or any(getattr(v, "stype", None) != "row_sparse" for v in items):
        return None
    ids = np.concatenate([np.asarray(_host(v.indices), dtype=np.int64).ravel() for v in items])
    data = np.concatenate([_host(v.data) for v in items])
    unique, inverse = np.unique(ids, return_inverse=True)
    if unique.size == ids.size:
        return ids, data
    summed = np.zeros((unique.size,) + data.shape[1:], dtype=data.dtype)
    np.add.at(summed, inverse, data)
    return unique, summed

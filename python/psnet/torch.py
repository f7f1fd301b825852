"""psnet as a ``torch.distributed`` backend, and a compressed DDP communication hook.

``import psnet.torch`` registers the backend ``'psnet'``:

    import torch.distributed as dist
    import psnet.torch  # noqa: F401
    dist.init_process_group("psnet")          # under torchrun, psnet-launch, mpirun, ...
    model = torch.nn.parallel.DistributedDataParallel(model)

The process group runs psnet's collectives (RDMA or TCP, whichever the environment binds) on
CPU and CUDA tensors: allreduce, broadcast, allgather, reduce_scatter, reduce, barrier. An
allreduce of a contiguous CUDA tensor (DDP's buckets) runs on its GPU: pieces sent from device
memory, reduced into the tensor by psnet's kernels, bfloat16 included; a broadcast of one
(DDP's start) copies the pieces in on the GPU, and ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` of contiguous CUDA tensors on one GPU (FSDP's calls) run there too
(``PSNET_CUDA_TENSORS=staged`` stages them instead). Other CUDA tensors are staged through a
page-locked host copy, as gloo stages them, and written back when the call ends. Rank 0 draws
a free port on ``MASTER_ADDR`` (127.0.0.1 if unset) and hands it to the others through
torch's store, so psnet never competes with the store for ``MASTER_PORT``. Each call
completes before it returns (its ``Work`` is done at once). float32, float64, float16,
int32, int64 and uint8 tensors; bfloat16 tensors other than those reduced on the GPU are
refused with a clear error.

``compressed_allreduce_hook`` is a DDP communication hook: each bucket is averaged with
psnet's 2-bit (or 1-bit) allreduce with error feedback (lossy; the residual stays in the
hook's state):

    model.register_comm_hook(psnet.torch.CompressionState(threshold=0.5),
                             psnet.torch.compressed_allreduce_hook)
"""

import json
import os
import socket

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from . import _psnet
from ._arrays import (
    allgather_on_gpu,
    allreduce_on_gpu,
    broadcast_on_gpu,
    reduce_on_gpu,
    reduce_scatter_on_gpu,
)

BACKEND = "psnet"

_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.AVG: "avg",
}


def _op(reduce_op):
    op = getattr(reduce_op, "op", reduce_op)
    try:
        return _OPS[op]
    except (KeyError, TypeError):
        raise ValueError(f"psnet: the reduction {reduce_op} is not one psnet runs "
                         "(SUM, PRODUCT, MIN, MAX, AVG)") from None


def _array(t, what):
    """The NumPy array sharing a CPU tensor's memory."""
    if t.device.type != "cpu":
        raise TypeError(f"psnet {what}: a tensor on {t.device}; stage it with _Staged")
    if t.dtype == torch.bfloat16:
        raise TypeError(f"psnet {what}: bfloat16 tensors are not supported yet")
    if not t.is_contiguous():
        raise ValueError(f"psnet {what}: the tensor is not contiguous")
    return t.detach().numpy()


class _Staged:
    """A tensor as psnet's calls take it: a CPU tensor as it is; a CUDA tensor through a
    page-locked host copy (as gloo stages CUDA tensors), copied back into the tensor when a
    call that writes it ends. ``with _Staged(t, what, write=True) as a:`` gives the array."""

    def __init__(self, t, what, write=False):
        self.t, self.what, self.write = t, what, write
        self.host = None

    def __enter__(self):
        if self.t.device.type == "cpu":
            return _array(self.t, self.what)
        if self.t.device.type != "cuda":
            raise TypeError(f"psnet {self.what}: a tensor on {self.t.device}; the psnet backend "
                            "takes CPU and CUDA tensors")
        self.host = torch.empty(self.t.shape, dtype=self.t.dtype, pin_memory=True)
        # A copy to pageable-or-pinned host memory on the current stream, which torch waits
        # for before it returns: the values are on the host here (strided tensors too).
        with torch.no_grad():
            self.host.copy_(self.t)
        return _array(self.host, self.what)

    def __exit__(self, kind, value, traceback):
        if self.host is not None and self.write and kind is None:
            # Under no_grad: a tensor that requires grad (a parameter) is written in place
            # as on the CPU path, where the array shares its memory.
            with torch.no_grad():
                self.t.copy_(self.host)
        return False


def _done(result):
    fut = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class ProcessGroupPsnet(dist.ProcessGroup):
    """A ``torch.distributed`` process group over a psnet communicator."""

    def __init__(self, comm, rank, size):
        super().__init__(rank, size)
        self._comm = comm

    def getBackendName(self):  # noqa: N802 (torch's name)
        return BACKEND

    def name(self):
        return BACKEND

    def allreduce(self, tensors, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for t in tensors:
            if allreduce_on_gpu(self._comm, t, op):
                continue
            with _Staged(t, "allreduce", write=True) as a:
                self._comm.allreduce(a, op)
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            if broadcast_on_gpu(self._comm, t, root):
                continue
            with _Staged(t, "broadcast", write=True) as a:
                self._comm.broadcast(a, root)
        return _done(tensors)

    def reduce(self, tensors, opts=None):
        op, root = _op(opts.reduceOp), opts.rootRank
        for t in tensors:
            if reduce_on_gpu(self._comm, t, op, root):
                continue
            with _Staged(t, "reduce", write=True) as a:
                self._comm.reduce(a.copy(), a, op, root)
        return _done(tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outs, inp in zip(output_tensors, input_tensors):
            if self._allgather_list_on_gpu(outs, inp):
                continue
            with _Staged(inp, "allgather") as send:
                recv = np.empty(len(outs) * send.size, dtype=send.dtype)
                self._comm.allgather(send.reshape(-1), recv)
            for r, out in enumerate(outs):
                out.copy_(torch.from_numpy(recv[r * send.size:(r + 1) * send.size]).view_as(out))
        return _done(output_tensors)

    def _allgather_list_on_gpu(self, outs, inp):
        """Gathers ``inp`` into the list ``outs`` (one per rank) on their GPU, through one
        contiguous tensor there; False if they must be staged."""
        if (not _on_cuda(inp) or len(outs) != self._comm.size
                or any(not _on_cuda(o) or o.device != inp.device or o.dtype != inp.dtype
                       or o.numel() != inp.numel() for o in outs)):
            return False
        send = inp.contiguous()
        recv = send.new_empty((len(outs) * send.numel(),))
        if not allgather_on_gpu(self._comm, send.view(-1), recv):
            return False
        n = send.numel()
        with torch.no_grad():
            for r, out in enumerate(outs):
                out.copy_(recv[r * n:(r + 1) * n].view_as(out))
        return True

    def _allgather_base(self, output, input, opts=None):
        if allgather_on_gpu(self._comm, input, output):
            return _done([output])
        with _Staged(input, "allgather") as send, _Staged(output, "allgather", True) as recv:
            self._comm.allgather(send.reshape(-1), recv.reshape(-1))
        return _done([output])

    # torch 2.x's all_gather_into_tensor; newer torch names it all_gather_single.
    all_gather_single = _allgather_base

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for out, ins in zip(output_tensors, input_tensors):
            if self._reduce_scatter_list_on_gpu(out, ins, op):
                continue
            parts = []
            for t in ins:
                with _Staged(t, "reduce_scatter") as a:
                    parts.append(a.reshape(-1).copy())
            with _Staged(out, "reduce_scatter", write=True) as recv:
                self._comm.reduce_scatter(np.concatenate(parts), recv.reshape(-1), op)
        return _done(output_tensors)

    def _reduce_scatter_list_on_gpu(self, out, ins, op):
        """Reduces the list ``ins`` (one block per rank) into ``out`` on their GPU, through
        one contiguous tensor there; False if they must be staged."""
        if (not _on_cuda(out) or not out.is_contiguous() or len(ins) != self._comm.size
                or any(not _on_cuda(t) or t.device != out.device or t.dtype != out.dtype
                       or t.numel() != out.numel() for t in ins)):
            return False
        with torch.no_grad():
            send = torch.cat([t.reshape(-1) for t in ins])
        return reduce_scatter_on_gpu(self._comm, send, out.view(-1), op)

    def _reduce_scatter_base(self, output, input, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if reduce_scatter_on_gpu(self._comm, input, output, op):
            return _done([output])
        with _Staged(input, "reduce_scatter") as send, \
                _Staged(output, "reduce_scatter", True) as recv:
            self._comm.reduce_scatter(send.reshape(-1), recv.reshape(-1), op)
        return _done([output])

    # torch 2.x's reduce_scatter_tensor; newer torch names it reduce_scatter_single.
    reduce_scatter_single = _reduce_scatter_base

    def barrier(self, opts=None):
        self._comm.barrier()
        return _done(None)


def _on_cuda(t):
    """Whether ``t`` is a CUDA tensor psnet may take where it lies (by device pointer, with
    ``PSNET_CUDA_TENSORS=device``): worth gathering a list into one tensor on the GPU for."""
    return (getattr(getattr(t, "device", None), "type", None) == "cuda"
            and hasattr(t, "data_ptr") and _psnet.cuda_tensors() == "device")


def _free_port(host):
    family = socket.getaddrinfo(host, None)[0][0]
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _create(store, rank, size, timeout):
    """torch.distributed's creator: rank 0 publishes psnet's root address in the store."""
    del timeout  # psnet bounds its calls with PSNET_COLL_TIMEOUT
    key = "psnet/root"
    if rank == 0:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = _free_port(host)
        store.set(key, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    root = store.get(key).decode()
    return ProcessGroupPsnet(_psnet.Comm.join_world(rank, size, root), rank, size)


dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


class CompressionState:
    """State of :func:`compressed_allreduce_hook`: the scheme and threshold, and each bucket's
    residual (the quantization error carried to the next step)."""

    def __init__(self, threshold=0.5, type="2bit", process_group=None):
        self.params = json.dumps({"type": type, "threshold": float(threshold)})
        self.process_group = process_group
        self.residuals = {}


def compressed_allreduce_hook(state, bucket):
    """A DDP communication hook: the bucket's gradients averaged over the ranks with psnet's
    compressed allreduce (lossy, with error feedback). Float32 buckets; others are averaged
    exactly."""
    group = state.process_group or dist.group.WORLD
    pg = group if isinstance(group, ProcessGroupPsnet) else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupPsnet):
        raise RuntimeError("compressed_allreduce_hook needs the 'psnet' backend")
    buf = bucket.buffer()
    n = pg.size()
    if buf.dtype == torch.float32:
        index = bucket.index()
        residual = state.residuals.get(index)
        if residual is None or residual.size != buf.numel():
            residual = np.zeros(buf.numel(), dtype=np.float32)
            state.residuals[index] = residual
        with _Staged(buf, "compressed allreduce", write=True) as a:
            pg._comm.allreduce_compressed(a.reshape(-1), residual, state.params)
        buf.div_(n)
    else:
        with _Staged(buf, "allreduce", write=True) as a:
            pg._comm.allreduce(a, "avg")
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


__all__ = ["BACKEND", "CompressionState", "ProcessGroupPsnet", "compressed_allreduce_hook"]


"""Collectives among the job's ranks, on NumPy arrays and torch tensors (CPU and CUDA).

``psnet.init()`` joins every rank of the job. Rank, size and the root address come from
psnet's ``PSNET_RANK`` / ``PSNET_WORLD_SIZE`` / ``PSNET_ROOT_ADDR``, torchrun's ``RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``, mpirun's ``OMPI_COMM_WORLD_RANK`` /
``PMI_RANK``, or Slurm's ``SLURM_PROCID`` / ``SLURM_NTASKS`` (with a root address).

``allreduce``, ``broadcast`` and ``reduce`` work in place, as ``torch.distributed`` does, and
also return the result, as Horovod's calls do; their arrays must be C-contiguous and writable
(anything else is a ``ValueError``, never a silent copy). ``allgather`` and
``reduce_scatter`` return new arrays, tensors on the input's device for a tensor (or fill
``out``). ``allreduce`` of a contiguous CUDA tensor in place runs on its GPU: pieces are sent
from device memory and reduced into the tensor by psnet's kernels, to the bits the same
values give on the CPU; ``broadcast`` of one likewise copies the pieces in on the GPU, and
``allgather`` and ``reduce_scatter`` of one (with ``out`` on the same GPU, or none), and
``reduce`` of one, run there too (``PSNET_CUDA_TENSORS=staged`` stages them instead). Other CUDA tensors
go through a host copy made for the call, and the result is copied back into them when the
call ends (as gloo stages CUDA tensors); a CPU tensor's memory is used as it is.
Element types: float32, float64, float16, int32, int64, uint8 (and bfloat16 for CUDA
tensors reduced on their GPU); operations ``'sum'``,
``'prod'``, ``'min'``, ``'max'``, and ``'avg'`` for floats. Reductions are deterministic:
the same inputs give the same bits on every rank, run after run. A rank that dies, or ranks
that disagree about a call, raise on every rank (``PeerLostError``, ``CollectiveError``).
"""

import numpy as np

from . import _psnet
from ._arrays import (
    allgather_on_gpu,
    allreduce_on_gpu,
    as_array,
    broadcast_on_gpu,
    is_tensor,
    readable,
    reduce_on_gpu,
    reduce_scatter_on_gpu,
    staged,
    writable,
)

_comm = None


def init():
    """Joins the job's communicator (once; later calls return the same one)."""
    global _comm
    if _comm is None:
        _comm = _psnet.Comm.join()
    return _comm


def is_initialized():
    """Whether :func:`init` has joined the communicator."""
    return _comm is not None


def shutdown():
    """Forgets the communicator (its connections close once nothing uses it)."""
    global _comm
    _comm = None


def _get():
    if _comm is None:
        raise RuntimeError("psnet.init() has not been called")
    return _comm


def rank():
    """This process's rank."""
    return _get().rank


def size():
    """The number of ranks."""
    return _get().size


def allreduce(tensor, op="sum", out=None):
    """Reduces ``tensor`` across the ranks with ``op``. In place, unless ``out`` is given
    (then ``tensor`` is unchanged and ``out`` gets the result). Returns the result."""
    comm = _get()
    if out is None and allreduce_on_gpu(comm, tensor, op):
        return tensor
    with staged():
        if out is None:
            target = writable(tensor, "allreduce")
        else:
            target = writable(out, "allreduce out", read=False)
            np.copyto(target, as_array(tensor, "allreduce"), casting="no")
        comm.allreduce(target, op)
    return out if out is not None else tensor


def broadcast(tensor, root=0):
    """Every rank's ``tensor`` ends with ``root``'s, in place. Returns it."""
    comm = _get()
    if broadcast_on_gpu(comm, tensor, root):
        return tensor
    with staged():
        root_here = comm.rank == root
        comm.broadcast(writable(tensor, "broadcast", read=root_here, back=not root_here), root)
    return tensor


def allgather(tensor, out=None):
    """Every rank's ``tensor`` (each of the same shape) concatenated along the first axis in
    rank order, as a new array (a tensor on ``tensor``'s device for a torch tensor), or
    written into ``out``."""
    comm = _get()
    if out is None and _on_cuda(tensor):
        shape = (
            (comm.size * tensor.shape[0],) + tuple(tensor.shape[1:]) if len(tensor.shape) else (comm.size,)
        )
        out = tensor.new_empty(shape)
    if allgather_on_gpu(comm, tensor, out):
        return out
    with staged():
        send = readable(tensor, "allgather")
        shape = (comm.size * send.shape[0],) + send.shape[1:] if send.ndim else (comm.size,)
        if out is None:
            out = _new_like(tensor, shape, send.dtype)
        recv = writable(out, "allgather out", read=False)
        if recv.size != comm.size * send.size:
            raise ValueError(
                f"allgather out: {recv.size} elements where {comm.size} x {send.size} are needed"
            )
        comm.allgather(send, recv)
    return out


def reduce_scatter(tensor, op="sum", out=None):
    """Reduces ``tensor`` across the ranks and returns this rank's block of the result: the
    first axis split into ``size()`` equal blocks (its length must divide)."""
    comm = _get()
    n = comm.size
    if out is None and _on_cuda(tensor) and len(tensor.shape) and tensor.shape[0] % n == 0:
        out = tensor.new_empty((tensor.shape[0] // n,) + tuple(tensor.shape[1:]))
    if out is not None and reduce_scatter_on_gpu(comm, tensor, out, op):
        return out
    with staged():
        send = readable(tensor, "reduce_scatter")
        n = comm.size
        if send.ndim == 0 or send.shape[0] % n:
            raise ValueError(
                f"reduce_scatter: the first axis ({send.shape[0] if send.ndim else 'none'}) "
                f"does not split into {n} equal blocks"
            )
        shape = (send.shape[0] // n,) + send.shape[1:]
        if out is None:
            out = _new_like(tensor, shape, send.dtype)
        comm.reduce_scatter(send, writable(out, "reduce_scatter out", read=False), op)
    return out


def reduce(tensor, op="sum", root=0):
    """Reduces ``tensor`` across the ranks into ``root``'s ``tensor`` (in place there; the
    other ranks' are unchanged). Returns ``tensor``."""
    comm = _get()
    if reduce_on_gpu(comm, tensor, op, root):
        return tensor
    with staged():
        target = writable(tensor, "reduce", back=comm.rank == root)
        comm.reduce(target.copy(), target, op, root)
    return tensor


def _on_cuda(tensor):
    """Whether ``tensor`` is a torch tensor on a CUDA device."""
    return is_tensor(tensor) and getattr(tensor.device, "type", None) == "cuda"


def _new_like(tensor, shape, dtype):
    """A result of ``shape``: a tensor on ``tensor``'s device if it is a torch tensor, else a
    NumPy array."""
    if is_tensor(tensor):
        return tensor.new_empty(shape)
    return np.empty(shape, dtype=dtype)


def barrier():
    """Waits for every rank."""
    _get().barrier()

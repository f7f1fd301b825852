"""Arrays as psnet takes them: NumPy arrays, CPU torch tensors through the NumPy array that
shares their memory (no copy), and CUDA torch tensors through a host copy made for the call
(inside ``staged()``), copied back into the tensor when the call wrote it; or, for an
allreduce, broadcast, allgather or reduce-scatter of contiguous CUDA tensors, by device
pointer (``on_gpu``), on their GPU."""

import contextvars

import numpy as np

from . import _psnet

# Element types psnet reduces on the GPU, by torch's names.
_GPU_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8")

# The current call's stage (see ``staged``), or None outside psnet's calls.
_STAGE = contextvars.ContextVar("psnet_stage", default=None)


class staged:
    """A call that may take CUDA tensors: within it ``as_array`` copies them to host memory,
    and when it ends without an error the copies of those it wrote go back into the tensors
    (on the tensors' current stream, as ``Tensor.copy_`` orders it). An error writes nothing
    back. A class rather than a generator: it wraps every call, NumPy's included."""

    __slots__ = ("back", "token")

    def __enter__(self):
        self.back = []
        self.token = _STAGE.set(self.back)
        return self

    def __exit__(self, kind, value, traceback):
        _STAGE.reset(self.token)
        if kind is None:
            for tensor, host in self.back:
                tensor.detach().copy_(host)
        return False


def is_tensor(x):
    """Whether ``x`` is a torch tensor (or looks like one: a device and ``numpy``)."""
    return getattr(x, "device", None) is not None and hasattr(x, "numpy")


def on_gpu(x):
    """For a contiguous CUDA torch tensor that psnet may reduce where it lies
    (``PSNET_CUDA_TENSORS=device``, the default): its ``(pointer, elements, dtype, device)``,
    once the work queued on torch's current stream of its device has finished (psnet's own
    streams do not follow torch's). None for anything else, which is staged."""
    if not is_tensor(x) or getattr(x.device, "type", None) != "cuda":
        return None
    if not hasattr(x, "data_ptr") or _psnet.cuda_tensors() != "device":
        return None
    dtype = str(x.dtype).split(".")[-1]
    if dtype not in _GPU_DTYPES or not x.is_contiguous():
        return None
    import torch

    torch.cuda.current_stream(x.device).synchronize()
    return (x.data_ptr(), x.numel(), dtype, x.device.index)


def _on_gpu_call(call, comm, x, *args):
    """Runs ``call`` (``_psnet.allreduce_cuda`` and its kin) on ``x`` in place on its GPU if
    psnet takes it there (see ``on_gpu``); False if the caller must stage it (not a CUDA
    tensor psnet takes there, or, logged once, this process cannot: the other ranks take part
    with it either way). Runs with ``x``'s device current, as torch's is again afterwards."""
    gpu = on_gpu(x)
    if gpu is None:
        return False
    import torch

    with torch.cuda.device(x.device):
        return call(comm, *gpu, *args)


def allreduce_on_gpu(comm, x, op):
    """Reduces ``x`` in place on its GPU with ``op``; False if it must be staged."""
    return _on_gpu_call(_psnet.allreduce_cuda, comm, x, op)


def broadcast_on_gpu(comm, x, root):
    """Broadcasts ``root``'s ``x`` into this rank's, on its GPU; False if it must be staged."""
    return _on_gpu_call(_psnet.broadcast_cuda, comm, x, root)


def _gpu_pair(send, recv):
    """Whether ``send`` and ``recv`` are contiguous CUDA tensors of one device and one type
    that psnet may take where they lie (``PSNET_CUDA_TENSORS=device``)."""
    for x in (send, recv):
        if (not is_tensor(x) or getattr(x.device, "type", None) != "cuda"
                or not hasattr(x, "data_ptr") or not x.is_contiguous()):
            return False
    return (send.device == recv.device and send.dtype == recv.dtype
            and str(send.dtype).split(".")[-1] in _GPU_DTYPES
            and _psnet.cuda_tensors() == "device")


def allgather_on_gpu(comm, send, recv):
    """Gathers every rank's ``send`` into ``recv`` (size x its elements, in rank order) on
    their GPU: this rank's block is copied into ``recv``, then gathered in place. False if
    they must be staged (``recv`` then holds this rank's block, which staging rewrites)."""
    if not _gpu_pair(send, recv) or recv.numel() != comm.size * send.numel():
        return False
    import torch

    n = send.numel()
    with torch.no_grad():
        recv.view(-1)[comm.rank * n:(comm.rank + 1) * n].copy_(send.view(-1))
    return _on_gpu_call(_psnet.allgather_cuda, comm, recv)


def reduce_scatter_on_gpu(comm, send, recv, op):
    """Reduces ``send`` (size x ``recv``'s elements) across the ranks on their GPU and writes
    this rank's block of the result into ``recv``: a copy of ``send`` is reduced in place.
    False if they must be staged (nothing written)."""
    if not _gpu_pair(send, recv) or send.numel() != comm.size * recv.numel():
        return False
    import torch

    with torch.no_grad():
        work = send.detach().clone()
    if not _on_gpu_call(_psnet.reduce_scatter_cuda, comm, work, op):
        return False
    m = recv.numel()
    with torch.no_grad():
        recv.view(-1).copy_(work.view(-1)[comm.rank * m:(comm.rank + 1) * m])
    return True


def reduce_on_gpu(comm, x, op, root):
    """Reduces every rank's ``x`` into ``root``'s on their GPU, leaving the other ranks' ``x``
    unchanged (they reduce a copy); False if it must be staged (nothing changed)."""
    if on_gpu(x) is None:
        return False
    import torch

    work = x
    if comm.rank != root:
        with torch.no_grad():
            work = x.detach().clone()
    return _on_gpu_call(_psnet.reduce_cuda, comm, work, op, root)


def _check_dtype(x, what):
    if str(getattr(x, "dtype", "")) == "torch.bfloat16":
        raise TypeError(f"{what}: bfloat16 tensors are not supported yet")


def as_array(x, what, write=False, read=True):
    """The NumPy array for ``x``: an ndarray itself, a CPU torch tensor's memory, or (within
    ``staged()``) a host copy of a CUDA tensor, copied back at the end if ``write``. With
    ``read`` false the call only writes it: the host copy is not filled from the device."""
    if isinstance(x, np.ndarray):
        return x
    if is_tensor(x):
        _check_dtype(x, what)
        device = x.device
        kind = getattr(device, "type", "cpu")
        if kind == "cpu":
            return x.detach().numpy()
        back = _STAGE.get()
        if kind != "cuda":
            raise TypeError(
                f"{what}: a tensor on {device}; psnet's Python package takes CPU and CUDA "
                "tensors"
            )
        if back is None:
            raise TypeError(f"{what}: a CUDA tensor outside a psnet call (internal error)")
        if write and not x.is_contiguous():
            # As on the CPU, an output is written in place or refused, never through a
            # silent copy (an overlapping one could not even be written back).
            raise ValueError(
                f"{what}: the tensor is not contiguous, so it cannot be written in place "
                "(.contiguous() makes a copy that is; pass it and use the result)"
            )
        if read:
            # A contiguous host copy, which torch has finished when it returns.
            host = x.detach().cpu().contiguous()
        else:
            host = x.new_empty(x.shape, device="cpu")
        if write:
            back.append((x, host))
        return host.numpy()
    raise TypeError(
        f"{what}: expected a numpy.ndarray or a torch tensor, got {type(x).__name__}"
    )


def writable(x, what, read=True, back=True):
    """``x`` as an array psnet can write in place, or a clear error. For a CUDA tensor, a host
    copy (filled from the device if ``read``) that goes back into it when the call ends if
    ``back`` (false where this rank leaves it unchanged)."""
    a = as_array(x, what, write=back, read=read)
    if not a.flags.c_contiguous:
        raise ValueError(
            f"{what}: the array is not C-contiguous, so it cannot be written in place "
            "(numpy.ascontiguousarray makes a copy that is; pass it and use the result)"
        )
    if not a.flags.writeable:
        raise ValueError(f"{what}: the array is read-only")
    return a


def readable(x, what):
    """``x`` as a C-contiguous array (a contiguous copy if it is not)."""
    return np.ascontiguousarray(as_array(x, what))

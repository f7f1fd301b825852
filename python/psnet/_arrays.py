"""Arrays as psnet takes them: NumPy arrays, CPU torch tensors through the NumPy array that
shares their memory (no copy), and CUDA torch tensors through a host copy made for the call
(inside ``staged()``), copied back into the tensor when the call wrote it."""

import contextlib
import contextvars

import numpy as np

# The host copies of the current call's CUDA tensors that it writes: (tensor, host copy).
_STAGE = contextvars.ContextVar("psnet_stage", default=None)


@contextlib.contextmanager
def staged():
    """A call that may take CUDA tensors: within it ``as_array`` copies them to the host, and
    when it ends without an error the copies of those it wrote go back into the tensors (on
    the tensors' current stream, as ``Tensor.copy_`` orders it)."""
    back = []
    token = _STAGE.set(back)
    try:
        yield
    finally:
        _STAGE.reset(token)
    for tensor, host in back:
        tensor.detach().copy_(host)


def is_tensor(x):
    """Whether ``x`` is a torch tensor (or looks like one: a device and ``numpy``)."""
    return getattr(x, "device", None) is not None and hasattr(x, "numpy")


def as_array(x, what, write=False):
    """The NumPy array for ``x``: an ndarray itself, a CPU torch tensor's memory, or (within
    ``staged()``) a host copy of a CUDA tensor, copied back at the end if ``write``."""
    if isinstance(x, np.ndarray):
        return x
    if is_tensor(x):
        device = x.device
        kind = getattr(device, "type", "cpu")
        if kind == "cpu":
            return x.detach().numpy()
        back = _STAGE.get()
        if kind != "cuda" or back is None:
            raise TypeError(
                f"{what}: a tensor on {device}; psnet's Python package takes CPU and CUDA "
                "tensors"
            )
        # A contiguous host copy, which torch has finished when it returns.
        host = x.detach().cpu().contiguous()
        if write:
            back.append((x, host))
        return host.numpy()
    raise TypeError(
        f"{what}: expected a numpy.ndarray or a torch tensor, got {type(x).__name__}"
    )


def writable(x, what):
    """``x`` as an array psnet can write in place (for a CUDA tensor, a host copy written back
    when the call ends), or a clear error."""
    a = as_array(x, what, write=True)
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

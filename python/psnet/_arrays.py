"""Arrays as psnet takes them: NumPy arrays, and CPU torch tensors through the NumPy array
that shares their memory (no copy)."""

import numpy as np


def as_array(x, what):
    """The NumPy array for ``x`` (an ndarray, or a CPU torch tensor, sharing its memory)."""
    if isinstance(x, np.ndarray):
        return x
    device = getattr(x, "device", None)
    if device is not None and hasattr(x, "numpy"):
        if getattr(device, "type", "cpu") != "cpu":
            raise TypeError(
                f"{what}: a tensor on {device}; psnet's Python package takes CPU tensors "
                "(move it with .cpu())"
            )
        return x.detach().numpy()
    raise TypeError(f"{what}: expected a numpy.ndarray or a CPU torch tensor, got {type(x).__name__}")


def writable(x, what):
    """``x`` as an array psnet can write in place, or a clear error."""
    a = as_array(x, what)
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

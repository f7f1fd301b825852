"""All-to-all, gather, scatter and point-to-point messages among the job's ranks, on NumPy
arrays and torch tensors (CPU; CUDA tensors through a host copy).

``alltoall(send, out=None, send_splits=None, recv_splits=None)``: ``send``'s first axis split
into one block per rank (equal blocks, or ``send_splits`` rows for each rank); rank i's block
for this rank lands in block i of the result (``recv_splits`` rows from each rank). As
``MPI_Alltoall(v)`` and ``torch.distributed.all_to_all_single``: a rank whose
``recv_splits`` disagree with the sender's ``send_splits`` raises, naming the sender.

``gather(tensor, root=0)`` returns the ranks' tensors stacked along a new first axis at the
root (``None`` elsewhere); ``scatter(tensor, root=0, out=...)`` hands each rank its block of
the root's first axis.

``send(tensor, dst, tag=0)`` / ``recv(out, src, tag=0)`` move one message between two ranks,
outside the order of collective calls: the n-th send from a to b with a tag meets the n-th
receive on b from a with that tag. ``isend`` / ``irecv`` return a :class:`Request` at once
(its place among the messages is taken then); ``wait()`` blocks until it is done and raises
what the message met (a lost peer, a receive of another length, named by rank).
"""

import threading

import numpy as np

from . import _psnet
from .collectives import _get, _new_like
from ._arrays import readable, staged, writable


def _rows(x):
    return x.shape[0] if x.ndim else 1


def _row_elems(x):
    return int(np.prod(x.shape[1:])) if x.ndim > 1 else 1


def _splits(splits, rows, n, what):
    if splits is None:
        if rows % n:
            raise ValueError(f"alltoall {what}: {rows} rows do not split into {n} equal blocks; "
                             "pass the split sizes")
        return [rows // n] * n
    splits = [int(s) for s in splits]
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(f"alltoall {what} splits {splits}: {n} sizes of 0 or more rows adding "
                         f"up to the {rows} rows")
    return splits


def alltoall(tensor, out=None, send_splits=None, recv_splits=None):
    """Rank j gets block j of ``tensor``'s first axis; returns (or fills ``out`` with) the
    blocks every rank sent this one, in rank order."""
    comm = _get()
    n = comm.size
    with staged():
        send = readable(tensor, "alltoall")
        row = _row_elems(send)
        s_rows = _splits(send_splits, _rows(send), n, "send")
        if recv_splits is None and send_splits is None:
            r_rows = s_rows
        elif recv_splits is None:
            raise ValueError("alltoall: with send_splits, pass recv_splits too (how many rows "
                             "each rank sends this one)")
        else:
            r_rows = [int(s) for s in recv_splits]
        if out is None:
            shape = (sum(r_rows),) + tuple(send.shape[1:])
            out = _new_like(tensor, shape, send.dtype)
        recv = writable(out, "alltoall out", read=False)
        r_rows = _splits(recv_splits if recv_splits is not None else r_rows, _rows(recv), n,
                         "recv")
        _psnet.alltoall(comm, send.reshape(-1), recv.reshape(-1),
                        [s * row for s in s_rows], [r * row for r in r_rows])
    return out


def gather(tensor, root=0):
    """``root`` gets every rank's ``tensor`` stacked along a new first axis (a new array or
    tensor); the other ranks get ``None``."""
    comm = _get()
    with staged():
        send = readable(tensor, "gather")
        out = None
        recv = None
        if comm.rank == root:
            out = _new_like(tensor, (comm.size,) + tuple(send.shape), send.dtype)
            recv = writable(out, "gather out", read=False).reshape(-1)
        _psnet.gather(comm, send.reshape(-1), recv, root)
    return out


def scatter(tensor, out, root=0):
    """``out`` on rank r gets block r of ``root``'s ``tensor`` (its first axis split into one
    block per rank); the other ranks pass ``tensor=None``. Returns ``out``."""
    comm = _get()
    with staged():
        recv = writable(out, "scatter out", read=False)
        send = None
        if comm.rank == root:
            send = readable(tensor, "scatter").reshape(-1)
        _psnet.scatter(comm, send, recv.reshape(-1), root)
    return out


class Request:
    """A message in flight: ``wait()`` blocks until it is done (and raises what it met),
    ``is_completed()`` tells without blocking."""

    def __init__(self, run):
        self._error = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(run,), daemon=True,
                                        name="psnet-p2p")
        self._thread.start()

    def _run(self, run):
        try:
            run()
        except BaseException as e:  # handed to wait()
            self._error = e
        finally:
            self._done.set()

    def is_completed(self):
        """Whether the message is done (sent to the transport, or received)."""
        return self._done.is_set()

    def wait(self, timeout=None):
        """Blocks until done; raises its error. With ``timeout`` (seconds), returns False if
        it is still in flight then, True once done."""
        if not self._done.wait(timeout):
            return False
        if self._error is not None:
            raise self._error
        return True


def isend(tensor, dst, tag=0):
    """Starts sending ``tensor`` to rank ``dst``; returns its :class:`Request`. The tensor
    must not change until the request is done."""
    comm = _get()
    ticket = _psnet.p2p_ticket(comm, dst, tag, True)
    return Request(lambda: _with_array(tensor, "send", lambda a: _psnet.send_with(comm, ticket, a)))


def irecv(out, src, tag=0):
    """Starts receiving into ``out`` the next message from rank ``src`` with ``tag``; returns
    its :class:`Request`."""
    comm = _get()
    ticket = _psnet.p2p_ticket(comm, src, tag, False)
    return Request(lambda: _with_array(out, "recv", lambda a: _psnet.recv_with(comm, ticket, a),
                                       write=True))


def _with_array(x, what, call, write=False):
    with staged():
        a = writable(x, what, read=False) if write else readable(x, what)
        call(a.reshape(-1))


def recv_any(out, tag=0):
    """Receives into ``out`` the next message with ``tag`` from whichever rank's comes first
    (MPI's ``MPI_ANY_SOURCE``); returns the sender's rank. A sender's next message is taken
    once it starts arriving, so a receive from that rank made before keeps its message."""
    comm = _get()
    source = []
    _with_array(out, "recv", lambda a: source.append(_psnet.recv_any(comm, a, tag)), write=True)
    return source[0]


def send(tensor, dst, tag=0):
    """Sends ``tensor`` to rank ``dst``; returns once the transport has taken it."""
    isend(tensor, dst, tag).wait()


def recv(out, src, tag=0):
    """Receives into ``out`` the next message from rank ``src`` with ``tag``. Returns ``out``."""
    irecv(out, src, tag).wait()
    return out

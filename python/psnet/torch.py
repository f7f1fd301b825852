"""psnet as a ``torch.distributed`` backend, and a compressed DDP communication hook.

``import psnet.torch`` registers the backend ``'psnet'``:

    import torch.distributed as dist
    import psnet.torch  # noqa: F401
    dist.init_process_group("psnet")          # under torchrun, psnet-launch, mpirun, ...
    model = torch.nn.parallel.DistributedDataParallel(model)

The process group runs psnet's collectives (RDMA or TCP, whichever the environment binds) on
CPU and CUDA tensors: allreduce, broadcast, allgather, reduce_scatter, reduce, barrier,
all_to_all(_single) with split sizes, gather, scatter, the coalesced forms FSDP uses,
monitored_barrier, ``split_group`` (through psnet's ``split``, over the group's own
connections), and send / recv / isend / irecv / batch_isend_irecv between two ranks. An
allreduce of a contiguous CUDA tensor (DDP's buckets) runs on its GPU: pieces sent from device
memory, reduced into the tensor by psnet's kernels, bfloat16 included; a broadcast of one
(DDP's start) copies the pieces in on the GPU, and ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` of contiguous CUDA tensors on one GPU (FSDP's calls) run there too
(``PSNET_CUDA_TENSORS=staged`` stages them instead). Other CUDA tensors are staged through a
page-locked host copy, as gloo stages them, and written back when the call ends. Rank 0 draws
a free port on ``MASTER_ADDR`` (127.0.0.1 if unset) and hands it to the others through
torch's store, so psnet never competes with the store for ``MASTER_PORT``. A call on CPU
tensors returns at once: its ``Work`` completes when psnet's operation does (the group's
collective calls run one after another on a thread of their own, in the order they were
made, so DDP's bucket allreduces overlap backward); ``wait()`` raises what the call met. A
call with a CUDA tensor runs on the caller's thread once the calls before it are done.
Point-to-point messages are matched per peer and tag in the order the calls were made, and
run concurrently. float32, float64, float16,
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
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from . import _psnet
from ._torch_calls import _MONITORED_BARRIER_TAG, _any_cuda, _Calls, _done, _p2p_work, _wait_for
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


class ProcessGroupPsnet(dist.ProcessGroup):
    """A ``torch.distributed`` process group over a psnet communicator."""

    def __init__(self, comm, rank, size, store=None):
        super().__init__(rank, size)
        self._comm = comm
        self._store = store
        self._calls = _Calls()
        self._group_name = ""
        self._group_desc = ""
        self._splits = 0

    def getBackendName(self):  # noqa: N802 (torch's name)
        return BACKEND

    def name(self):
        return BACKEND

    # torch keeps a group's name and description in the C++ backends it registered; this
    # group is its own backend, written in Python, so it keeps them itself (DeviceMesh,
    # and with it FSDP2, reads them).
    def _set_group_name(self, name):
        self._group_name = name

    @property
    def group_name(self):
        return self._group_name

    def _set_group_desc(self, desc):
        self._group_desc = desc

    @property
    def group_desc(self):
        return self._group_desc

    def _get_backend(self, device):
        return self

    def get_group_store(self):
        """The store the group was made with (a split's: its parent's, under its own prefix)."""
        if self._store is None:
            raise RuntimeError("psnet: this process group was made without a store")
        return self._store

    # torch's split_group: through psnet's split, over this group's connections.
    supports_splitting = True

    def comm_split_count(self):
        """How many groups were split from this one (torch names them with it)."""
        return self._splits

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None,
                    device_types=None):
        """The group of ``ranks`` (this group's ranks, in their order in the new group), split
        from this one with psnet's ``split`` (``MPI_Comm_split``): every rank of this group
        calls it, in the order of its calls; a rank not in ``ranks`` gets ``None``."""
        del timeout, device_types  # psnet bounds its calls with PSNET_COLL_TIMEOUT
        if opts is not None:
            raise ValueError("psnet: split_group takes no pg_options (psnet's settings come "
                             "from its PSNET_* variables)")
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or any(r < 0 or r >= self.size() for r in ranks):
            raise ValueError(f"psnet: split_group ranks {ranks} are not distinct ranks of a "
                             f"group of {self.size()}")
        me = self.rank()
        # Groups do not overlap, so the smallest rank names a group alike on every member.
        colour, key = (min(ranks), ranks.index(me)) if me in ranks else (None, 0)
        child = []

        def run():
            child.append(self._comm.split(colour, key))
        self._calls.submit(run, None).wait()
        self._splits += 1
        if child[0] is None:
            return None
        name = group_name or f"{self._group_name}:split:{self._splits - 1}"
        store = None
        if self._store is not None:
            store = dist.PrefixStore(f"psnet/split/{name}/", self._store)
        pg = ProcessGroupPsnet(child[0], key, len(ranks), store)
        pg._set_group_name(name)
        if group_desc is not None:
            pg._set_group_desc(group_desc)
        return pg

    @property
    def _device_types(self):
        # The devices this group takes tensors on: torch asks before monitored_barrier. It
        # also asks when the group is made, to skip its flight recorder for a group written
        # in Python (the recorder files entries under a name kept in C++ backends, which
        # this group has none of); that one question is answered as torch expects.
        if sys._getframe(1).f_code.co_name == "_maybe_attach_flight_recorder":
            return []
        return [torch.device("cpu"), torch.device("cuda")]

    supports_coalescing = False

    def _submit(self, run, result, *tensors):
        return self._calls.submit(run, result, now=_any_cuda(*tensors))

    def allreduce(self, tensors, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

        def run():
            for t in tensors:
                if allreduce_on_gpu(self._comm, t, op):
                    continue
                with _Staged(t, "allreduce", write=True) as a:
                    self._comm.allreduce(a, op)
        return self._submit(run, tensors, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0

        def run():
            for t in tensors:
                if broadcast_on_gpu(self._comm, t, root):
                    continue
                with _Staged(t, "broadcast", write=True) as a:
                    self._comm.broadcast(a, root)
        return self._submit(run, tensors, tensors)

    def reduce(self, tensors, opts=None):
        op, root = _op(opts.reduceOp), opts.rootRank

        def run():
            for t in tensors:
                if reduce_on_gpu(self._comm, t, op, root):
                    continue
                with _Staged(t, "reduce", write=True) as a:
                    self._comm.reduce(a.copy(), a, op, root)
        return self._submit(run, tensors, tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        def run():
            for outs, inp in zip(output_tensors, input_tensors):
                if self._allgather_list_on_gpu(outs, inp):
                    continue
                with _Staged(inp, "allgather") as send:
                    recv = np.empty(len(outs) * send.size, dtype=send.dtype)
                    self._comm.allgather(send.reshape(-1), recv)
                for r, out in enumerate(outs):
                    piece = torch.from_numpy(recv[r * send.size:(r + 1) * send.size])
                    with torch.no_grad():
                        out.copy_(piece.view_as(out))
        return self._submit(run, output_tensors, output_tensors, input_tensors)

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        return self.allgather(output_lists, input_tensors, opts)

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

    def _allgather_into(self, output, input):
        if allgather_on_gpu(self._comm, input, output):
            return
        with _Staged(input, "allgather") as send, _Staged(output, "allgather", True) as recv:
            self._comm.allgather(send.reshape(-1), recv.reshape(-1))

    def _allgather_base(self, output, input, opts=None):
        return self._submit(lambda: self._allgather_into(output, input), [output], output, input)

    # torch 2.x's all_gather_into_tensor; newer torch names it all_gather_single.
    all_gather_single = _allgather_base

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        def run():
            for out, inp in zip(outputs, inputs):
                self._allgather_into(out, inp)
        return self._submit(run, outputs, outputs, inputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

        def run():
            for out, ins in zip(output_tensors, input_tensors):
                if self._reduce_scatter_list_on_gpu(out, ins, op):
                    continue
                parts = []
                for t in ins:
                    with _Staged(t, "reduce_scatter") as a:
                        parts.append(a.reshape(-1).copy())
                with _Staged(out, "reduce_scatter", write=True) as recv:
                    self._comm.reduce_scatter(np.concatenate(parts), recv.reshape(-1), op)
        return self._submit(run, output_tensors, output_tensors, input_tensors)

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

    def _reduce_scatter_into(self, output, input, op):
        if reduce_scatter_on_gpu(self._comm, input, output, op):
            return
        with _Staged(input, "reduce_scatter") as send, \
                _Staged(output, "reduce_scatter", True) as recv:
            self._comm.reduce_scatter(send.reshape(-1), recv.reshape(-1), op)

    def _reduce_scatter_base(self, output, input, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return self._submit(lambda: self._reduce_scatter_into(output, input, op), [output],
                            output, input)

    # torch 2.x's reduce_scatter_tensor; newer torch names it reduce_scatter_single.
    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

        def run():
            for out, inp in zip(outputs, inputs):
                self._reduce_scatter_into(out, inp, op)
        return self._submit(run, outputs, outputs, inputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        n = self._comm.size

        def rows(t, splits, what):
            if not splits:
                if t.shape[0] % n if t.dim() else True:
                    raise ValueError(f"psnet all_to_all_single: {what}'s first dimension does "
                                     f"not split into {n} equal blocks; pass split sizes")
                return [t.shape[0] // n] * n
            return list(splits)

        send_rows = rows(input, input_split_sizes, "input")
        recv_rows = rows(output, output_split_sizes, "output")
        row = input[0].numel() if input.dim() and input.shape[0] else (
            int(np.prod(input.shape[1:])) if input.dim() > 1 else 1)

        def run():
            with _Staged(input, "all_to_all") as send, \
                    _Staged(output, "all_to_all", write=True) as recv:
                _psnet.alltoall(self._comm, send.reshape(-1), recv.reshape(-1),
                                [r * row for r in send_rows], [r * row for r in recv_rows])
        return self._submit(run, [output], output, input)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        def run():
            sends = []
            for t in input_tensors:
                with _Staged(t, "all_to_all") as a:
                    sends.append(a.reshape(-1))
            send = np.concatenate(sends) if sends else np.empty(0)
            recv = np.empty(sum(t.numel() for t in output_tensors), dtype=send.dtype)
            _psnet.alltoall(self._comm, send, recv, [a.size for a in sends],
                            [t.numel() for t in output_tensors])
            at = 0
            for t in output_tensors:
                piece = torch.from_numpy(recv[at:at + t.numel()])
                with torch.no_grad():
                    t.copy_(piece.view_as(t))
                at += t.numel()
        return self._submit(run, output_tensors, output_tensors, input_tensors)

    def gather(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank
        inp = input_tensors[0]

        def run():
            with _Staged(inp, "gather") as send:
                send = send.reshape(-1)
                recv = None
                if self._comm.rank == root:
                    recv = np.empty(self._comm.size * send.size, dtype=send.dtype)
                _psnet.gather(self._comm, send, recv, root)
            if recv is not None:
                for r, out in enumerate(output_tensors[0]):
                    piece = torch.from_numpy(recv[r * send.size:(r + 1) * send.size])
                    with torch.no_grad():
                        out.copy_(piece.view_as(out))
        return self._submit(run, output_tensors, output_tensors, input_tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank
        out = output_tensors[0]

        def run():
            send = None
            if self._comm.rank == root:
                parts = []
                for t in input_tensors[0]:
                    with _Staged(t, "scatter") as a:
                        parts.append(a.reshape(-1))
                send = np.concatenate(parts)
            with _Staged(out, "scatter", write=True) as recv:
                _psnet.scatter(self._comm, send, recv.reshape(-1), root)
        return self._submit(run, output_tensors, output_tensors, input_tensors)

    def send(self, tensors, dst, tag=0):
        ticket = _psnet.p2p_ticket(self._comm, dst, tag, True)
        t = tensors[0]
        if _any_cuda(t):
            with torch.no_grad():
                t = t.detach().to("cpu")
        else:
            t = t.detach().contiguous()

        def run():
            _psnet.send_with(self._comm, ticket, _array(t, "send").reshape(-1))
        return _p2p_work(run, tensors)

    def recv(self, tensors, src, tag=0):
        ticket = _psnet.p2p_ticket(self._comm, src, tag, False)
        t = tensors[0]

        def run():
            if _any_cuda(t) or not t.is_contiguous():
                host = torch.empty(t.shape, dtype=t.dtype)
                _psnet.recv_with(self._comm, ticket, _array(host, "recv").reshape(-1))
                with torch.no_grad():
                    t.copy_(host)
            else:
                _psnet.recv_with(self._comm, ticket, _array(t, "recv").reshape(-1))
        return _p2p_work(run, tensors)

    def recv_anysource(self, tensors, tag=0):
        """``recv`` without a source rank: the next message with ``tag`` from whichever rank's
        comes first (psnet's ``recv_any``); the Work's ``_source_rank()`` names the sender."""
        t = tensors[0]
        source = []

        def run():
            if _any_cuda(t) or not t.is_contiguous():
                host = torch.empty(t.shape, dtype=t.dtype)
                source.append(_psnet.recv_any(self._comm, _array(host, "recv").reshape(-1), tag))
                with torch.no_grad():
                    t.copy_(host)
            else:
                source.append(_psnet.recv_any(self._comm, _array(t, "recv").reshape(-1), tag))
        work = _p2p_work(run, tensors)
        work._psnet_source = source
        return work

    def barrier(self, opts=None):
        # device_ids, where given, only say which GPU a NCCL barrier would use.
        return self._submit(self._comm.barrier, None)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """Rank 0 waits up to ``timeout`` for every other rank and raises naming those that
        did not arrive (the first, or all with ``wait_all_ranks``), as gloo does; the others
        wait for rank 0's release."""
        self._calls.drain()
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else (
            float(timeout) if timeout is not None else 1800.0)
        tag = _MONITORED_BARRIER_TAG
        n, me = self._comm.size, self._comm.rank
        token = np.zeros(1, dtype=np.uint8)
        if me != 0:
            self.send([torch.from_numpy(token)], 0, tag).wait()
            release = self.recv([torch.zeros(1, dtype=torch.uint8)], 0, tag)
            if not _wait_for(release, seconds):
                raise RuntimeError(f"[Rank {me}]: rank 0 did not release monitoredBarrier "
                                   f"within {seconds * 1000:.0f} ms")
            return _done(None)
        arrivals = {r: self.recv([torch.zeros(1, dtype=torch.uint8)], r, tag)
                    for r in range(1, n)}
        missing = []
        deadline = time.monotonic() + seconds
        for r, work in arrivals.items():
            if not _wait_for(work, max(0.0, deadline - time.monotonic())):
                missing.append(r)
                if not wait_all_ranks:
                    break
        if missing:
            names = ", ".join(str(r) for r in missing)
            raise RuntimeError(f"[Rank 0]: Ranks {names} failed to pass monitoredBarrier in "
                               f"{seconds * 1000:.0f} ms")
        for r in range(1, n):
            self.send([torch.from_numpy(token)], r, tag).wait()
        return _done(None)

    def shutdown(self):
        """Ends this group's call thread once the calls made so far are done."""
        self._calls.drain()
        self._calls.stop()

    def abort(self):
        """Ends this group's call thread without waiting for the calls queued."""
        self._calls.stop(wait=0)


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
    return ProcessGroupPsnet(_psnet.Comm.join_world(rank, size, root), rank, size, store)


dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


class CompressionState:
    """State of :func:`compressed_allreduce_hook`: the scheme and threshold, and each bucket's
    residuals (the quantization error carried to the next step): the worker's, and with the
    two-phase scheme the server's of this rank's chunk."""

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
    index = bucket.index()

    def run():
        if buf.dtype == torch.float32:
            pair = state.residuals.get(index)
            if pair is None or pair[0].size != buf.numel():
                server = pg._comm.compressed_server_residual_len(buf.numel())
                pair = (np.zeros(buf.numel(), dtype=np.float32), np.zeros(server, dtype=np.float32))
                state.residuals[index] = pair
            with _Staged(buf, "compressed allreduce", write=True) as a:
                pg._comm.allreduce_compressed(a.reshape(-1), pair[0], state.params, pair[1])
            buf.div_(n)
        else:
            with _Staged(buf, "allreduce", write=True) as a:
                pg._comm.allreduce(a, "avg")

    # In the order of the group's other calls, overlapping the rest of backward.
    return pg._calls.submit(run, buf, now=_any_cuda(buf)).get_future()


__all__ = ["BACKEND", "CompressionState", "ProcessGroupPsnet", "compressed_allreduce_hook"]


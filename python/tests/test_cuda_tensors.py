"""CUDA tensors in psnet.allreduce (and the other collectives) and psnet.kvstore: staged
through a host copy made for the call and copied back when the call wrote them. Without a GPU
a stand-in tensor that reports device 'cuda' and refuses to be read as host memory checks the
staging; with one, real CUDA tensors run too."""

import textwrap

import numpy as np
import pytest

from conftest import launch, run_ranks

torch = pytest.importorskip("torch", reason="torch is not installed: CUDA tensors are not tested")

# A stand-in for a CUDA tensor: psnet must copy it to the host (cpu) and back (copy_), never
# read its memory as the host's (numpy).
FAKE = """
import torch

class FakeCuda:
    class device:
        type = "cuda"

    def __init__(self, t):
        self.t = t
        self.copied_back = 0
        self.read = 0

    @property
    def dtype(self):
        return self.t.dtype

    @property
    def shape(self):
        return self.t.shape

    def is_contiguous(self):
        return self.t.is_contiguous()

    def numpy(self):
        raise AssertionError("a CUDA tensor's memory read as the host's")

    def detach(self):
        return self

    def cpu(self):
        self.read += 1
        return self.t.clone()

    def copy_(self, src):
        self.t.copy_(src)
        self.copied_back += 1
        return self

    def new_empty(self, shape, device=None):
        t = torch.empty(shape, dtype=self.t.dtype)
        return t if device == "cpu" else FakeCuda(t)
"""

COLLECTIVES = FAKE + """
import sys
import numpy as np
import psnet

out = sys.argv[1]
psnet.init()
r, n = psnet.rank(), psnet.size()
res = {}
x = FakeCuda(torch.arange(1000, dtype=torch.float32) * (r + 1))
assert psnet.allreduce(x) is x and x.copied_back == 1
res["sum"] = x.t.numpy()
src = FakeCuda(torch.full((7,), float(r + 1)))
dst = FakeCuda(torch.zeros(7))
psnet.allreduce(src, op="max", out=dst)
assert src.copied_back == 0 and dst.copied_back == 1, "only the written tensor goes back"
assert dst.read == 0, "an output only written is not read from the device"
res["src"], res["max"] = src.t.numpy(), dst.t.numpy()
same = FakeCuda(torch.full((3,), float(r)))
psnet.allreduce(same, out=same)
res["same"] = same.t.numpy()
b = FakeCuda(torch.arange(5, dtype=torch.float64) * (r + 1))
psnet.broadcast(b, root=n - 1)
assert b.copied_back == (0 if r == n - 1 else 1), "the root's tensor is left alone"
res["bcast"] = b.t.numpy()
g = psnet.allgather(FakeCuda(torch.full((2,), r, dtype=torch.int32)))
assert isinstance(g, FakeCuda), "a tensor's result is a tensor on its device"
res["gather"] = g.t.numpy()
g2 = FakeCuda(torch.zeros(2 * n, dtype=torch.int32))
psnet.allgather(FakeCuda(torch.full((2,), r, dtype=torch.int32)), out=g2)
assert g2.copied_back == 1 and g2.read == 0
res["gather_out"] = g2.t.numpy()
s = psnet.reduce_scatter(FakeCuda(torch.arange(2 * n, dtype=torch.int64) + r))
res["scatter"] = s.t.numpy()
s2 = FakeCuda(torch.zeros(2, dtype=torch.int64))
psnet.reduce_scatter(FakeCuda(torch.arange(2 * n, dtype=torch.int64) + r), out=s2)
res["scatter_out"] = s2.t.numpy()
red = FakeCuda(torch.full((3,), float(r + 1)))
psnet.reduce(red, root=0)
assert red.copied_back == (1 if r == 0 else 0), "only the root's tensor changes"
res["reduce"] = red.t.numpy()
# A CPU tensor is used in place, as before; its allgather is a CPU tensor.
c = torch.full((4,), float(r + 1))
psnet.allreduce(c)
res["cpu"] = c.numpy()
cg = psnet.allgather(torch.full((1,), float(r)))
assert isinstance(cg, torch.Tensor) and cg.device.type == "cpu"
res["cpu_gather"] = cg.numpy()
# An error after an output was staged writes nothing back (and leaves the communicator
# usable: it is refused before anything is sent).
small = FakeCuda(torch.full((1,), -1, dtype=torch.int32))
try:
    psnet.allgather(FakeCuda(torch.full((2,), r, dtype=torch.int32)), out=small)
    raise AssertionError("an output of the wrong size was taken")
except ValueError:
    pass
assert small.copied_back == 0 and small.t.tolist() == [-1]
# An output that is not contiguous is refused, as on the CPU.
strided = FakeCuda(torch.zeros(4, 2).t())
try:
    psnet.allreduce(strided)
    raise AssertionError("a strided output was taken")
except ValueError as e:
    assert "contiguous" in str(e)
try:
    psnet.allreduce(FakeCuda(torch.zeros(3, dtype=torch.bfloat16)))
    raise AssertionError("a bfloat16 tensor was taken")
except TypeError as e:
    assert "bfloat16" in str(e)
psnet.barrier()
np.savez(f"{out}/rank{r}.npz", **res)
"""


def test_collectives_stage_cuda_tensors_and_write_back_what_they_wrote(tmp_path):
    n = 3
    out, _ = run_ranks(tmp_path, n, COLLECTIVES)
    tri = sum(range(1, n + 1))
    for r in range(n):
        got = np.load(out / f"rank{r}.npz")
        np.testing.assert_array_equal(got["sum"], np.arange(1000, dtype=np.float32) * tri)
        np.testing.assert_array_equal(got["src"], np.full(7, r + 1.0, dtype=np.float32))
        np.testing.assert_array_equal(got["max"], np.full(7, float(n), dtype=np.float32))
        np.testing.assert_array_equal(got["same"], np.full(3, float(sum(range(n))), dtype=np.float32))
        np.testing.assert_array_equal(got["cpu_gather"], np.arange(n, dtype=np.float32))
        np.testing.assert_array_equal(got["bcast"], np.arange(5, dtype=np.float64) * n)
        np.testing.assert_array_equal(got["gather"], np.repeat(np.arange(n, dtype=np.int32), 2))
        np.testing.assert_array_equal(got["gather_out"], got["gather"])
        block = (np.arange(2 * n) * n + sum(range(n)))[2 * r:2 * r + 2]
        np.testing.assert_array_equal(got["scatter"], block)
        np.testing.assert_array_equal(got["scatter_out"], block)
        want = np.full(3, float(tri) if r == 0 else r + 1.0, dtype=np.float32)
        np.testing.assert_array_equal(got["reduce"], want)
        np.testing.assert_array_equal(got["cpu"], np.full(4, float(tri), dtype=np.float32))


def test_kvstore_stages_cuda_tensors(tmp_path):
    body = FAKE + textwrap.dedent("""
        import sys, numpy as np, psnet
        out = sys.argv[1]
        kv = psnet.kvstore.create('dist_sync_device')
        r = kv.rank
        kv.init(['w', 'h'], [FakeCuda(torch.zeros(6)), FakeCuda(torch.zeros(4, dtype=torch.float16))])
        g = FakeCuda(torch.full((6,), float(r + 1)))
        kv.push('w', g)
        assert g.copied_back == 0, "a pushed value is only read"
        w = [FakeCuda(torch.empty(6)), FakeCuda(torch.empty(6))]
        kv.pull('w', out=w)
        assert [a.copied_back for a in w] == [1, 1] and [a.read for a in w] == [0, 0]
        h = FakeCuda(torch.full((4,), 2.0 * (r + 1), dtype=torch.float16))
        kv.pushpull('h', h)  # out=None: in place, as in MXNet
        assert h.copied_back == 1
        o = FakeCuda(torch.zeros(6))
        kv.pushpull('w', FakeCuda(torch.full((6,), 10.0 * (r + 1))), out=o)
        assert o.copied_back == 1 and o.read == 0
        np.savez(f"{out}/worker{r}.npz", w0=w[0].t.numpy(), w1=w[1].t.numpy(), h=h.t.numpy(),
                 o=o.t.numpy())
    """)
    _, _, out = launch(tmp_path, 2, 1, body)
    for r in range(2):
        got = np.load(out / f"worker{r}.npz")
        np.testing.assert_array_equal(got["w0"], np.full(6, 3.0, dtype=np.float32))
        np.testing.assert_array_equal(got["w1"], np.full(6, 3.0, dtype=np.float32))
        assert got["h"].dtype == np.float16
        np.testing.assert_array_equal(got["h"], np.full(4, 6.0, dtype=np.float16))
        np.testing.assert_array_equal(got["o"], np.full(6, 30.0, dtype=np.float32))


def test_a_local_store_pulls_into_a_cuda_tensor_and_other_devices_are_refused():
    import psnet

    namespace = {}
    exec(FAKE, namespace)
    fake = namespace["FakeCuda"]
    kv = psnet.kvstore.create("local")
    kv.init(3, fake(torch.full((2, 2), 5.0)))
    kv.push(3, [fake(torch.ones(2, 2)), fake(torch.ones(2, 2))])
    dst = fake(torch.zeros(2, 2))
    kv.pull(3, out=dst)
    assert dst.copied_back == 1
    assert dst.t.tolist() == [[2.0, 2.0], [2.0, 2.0]]
    with pytest.raises(TypeError, match="meta"):
        kv.pull(3, out=torch.zeros(2, 2, device="meta"))
    # Outside a call's staging a CUDA tensor is not taken as host memory.
    from psnet._arrays import as_array

    with pytest.raises(TypeError, match="outside a psnet call"):
        as_array(fake(torch.zeros(2)), "x")


def test_how_cuda_tensors_are_taken_comes_from_psnet_cuda_tensors(monkeypatch):
    from psnet import _psnet
    from psnet._arrays import on_gpu

    monkeypatch.delenv("PSNET_CUDA_TENSORS", raising=False)
    assert _psnet.cuda_tensors() == "device"
    monkeypatch.setenv("PSNET_CUDA_TENSORS", "staged")
    assert _psnet.cuda_tensors() == "staged"
    monkeypatch.setenv("PSNET_CUDA_TENSORS", "gpu")
    with pytest.raises(ValueError, match="PSNET_CUDA_TENSORS=\"gpu\": expected device or staged"):
        _psnet.cuda_tensors()
    monkeypatch.setenv("PSNET_CUDA_TENSORS", "device")
    # Host memory, and CUDA stand-ins without a device pointer, are staged (not taken by
    # pointer); the variable is not even read for them.
    assert on_gpu(torch.zeros(3)) is None
    assert on_gpu(np.zeros(3)) is None
    namespace = {}
    exec(FAKE, namespace)
    assert on_gpu(namespace["FakeCuda"](torch.zeros(3))) is None
    # Gathers and reduce-scatters too: host tensors and stand-ins are staged (the
    # communicator is not even looked at).
    from psnet._arrays import allgather_on_gpu, reduce_scatter_on_gpu
    fake = namespace["FakeCuda"]
    assert not allgather_on_gpu(None, torch.zeros(2), torch.zeros(4))
    assert not allgather_on_gpu(None, fake(torch.zeros(2)), fake(torch.zeros(4)))
    assert not reduce_scatter_on_gpu(None, torch.zeros(4), torch.zeros(2), "sum")
    assert not reduce_scatter_on_gpu(None, fake(torch.zeros(4)), fake(torch.zeros(2)), "sum")
    from psnet._arrays import reduce_on_gpu
    assert not reduce_on_gpu(None, torch.zeros(4), "sum", 0)
    assert not reduce_on_gpu(None, fake(torch.zeros(4)), "sum", 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: real CUDA tensors are not tested")
@pytest.mark.parametrize("mode", ["device", "staged"])
def test_real_cuda_tensors(tmp_path, mode):
    job = """
import sys
import numpy as np
import torch
import psnet
from psnet._arrays import on_gpu

out = sys.argv[1]
psnet.init()
r, n = psnet.rank(), psnet.size()
x = torch.arange(1000, dtype=torch.float32, device="cuda") * (r + 1)
assert (on_gpu(x) is not None) == (sys.argv[2] == "device")
psnet.allreduce(x)
assert x.device.type == "cuda"
g = psnet.allgather(torch.full((2,), float(r), device="cuda"))
assert g.device.type == "cuda"
res = dict(sum=x.cpu().numpy(), gather=g.cpu().numpy())
if sys.argv[2] == "device":
    # Taken on the GPU, not staged because this process could not (which only logs).
    from psnet._arrays import allreduce_on_gpu
    from psnet.collectives import _get
    y = torch.ones(10, device="cuda")
    assert allreduce_on_gpu(_get(), y, "sum"), "staged: see the warning above"
    assert y.cpu().tolist() == [float(n)] * 10
    # Values whose sums round, in every type the GPU reduces: the bits of the same
    # allreduce of CPU tensors. 3 million elements: several pieces per ring block.
    inputs = [torch.rand(3_000_001, generator=torch.Generator().manual_seed(k)) * 2 - 1
              for k in range(n)]
    base = inputs[r]
    for dtype, op in [(torch.float32, "sum"), (torch.float16, "sum"), (torch.float64, "max"),
                      (torch.int32, "sum"), (torch.uint8, "min")]:
        ints = dtype in (torch.int32, torch.uint8)
        cpu = (base * 1e6).long().to(dtype) if ints else base.to(dtype)
        gpu = cpu.cuda()
        psnet.allreduce(gpu, op)
        psnet.allreduce(cpu, op)
        assert torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8)), (dtype, op)
    # A broadcast on the GPU: rank 1's bits everywhere, bfloat16 too.
    for dtype in (torch.float32, torch.bfloat16):
        b = (inputs[r] * 3).to(dtype).cuda()
        psnet.broadcast(b, root=1)
        assert torch.equal(b.cpu().view(torch.int16), (inputs[1] * 3).to(dtype).view(torch.int16)), dtype
    # NumPy has no bfloat16, so no CPU allreduce either: on 2 ranks each element is one sum,
    # widened to float32 and rounded back, then halved the same way (the host path's steps).
    gpu = base.bfloat16().cuda()
    psnet.allreduce(gpu, "avg")
    want = (inputs[0].bfloat16().float() + inputs[1].bfloat16().float()).bfloat16()
    want = (want.float() / 2.0).bfloat16()
    assert torch.equal(gpu.cpu().view(torch.int16), want.view(torch.int16)), "bfloat16 avg"
    # Reduce-scatter and allgather on the GPU: the bits of the same calls on CPU tensors.
    from psnet._arrays import allgather_on_gpu, reduce_scatter_on_gpu
    for dtype, op in [(torch.float32, "sum"), (torch.float32, "avg"), (torch.float16, "max")]:
        cpu = base[:3_000_000].to(dtype)
        gpu = cpu.cuda()
        rs_gpu, rs_cpu = psnet.reduce_scatter(gpu, op), psnet.reduce_scatter(cpu, op)
        assert rs_gpu.device.type == "cuda" and rs_gpu.shape == (1_500_000,)
        assert torch.equal(rs_gpu.cpu().view(torch.uint8), rs_cpu.view(torch.uint8)), (dtype, op)
        ag_gpu, ag_cpu = psnet.allgather(gpu[:1000]), psnet.allgather(cpu[:1000])
        assert ag_gpu.device.type == "cuda"
        assert torch.equal(ag_gpu.cpu().view(torch.uint8), ag_cpu.view(torch.uint8)), dtype
    # Taken on the GPU, not staged.
    ones = torch.ones(2000, device="cuda")
    assert allgather_on_gpu(_get(), ones[:1000], torch.empty(2000, device="cuda")), "staged"
    half = torch.empty(1000, device="cuda")
    assert reduce_scatter_on_gpu(_get(), ones, half, "sum"), "staged"
    assert half.cpu().tolist() == [float(n)] * 1000
    # A reduce on the GPU: the root's bits are the CPU reduce's, the other rank's tensor
    # is unchanged; taken on the GPU, not staged.
    from psnet._arrays import reduce_on_gpu
    for dtype, op, root in [(torch.float32, "sum", 1), (torch.float16, "avg", 0)]:
        cpu = base.to(dtype)
        gpu = cpu.cuda()
        psnet.reduce(gpu, op, root=root)
        psnet.reduce(cpu, op, root=root)
        assert torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8)), (dtype, op)
        if r != root:
            assert torch.equal(gpu.cpu().view(torch.uint8), base.to(dtype).view(torch.uint8))
    tens = torch.full((1000,), 10.0, device="cuda")
    assert reduce_on_gpu(_get(), tens, "sum", 0), "staged"
    assert tens.cpu().tolist() == [10.0 * n if r == 0 else 10.0] * 1000
np.savez(f"{out}/rank{r}.npz", **res)
"""
    out, _ = run_ranks(tmp_path, 2, job.replace("sys.argv[2]", repr(mode)),
                       env={"PSNET_CUDA_TENSORS": mode})
    for r in range(2):
        got = np.load(out / f"rank{r}.npz")
        np.testing.assert_array_equal(got["sum"], np.arange(1000, dtype=np.float32) * 3)
        np.testing.assert_array_equal(got["gather"], np.array([0, 0, 1, 1], dtype=np.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: real CUDA tensors are not tested")
@pytest.mark.parametrize("compression", [None, "2bit"])
def test_kvstore_takes_real_cuda_tensors_where_they_lie(tmp_path, compression):
    """Two workers push the same gradients to a key from CPU tensors and to another from CUDA
    tensors (taken by pointer: with 2-bit compression quantized on the GPU); every round both
    keys pull the same bits."""
    body = textwrap.dedent("""
        import sys, numpy as np, torch, psnet
        from psnet import _psnet
        out = sys.argv[1]
        kv = psnet.kvstore.create('dist_sync')
        if COMPRESSION:
            kv.set_gradient_compression({'type': COMPRESSION, 'threshold': 0.5})
        r = kv.rank
        n = 1_000_003
        kv.init(['c', 'g', 'pc', 'pg'], [np.zeros(n, np.float32)] * 4)
        wc, wg = torch.empty(n), torch.empty(n, device="cuda")
        for step in range(3):
            grad = torch.rand(n, generator=torch.Generator().manual_seed(10 * step + r)) - 0.5
            kv.push('c', grad)
            # The GPU path itself, not a staged fallback (which would only log).
            assert kv._gpu_call(_psnet.kv_push_cuda, 'g', grad.cuda()), "staged"
            kv.pull('c', out=wc)
            kv.pull('g', out=wg)
            assert torch.equal(wc.view(torch.int32), wg.cpu().view(torch.int32)), step
            pc, pg = grad.clone(), grad.cuda()
            kv.pushpull('pc', pc)
            kv.pushpull('pg', pg)  # in place
            assert torch.equal(pc.view(torch.int32), pg.cpu().view(torch.int32)), step
        np.save(f"{out}/worker{r}.npy", wg.cpu().numpy())
    """).replace("COMPRESSION", repr(compression))
    _, _, out = launch(tmp_path, 2, 1, body)
    w0, w1 = np.load(out / "worker0.npy"), np.load(out / "worker1.npy")
    assert w0.tobytes() == w1.tobytes()


def test_a_keys_list_of_cuda_tensors_is_taken_on_the_gpu_only_when_all_can_be(monkeypatch):
    """A key's list of CUDA tensors goes to the GPU path (summed on the first one's device)
    only when every one is a contiguous CUDA tensor of the key's size and one dtype, in a
    dist store, with PSNET_CUDA_TENSORS=device; anything else is staged."""
    from psnet.kvstore import KVStore

    class Cuda:
        """A CUDA tensor as far as the choice looks: device, pointer, size, type, layout."""

        class device:
            type = "cuda"

        def __init__(self, n, dtype=torch.float32, contiguous=True):
            self.n, self.dtype, self.contiguous = n, dtype, contiguous

        def numpy(self):
            raise AssertionError("read as host memory")

        def data_ptr(self):
            return 0x1000

        def numel(self):
            return self.n

        def is_contiguous(self):
            return self.contiguous

    monkeypatch.setenv("PSNET_CUDA_TENSORS", "device")
    kv = KVStore.__new__(KVStore)
    kv._worker, kv._sizes = object(), {"w": 4}
    ok = [Cuda(4), Cuda(4)]
    assert kv._device_list("w", ok) is ok
    assert kv._device_list("w", [Cuda(4)]) is not None
    assert kv._device_list("w", [Cuda(4), Cuda(5)]) is None, "another size"
    assert kv._device_list("w", [Cuda(4), Cuda(4, torch.float16)]) is None, "two types"
    assert kv._device_list("w", [Cuda(4), Cuda(4, contiguous=False)]) is None
    assert kv._device_list("w", [Cuda(4), torch.zeros(4)]) is None, "a CPU tensor"
    assert kv._device_list("w", []) is None
    assert kv._device_list("w", Cuda(4)) is None, "not a list"
    assert kv._device_list(["w"], ok) is None, "not one key"
    assert kv._device_list("v", ok) is None, "not initialized"
    monkeypatch.setenv("PSNET_CUDA_TENSORS", "staged")
    assert kv._device_list("w", ok) is None
    monkeypatch.setenv("PSNET_CUDA_TENSORS", "device")
    kv._worker = None
    assert kv._device_list("w", ok) is None, "a local store"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: real CUDA tensors are not tested")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_keys_list_of_cuda_tensors_gives_the_bits_of_a_list_of_cpu_tensors(tmp_path, dtype):
    """Two workers push three gradients per key, as lists of CPU tensors to one key and of
    CUDA tensors to another (summed on the GPU in list order); pulls and pushpulls into lists
    give the same bits for both."""
    body = textwrap.dedent("""
        import sys, numpy as np, torch, psnet
        out = sys.argv[1]
        dt = getattr(torch, DTYPE)
        kv = psnet.kvstore.create('dist_sync')
        r = kv.rank
        n = 100_003
        kv.init(['c', 'g', 'pc', 'pg'], [np.zeros(n, np.dtype(DTYPE))] * 4)
        for step in range(3):
            gen = torch.Generator().manual_seed(10 * step + r)
            grads = [(torch.rand(n, generator=gen) - 0.5).to(dt) for _ in range(3)]
            kv.push('c', grads)
            on_gpu = [g.cuda() for g in grads]
            assert kv._device_list('g', on_gpu) is not None, "staged"
            kv.push('g', on_gpu)
            wc = [torch.empty(n, dtype=dt) for _ in range(2)]
            wg = [torch.empty(n, dtype=dt, device="cuda") for _ in range(2)]
            kv.pull('c', out=wc)
            kv.pull('g', out=wg)
            for c, g in zip(wc, wg):
                assert c.numpy().tobytes() == g.cpu().numpy().tobytes(), step
            pc = [g.clone() for g in grads]
            pg = [g.cuda() for g in grads]
            kv.pushpull('pc', pc)
            kv.pushpull('pg', pg)  # in place, into every tensor of the list
            for c, g in zip(pc, pg):
                assert c.numpy().tobytes() == g.cpu().numpy().tobytes(), step
        np.save(f"{out}/worker{r}.npy", wg[0].cpu().numpy())
    """).replace("DTYPE", repr(dtype))
    _, _, out = launch(tmp_path, 2, 1, body)
    w0, w1 = np.load(out / "worker0.npy"), np.load(out / "worker1.npy")
    assert w0.tobytes() == w1.tobytes()

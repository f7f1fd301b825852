"""psnet's torch backend beyond DDP: all-to-all, gather, scatter, point-to-point, coalesced
calls, monitored_barrier and asynchronous works through torch.distributed's API; and whole
FSDP2, pipeline and mixture-of-experts scripts that end bit-identical to gloo (or to a
single-process reference)."""

import numpy as np
import pytest

from conftest import Ranks, free_port, run_ranks
from test_torch import _torchrun_shim, torchrun_env

torch = pytest.importorskip("torch", reason="torch is not installed: the torch backend is not tested")

CALLS = _torchrun_shim + """
import time, torch, torch.distributed as dist
import psnet.torch
dist.init_process_group("psnet")
r, n = dist.get_rank(), dist.get_world_size()
for dtype in (torch.float32, torch.float64, torch.float16, torch.int32, torch.int64, torch.uint8):
    # all_to_all_single, equal blocks of 2 rows x 3.
    inp = (torch.arange(n * 6).reshape(2 * n, 3) + 10 * r).to(dtype)
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp)
    want = torch.cat([(torch.arange(n * 6).reshape(2 * n, 3) + 10 * i).to(dtype)[2 * r:2 * r + 2]
                      for i in range(n)])
    assert torch.equal(out, want), (dtype, out, want)
    # Uneven splits, zero-length ones included: rank i sends rank j (i + 2 * j) % 3 rows.
    send_rows = [(r + 2 * j) % 3 for j in range(n)]
    recv_rows = [(i + 2 * r) % 3 for i in range(n)]
    inp = torch.cat([torch.full((send_rows[j], 2), 10 * r + j) for j in range(n)]).to(dtype)
    out = torch.empty((sum(recv_rows), 2), dtype=dtype)
    dist.all_to_all_single(out, inp, output_split_sizes=recv_rows, input_split_sizes=send_rows)
    want = torch.cat([torch.full((recv_rows[i], 2), 10 * i + r) for i in range(n)]).to(dtype)
    assert torch.equal(out, want), (dtype, out, want)
    # all_to_all of lists.
    ins = [torch.full((j + 1,), 100 * r + j).to(dtype) for j in range(n)]
    outs = [torch.empty(r + 1, dtype=dtype) for _ in range(n)]
    dist.all_to_all(outs, ins)
    assert [o.tolist() for o in outs] == [[100 * i + r] * (r + 1) for i in range(n)], outs
    # gather and scatter, to and from the last rank.
    root = n - 1
    g = [torch.empty(3, dtype=dtype) for _ in range(n)] if r == root else None
    dist.gather(torch.full((3,), r + 1).to(dtype), g, dst=root)
    if r == root:
        assert [x.tolist() for x in g] == [[i + 1] * 3 for i in range(n)], g
    s = torch.empty(2, dtype=dtype)
    dist.scatter(s, [torch.full((2,), i + 5).to(dtype) for i in range(n)] if r == root else None,
                 src=root)
    assert s.tolist() == [r + 5] * 2, s
# Point to point: a ring, blocking and not, and batch_isend_irecv both ways.
right, left = (r + 1) % n, (r - 1) % n
got = torch.empty(4)
if r % 2 == 0:
    dist.send(torch.full((4,), float(r)), right)
    dist.recv(got, left)
else:
    dist.recv(got, left)
    dist.send(torch.full((4,), float(r)), right)
assert got.tolist() == [float(left)] * 4, got
a, b = torch.empty(5), torch.empty(5)
ops = [dist.P2POp(dist.isend, torch.full((5,), float(r)), right),
       dist.P2POp(dist.irecv, a, left),
       dist.P2POp(dist.isend, torch.full((5,), float(-r)), left),
       dist.P2POp(dist.irecv, b, right)]
for w in dist.batch_isend_irecv(ops):
    w.wait()
assert a.tolist() == [float(left)] * 5 and b.tolist() == [float(-right)] * 5, (a, b)
# Coalesced calls (FSDP's), through torch's coalescing manager.
from torch.distributed.distributed_c10d import _coalescing_manager
outs = [torch.empty(2 * n), torch.empty(3 * n)]
with _coalescing_manager(async_ops=True) as cm:
    dist.all_gather_into_tensor(outs[0], torch.full((2,), float(r)))
    dist.all_gather_into_tensor(outs[1], torch.full((3,), float(r + 1)))
cm.wait()
assert outs[0].tolist() == sum([[float(i)] * 2 for i in range(n)], []), outs
red = [torch.empty(1), torch.empty(2)]
with _coalescing_manager(async_ops=True) as cm:
    dist.reduce_scatter_tensor(red[0], torch.ones(n))
    dist.reduce_scatter_tensor(red[1], torch.full((2 * n,), 2.0))
cm.wait()
assert red[0].tolist() == [float(n)] and red[1].tolist() == [2.0 * n] * 2, red
# Asynchronous works: started together, they complete in the order made, and pair up.
big = [torch.full((1 << 18,), float(r + k)) for k in range(4)]
works = [dist.all_reduce(t, async_op=True) for t in big]
for k, w in reversed(list(enumerate(works))):
    w.wait()
    assert w.is_completed()
    assert big[k][0].item() == sum(i + k for i in range(n)), (k, big[k][0])
# An error in an asynchronous call reaches wait() and the future, never a silent success.
w = dist.all_reduce(torch.zeros(2, dtype=torch.bfloat16), async_op=True)
for check in (w.wait, w.get_future().wait):
    try:
        check()
        raise AssertionError("the refused call's error was lost")
    except TypeError:
        pass
assert w.is_completed()
# wait(timeout): a receive nobody sends times out there, naming the timeout.
import datetime
pending = dist.irecv(torch.empty(1), (r + 1) % n, tag=77)
try:
    pending.wait(timeout=datetime.timedelta(milliseconds=200))
    raise AssertionError("wait(timeout) returned for a message never sent")
except RuntimeError as e:
    assert "did not complete within" in str(e), e
# No rank sends until every rank has timed out: a rank that got here 200 ms sooner
# would otherwise send before its neighbour's wait ran out.
dist.barrier()
dist.send(torch.ones(1), (r - 1) % n, tag=77)
pending.wait()
dist.monitored_barrier()
dist.barrier(device_ids=[0])
print("ok", r, flush=True)
dist.destroy_process_group()
"""


def test_every_new_call_against_its_expected_result(tmp_path):
    outs = run_ranks(tmp_path, 3, CALLS, env=torchrun_env(free_port()))


def test_monitored_barrier_names_the_rank_that_did_not_arrive(tmp_path):
    ranks = Ranks(tmp_path, 3, _torchrun_shim + """
import datetime, os, sys, time, torch, torch.distributed as dist
import psnet.torch
dist.init_process_group("psnet")
r = dist.get_rank()
if r == 2:
    time.sleep(30)
    os._exit(0)
try:
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=2))
except RuntimeError as e:
    print("raised:", e, flush=True)
    os._exit(3)
""", env=torchrun_env(free_port()))
    try:
        out, _ = ranks.procs[0].communicate(timeout=60)
    finally:
        ranks.kill()
    assert ranks.procs[0].returncode == 3, out
    assert "Ranks 2 failed to pass monitoredBarrier" in out, out


# Whole scripts, run on 'psnet' and on 'gloo' (argv[2]), saving losses and weights.
FSDP2 = """
import os, sys
import numpy as np
import torch, torch.distributed as dist
import psnet.torch
from torch.distributed.fsdp import fully_shard
out, backend = sys.argv[1], sys.argv[2]
dist.init_process_group(backend)
r = dist.get_rank()
torch.manual_seed(0)


class Block(torch.nn.Module):
    # A small transformer block: attention and an MLP, each with a residual.
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


model = torch.nn.Sequential(torch.nn.Embedding(50, 32), Block(), Block(), torch.nn.Linear(32, 50))
for m in model:
    if isinstance(m, Block):
        fully_shard(m)
fully_shard(model)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1 + r)
x = torch.randint(0, 50, (8, 12), generator=g)
losses = []
for step in range(6):
    opt.zero_grad()
    logits = model(x[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), x[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    losses.append(loss.item())
full = {k: v.full_tensor().detach().numpy() for k, v in model.state_dict().items()}
np.savez(f"{out}/{backend}{r}.npz", losses=np.array(losses), **full)
sys.stdout.flush()
os._exit(0)
"""

PIPELINE = """
import os, sys
import numpy as np
import torch, torch.distributed as dist
import psnet.torch
out, backend = sys.argv[1], sys.argv[2]
dist.init_process_group(backend)
r = dist.get_rank()
torch.manual_seed(0)
stages = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh()),
          torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))]
stage = stages[r]
opt = torch.optim.SGD(stage.parameters(), lr=0.1)
g = torch.Generator().manual_seed(7)
data = torch.randn(4, 8, 16, generator=g)   # 4 micro-batches of 8
target = data[:, :, :4].argmax(dim=2)
losses = []
for step in range(5):
    opt.zero_grad()
    acts = []
    # Forward: stage 0 sends each micro-batch's activations, stage 1 computes the loss.
    for mb in range(4):
        if r == 0:
            a = stage(data[mb])
            acts.append(a)
            dist.send(a.detach(), 1)
        else:
            a = torch.empty(8, 32)
            dist.recv(a, 0)
            a.requires_grad_(True)
            loss = torch.nn.functional.cross_entropy(stage(a), target[mb]) / 4
            loss.backward()
            losses.append(loss.item())
            acts.append(a)
    # Backward: stage 1 sends the activations' gradients back, asynchronously.
    if r == 1:
        works = [dist.isend(a.grad, 0) for a in acts]
        for w in works:
            w.wait()
    else:
        grads = [torch.empty(8, 32) for _ in range(4)]
        works = [dist.irecv(gr, 1) for gr in grads]
        for a, gr, w in zip(acts, grads, works):
            w.wait()
            a.backward(gr)
    opt.step()
np.savez(f"{out}/{backend}{r}.npz", losses=np.array(losses),
         **{f"p{i}": p.detach().numpy() for i, p in enumerate(stage.parameters())})
sys.stdout.flush()
os._exit(0)
"""


def _both(tmp_path, script, n):
    outs = {}
    for backend in ("psnet", "gloo"):
        (tmp_path / backend).mkdir()
        out, _ = run_ranks(tmp_path / backend, n, _torchrun_shim + script.replace(
            "sys.argv[2]", repr(backend)), env=torchrun_env(free_port()))
        outs[backend] = out
    for r in range(n):
        p = np.load(outs["psnet"] / f"psnet{r}.npz")
        g = np.load(outs["gloo"] / f"gloo{r}.npz")
        assert set(p.files) == set(g.files)
        for name in p.files:
            assert p[name].tobytes() == g[name].tobytes(), (r, name, p[name], g[name])
    return outs


def test_fsdp2_trains_a_small_transformer_bit_identical_to_gloo(tmp_path):
    outs = _both(tmp_path, FSDP2, 2)
    losses = np.load(outs["psnet"] / "psnet0.npz")["losses"]
    assert losses[-1] < losses[0], losses


def test_a_two_stage_pipeline_trains_bit_identical_to_gloo(tmp_path):
    outs = _both(tmp_path, PIPELINE, 2)
    losses = np.load(outs["psnet"] / "psnet1.npz")["losses"]
    assert losses[-4:].sum() < losses[:4].sum(), losses


MOE = _torchrun_shim + """
import sys
import numpy as np
import torch, torch.distributed as dist
import psnet.torch
out = sys.argv[1]
dist.init_process_group("psnet")
r, n = dist.get_rank(), dist.get_world_size()
d = 8
torch.manual_seed(0)
experts = [torch.nn.Linear(d, d) for _ in range(n)]    # expert e lives on rank e
router = torch.nn.Linear(d, n)
x = torch.randn(20 + 3 * r, d, generator=torch.Generator().manual_seed(r))
with torch.no_grad():
    choice = router(x).argmax(dim=1)                   # top-1 routing
    order = torch.argsort(choice, stable=True)
    send_counts = torch.bincount(choice, minlength=n)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    tokens = torch.empty(int(recv_counts.sum()), d)
    dist.all_to_all_single(tokens, x[order], recv_counts.tolist(), send_counts.tolist())
    processed = experts[r](tokens)
    back = torch.empty(len(x), d)
    dist.all_to_all_single(back, processed, send_counts.tolist(), recv_counts.tolist())
    y = torch.empty_like(back)
    y[order] = back
np.savez(f"{out}/moe{r}.npz", x=x.numpy(), y=y.numpy())
dist.destroy_process_group()
"""


def test_a_mixture_of_experts_layer_matches_one_process(tmp_path):
    n = 3
    out, _ = run_ranks(tmp_path, n, MOE, env=torchrun_env(free_port()))
    torch.manual_seed(0)
    d = 8
    experts = [torch.nn.Linear(d, d) for _ in range(n)]
    router = torch.nn.Linear(d, n)
    # One process: every rank's tokens, each expert applied to the batch of tokens routed
    # to it in rank order (as the expert's rank receives them).
    res = [np.load(out / f"moe{r}.npz") for r in range(n)]
    xs = [torch.from_numpy(q["x"]) for q in res]
    with torch.no_grad():
        choices = [router(x).argmax(dim=1) for x in xs]
        orders = [torch.argsort(c, stable=True) for c in choices]
        want = [torch.empty_like(x) for x in xs]
        for e in range(n):
            picked = [(r, o[c[o] == e]) for r, (c, o) in enumerate(zip(choices, orders))]
            batch = torch.cat([xs[r][idx] for r, idx in picked])
            done = experts[e](batch)
            at = 0
            for r, idx in picked:
                want[r][idx] = done[at:at + len(idx)]
                at += len(idx)
    for r in range(n):
        assert np.array_equal(res[r]["y"], want[r].numpy()), r
        assert len(set(choices[r].tolist())) > 1, "tokens go to more than one expert"


SPLIT = _torchrun_shim + """
import torch, torch.distributed as dist
import psnet.torch
dist.init_process_group("psnet")
r, n = dist.get_rank(), dist.get_world_size()
# Ranks 3 and 1 (in that order), and ranks 0 and 2: the order in a split is the new ranks'.
g = dist.split_group(split_ranks=[[3, 1], [0, 2]])
mine = [3, 1] if r in (3, 1) else [0, 2]
assert (g.rank(), g.size()) == (mine.index(r), 2), (g.rank(), g.size())
assert dist.get_process_group_ranks(g) == mine, dist.get_process_group_ranks(g)
t = torch.full((3,), float(r + 1))
dist.all_reduce(t, group=g)
assert t.tolist() == [float(sum(m + 1 for m in mine))] * 3, t
b = torch.full((2,), float(r))
dist.broadcast(b, src=mine[0], group=g)
assert b.tolist() == [float(mine[0])] * 2, b
# The parent goes on, its calls and the split's in the order made.
w = torch.ones(1)
dist.all_reduce(w)
assert w.item() == n, w
# A split that leaves ranks 2 and 3 out: they get no group.
h = dist.split_group(split_ranks=[[0, 1]])
if r < 2:
    x = torch.full((1,), float(r))
    dist.all_reduce(x, group=h)
    assert x.item() == 1.0, x
else:
    assert h is dist.GroupMember.NON_GROUP_MEMBER, h
# Options psnet does not take are refused by name.
try:
    dist.split_group(split_ranks=[[0, 1, 2, 3]], pg_options=object())
    raise AssertionError("pg_options were taken")
except (ValueError, TypeError) as e:
    assert "pg_options" in str(e) or "incompatible" in str(e), e
# A 2 x 2 DeviceMesh (as HSDP and tensor parallelism make): its dimensions' groups (on CPU
# DeviceMesh makes them with new_group; with a bound GPU it calls split_group).
from torch.distributed.device_mesh import init_device_mesh
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
for dim, want in (("dp", [r % 2, r % 2 + 2]), ("tp", [r // 2 * 2, r // 2 * 2 + 1])):
    group = mesh.get_group(dim)
    assert dist.get_process_group_ranks(group) == want, (dim, dist.get_process_group_ranks(group))
    v = torch.full((1,), float(r))
    dist.all_reduce(v, group=group)
    assert v.item() == float(sum(want)), (dim, v)
dist.barrier()
print("ok", r, flush=True)
dist.destroy_process_group()
"""


def test_split_group_runs_through_psnets_split(tmp_path):
    """torch's split_group on 4 ranks: groups in the order given, a rank left out, the
    parent's calls still in order, and options psnet does not take refused."""
    out, results = run_ranks(tmp_path, 4, SPLIT, env=torchrun_env(free_port()))
    assert all("ok" in o for _, o in results), results


ANY = _torchrun_shim + """
import torch, torch.distributed as dist
import psnet, psnet.torch
dist.init_process_group("psnet")
r, n = dist.get_rank(), dist.get_world_size()
if r == 0:
    got = {}
    for _ in range(n - 1):
        t = torch.empty(3)
        src = dist.recv(t)
        got[src] = t.tolist()
    assert got == {s: [float(s)] * 3 for s in range(1, n)}, got
    # irecv without a source, waited on later.
    w = dist.irecv(t, tag=5)
    w.wait()
    assert w._source_rank() == 2 and t.tolist() == [20.0] * 3, (w._source_rank(), t)
else:
    dist.send(torch.full((3,), float(r)), 0)
    if r == 2:
        dist.send(torch.full((3,), 20.0), 0, tag=5)
dist.barrier()
print("ok", r, flush=True)
dist.destroy_process_group()
"""


def test_recv_without_a_source_rank_names_the_sender(tmp_path):
    out, results = run_ranks(tmp_path, 3, ANY, env=torchrun_env(free_port()))
    assert all("ok" in o for _, o in results), results

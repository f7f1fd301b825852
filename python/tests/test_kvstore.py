"""MXNet's kvstore API: 'local' in this process, and dist jobs (scheduler, 2 servers, 2
workers) under psnet-launch over TCP on 127.0.0.1, checked bit for bit against NumPy
references of MXNet's arithmetic."""

import numpy as np
import pytest

import psnet
from conftest import launch

STEPS = 4
SHAPES = {3: (2, 3), 5: (5000,), 7: (4, 1, 3)}


def grad(rank, step, key, shape):
    rng = np.random.default_rng(1000 * rank + 10 * step + key)
    return rng.standard_normal(shape).astype(np.float32)


# Each worker initializes, then per step pushes its gradients and pulls; it saves what it
# pulled. MXNET_KVSTORE_BIGARRAY_BOUND=1000 shards key 5 over both servers.
DIST = """
import json, sys
import numpy as np
import psnet

out, kind = sys.argv[1], {kind!r}
SHAPES = {shapes!r}
kv = psnet.kvstore.create(kind)
assert kv.type == kind
r, n = kv.rank, kv.num_workers
{setup}
keys = sorted(SHAPES)
kv.init(keys, [np.full(SHAPES[k], 0.5, dtype=np.float32) for k in keys])
res = {{}}
for step in range({steps}):
    grads = []
    for k in keys:
        rng = np.random.default_rng(1000 * r + 10 * step + k)
        grads.append(rng.standard_normal(SHAPES[k]).astype(np.float32))
    outs = [np.empty(SHAPES[k], dtype=np.float32) for k in keys]
    {exchange}
    for k, o in zip(keys, outs):
        res[f"{{k}}_{{step}}"] = o
kv.barrier()
np.savez(f"{{out}}/worker{{r}}.npz", **res)
"""


def dist_job(tmp_path, kind="dist_sync", setup="", exchange=None, env=None):
    exchange = exchange or "kv.push(keys, grads); kv.pull(keys, out=outs)"
    body = DIST.format(kind=kind, shapes=SHAPES, setup=setup, steps=STEPS, exchange=exchange)
    e = {"MXNET_KVSTORE_BIGARRAY_BOUND": "1000"}
    e.update(env or {})
    _, output, out = launch(tmp_path, 2, 2, body, env=e)
    return [dict(np.load(out / f"worker{r}.npz")) for r in range(2)], output


def test_dist_sync_without_an_optimizer_stores_each_rounds_sum(tmp_path):
    got, _ = dist_job(tmp_path)
    for step in range(STEPS):
        for k, shape in SHAPES.items():
            want = grad(0, step, k, shape) + grad(1, step, k, shape)
            for r in range(2):
                assert got[r][f"{k}_{step}"].tobytes() == want.tobytes(), (k, step, r)


def test_dist_sync_with_sgd_momentum_is_bit_identical_to_numpy(tmp_path):
    lr, mom_f = np.float32(0.1), np.float32(0.9)
    got, _ = dist_job(
        tmp_path,
        setup="kv.set_optimizer(psnet.optimizer.SGD(learning_rate=0.1, momentum=0.9))",
        exchange="kv.pushpull(keys, grads, out=outs)",
    )
    for k, shape in SHAPES.items():
        w = np.full(shape, 0.5, dtype=np.float32)
        mom = np.zeros(shape, dtype=np.float32)
        for step in range(STEPS):
            g = grad(0, step, k, shape) + grad(1, step, k, shape)
            # MXNet's sgd_mom_update with wd = 0 and rescale_grad = 1, term by term in f32.
            mom = mom_f * mom - (lr * np.float32(0.0)) * w - (lr * np.float32(1.0)) * g
            w = w + mom
            for r in range(2):
                assert got[r][f"{k}_{step}"].tobytes() == w.tobytes(), (k, step, r)


def quantized_sum(residual, step, k, shape, t=np.float32(0.5)):
    """MXNet's 2-bit codes of both workers' gradients (threshold t, each worker's residual
    updated in place), decoded and summed in rank order: a round's sum at the server."""
    total = None
    for r in range(2):
        v = residual[r] + grad(r, step, k, shape)
        q = np.where(v >= t, t, np.where(v <= -t, -t, np.float32(0))).astype(np.float32)
        residual[r][...] = np.where(v >= t, v - t, np.where(v <= -t, v + t, v))
        total = q if total is None else total + q
    return total


def test_dist_sync_with_2bit_compression_matches_the_quantized_reference(tmp_path):
    got, _ = dist_job(
        tmp_path,
        setup="kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})",
    )
    for k, shape in SHAPES.items():
        residual = [np.zeros(shape, dtype=np.float32) for _ in range(2)]
        for step in range(STEPS):
            total = quantized_sum(residual, step, k, shape)
            for r in range(2):
                assert got[r][f"{k}_{step}"].tobytes() == total.tobytes(), (k, step, r)


def lanes(xs):
    """psnet's sum of magnitudes: element i in lane i % 32 (in double precision), neighbouring
    lanes added pairwise, level by level: ((l0 + l1) + (l2 + l3)) + ... ."""
    s = [0.0] * 32
    for i, x in enumerate(xs):
        s[i % 32] += x
    while len(s) > 1:
        s = [s[k] + s[k + 1] for k in range(0, len(s), 2)]
    return s[0]


def test_compressed_pulls_give_every_worker_the_servers_copy_bit_for_bit(tmp_path):
    got, _ = dist_job(
        tmp_path,
        setup="kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5, 'pull': True})",
    )
    # Key 5 is split over both servers, each part with a copy and a scale of its own: the
    # workers must agree on it bit for bit. Keys 3 and 7 live whole on one server each:
    # NumPy's model of the server, with its master value and the workers' copy.
    for step in range(STEPS):
        assert got[0][f"5_{step}"].tobytes() == got[1][f"5_{step}"].tobytes(), step
    for k, shape in ((3, SHAPES[3]), (7, SHAPES[7])):
        residual = [np.zeros(shape, dtype=np.float32) for _ in range(2)]
        copy = np.full(shape, 0.5, dtype=np.float32)
        lossy = False
        for step in range(STEPS):
            total = quantized_sum(residual, step, k, shape)
            # No optimizer: the round's sum is the master value. The copy moves where the
            # change's magnitude is at least its mean, by the mean magnitude of those
            # elements (sums in order, in double precision).
            change = (total - copy).astype(np.float32)
            mags = [float(x) for x in np.abs(change).ravel()]
            mean = np.float32(lanes([x for x in mags]) / len(mags))
            taken = [x for x in mags if np.float32(x) >= mean]
            big = lanes([x if np.float32(x) >= mean else 0.0 for x in mags])
            scale = np.float32(big / len(taken)) if taken else np.float32(0)
            q = np.where(change >= mean, scale, np.where(change <= -mean, -scale, np.float32(0)))
            copy = (copy + q.astype(np.float32)).astype(np.float32)
            for r in range(2):
                assert got[r][f"{k}_{step}"].tobytes() == copy.tobytes(), (k, step, r)
            lossy = lossy or copy.tobytes() != total.tobytes()
        # The workers' copy is not the master value: the pulls were compressed.
        assert lossy, k


def test_dist_async_applies_every_push_once(tmp_path):
    # MXNet's 'test' optimizer (w += g): after every worker's pushes and a barrier, the value
    # is the initial one plus every push, in any order (integers: exact).
    body = """
        import sys, numpy as np, psnet
        out = sys.argv[1]
        kv = psnet.kvstore.create('dist_async')
        kv.set_optimizer('test')
        kv.init('w', np.zeros(1000, dtype=np.float32))
        for step in range(20):
            kv.push('w', np.full(1000, kv.rank + 1, dtype=np.float32))
        kv.barrier()
        got = np.empty(1000, dtype=np.float32)
        kv.pull('w', out=got)
        np.save(f"{out}/worker{kv.rank}.npy", got)
    """
    import textwrap
    _, _, out = launch(tmp_path, 2, 2, textwrap.dedent(body))
    for r in range(2):
        np.testing.assert_array_equal(np.load(out / f"worker{r}.npy"), np.full(1000, 60.0))


def test_str_keys_float16_device_lists_and_in_place_pushpull(tmp_path):
    body = """
        import sys, numpy as np, psnet
        out = sys.argv[1]
        kv = psnet.kvstore.create('dist_sync_device')
        r = kv.rank
        kv.init(['a', 'b'], [np.zeros((3, 2), dtype=np.float16), np.zeros(4, dtype=np.float32)])
        # Two 'devices' per worker: summed before the push, as MXNet does.
        kv.push('a', [np.full((3, 2), r + 1, dtype=np.float16), np.full((3, 2), 0.5, dtype=np.float16)])
        a = [np.empty((3, 2), dtype=np.float16), np.empty((3, 2), dtype=np.float16)]
        kv.pull('a', out=a)
        g = np.full(4, 2.0 * (r + 1), dtype=np.float32)
        kv.pushpull('b', g)  # out=None: in place, as in MXNet
        # One key, one array: the short paths of push, pull and pushpull(out=).
        kv.init(['c', 'x', 'y'], [np.zeros(5, dtype=np.float32)] + [np.zeros(3, dtype=np.float32)] * 2)
        kv.push('c', np.full(5, r + 1, dtype=np.float32))
        c = np.empty(5, dtype=np.float32)
        kv.pull('c', out=c)
        c2 = np.empty(5, dtype=np.float32)
        kv.pushpull('c', np.full(5, 10.0 * (r + 1), dtype=np.float32), out=c2)
        # Each output is the other key's input.
        x = np.full(3, 1.0 * (r + 1), dtype=np.float32)
        y = np.full(3, 100.0 * (r + 1), dtype=np.float32)
        kv.pushpull(['x', 'y'], [x, y], out=[y, x])
        np.savez(f"{out}/worker{r}.npz", a0=a[0], a1=a[1], b=g, c=c, c2=c2, x=x, y=y)
    """
    import textwrap
    _, _, out = launch(tmp_path, 2, 2, textwrap.dedent(body))
    for r in range(2):
        got = np.load(out / f"worker{r}.npz")
        for name in ("a0", "a1"):
            assert got[name].dtype == np.float16
            np.testing.assert_array_equal(got[name], np.full((3, 2), 4.0, dtype=np.float16))
        np.testing.assert_array_equal(got["b"], np.full(4, 6.0, dtype=np.float32))
        np.testing.assert_array_equal(got["c"], np.full(5, 3.0, dtype=np.float32))
        np.testing.assert_array_equal(got["c2"], np.full(5, 30.0, dtype=np.float32))
        np.testing.assert_array_equal(got["y"], np.full(3, 3.0, dtype=np.float32))
        np.testing.assert_array_equal(got["x"], np.full(3, 300.0, dtype=np.float32))


def test_dist_errors_are_python_exceptions_and_the_job_goes_on(tmp_path):
    body = """
        import sys, numpy as np, psnet
        out = sys.argv[1]
        kv = psnet.kvstore.create('dist_sync')
        from jobhelpers import raises
        kv.init(1, np.zeros(8, dtype=np.float32))
        raises(ValueError, kv.pull, 99, out=np.zeros(8, dtype=np.float32))
        raises(ValueError, kv.push, 1, np.zeros(9, dtype=np.float32))
        raises(TypeError, kv.push, 1, np.zeros(8, dtype=np.float64))
        raises(TypeError, kv.push, 'one', np.zeros(8, dtype=np.float32))
        raises(ValueError, kv.set_gradient_compression, {'type': '3bit'})
        raises(ValueError, kv.set_optimizer, 'rmsprop')
        raises(ValueError, kv.row_sparse_pull, 1)
        # Past the Python layer's checks: a row past the end, refused by the worker.
        raises(ValueError, kv._worker.pull_rows, 1, 2, [4], np.zeros(2, dtype=np.float32))
        # Past the Python layer's checks: the worker's own refusal, as a Python exception.
        raises(ValueError, kv._worker.pull, [99], [np.zeros(8, dtype=np.float32)])
        raises(ValueError, kv._worker.push, [1], [np.zeros(9, dtype=np.float32)])
        kv.push(1, np.ones(8, dtype=np.float32))
        got = np.empty(8, dtype=np.float32)
        kv.pull(1, out=got)
        assert (got == kv.num_workers).all(), got
    """
    import textwrap
    launch(tmp_path, 2, 1, textwrap.dedent(body))


def test_a_killed_server_fails_the_workers_naming_it(tmp_path):
    import os, signal, subprocess, sys, textwrap, time
    from conftest import _env, launcher

    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time, numpy as np, psnet
        out = sys.argv[1]
        kv = psnet.kvstore.create('dist_sync')
        kv.init(1, np.zeros(8, dtype=np.float32))
        open(f"{out}/ready{kv.rank}", "w").close()
        try:
            for _ in range(2000):
                kv.pushpull(1, np.ones(8, dtype=np.float32), out=np.empty(8, dtype=np.float32))
                time.sleep(0.01)
        except psnet.PeerLostError as e:
            print("lost:", e, flush=True)
            os._exit(7)
        print("never lost", flush=True)
    """))
    out = tmp_path / "out"
    out.mkdir()
    env = _env({"PSNET_SHM_RING": "0", "PS_HEARTBEAT_TIMEOUT": "5"})
    job = subprocess.Popen([launcher(), "-n", "2", "-s", "1", "--", sys.executable, str(script),
                            str(out)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all((out / f"ready{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and job.poll() is None, "the job never got going"
            time.sleep(0.05)
        server = [pid for pid in _pids_running(script) if _role_of(pid) == "server"]
        assert len(server) == 1, server
        os.kill(server[0], signal.SIGKILL)
        output, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0, output
    lost = [line for line in output.splitlines() if "lost:" in line]
    assert len(lost) == 2 and all("server" in line for line in lost), output


def _pids_running(script):
    import os
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if str(script).encode() in f.read():
                        yield int(pid)
            except OSError:
                pass


def _role_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for var in f.read().split(b"\0"):
                if var.startswith(b"DMLC_ROLE="):
                    return var.split(b"=", 1)[1].decode()
    except OSError:
        return None
    return None


def test_mxnet_optimizer_arguments_are_taken_by_name_or_refused_by_name():
    # MXNet's nightly test creates its optimizer this way: it raised TypeError before.
    opt = psnet.optimizer.create("test", rescale_grad=2, multi_precision=True)
    kv = psnet.kvstore.create("local")
    kv.init(1, np.ones(3, dtype=np.float32))
    kv.set_optimizer(opt)
    kv.push(1, np.ones(3, dtype=np.float32))
    out = np.empty(3, dtype=np.float32)
    kv.pull(1, out=out)
    np.testing.assert_array_equal(out, np.full(3, 3.0))  # w += g * rescale_grad
    psnet.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-4, lazy_update=True)
    psnet.optimizer.create("adam", learning_rate=0.01, clip_gradient=1.0, lr_scheduler=None)
    with pytest.warns(UserWarning, match="float32 master copy"):
        psnet.optimizer.create("sgd", multi_precision=False)
    with pytest.raises(ValueError, match="lr_scheduler is not supported"):
        psnet.optimizer.create("sgd", lr_scheduler=object())
    with pytest.raises(ValueError, match="unknown argument 'nesterov'"):
        psnet.optimizer.SGD(nesterov=True)


def test_local_store_sums_device_lists_and_applies_its_optimizer():
    kv = psnet.kvstore.create("local")
    assert (kv.type, kv.rank, kv.num_workers) == ("local", 0, 1)
    kv.init(3, np.ones((2, 2), dtype=np.float32))
    kv.push(3, [np.full((2, 2), 2, dtype=np.float32), np.full((2, 2), 3, dtype=np.float32)])
    out = np.empty((2, 2), dtype=np.float32)
    kv.pull(3, out=out)
    np.testing.assert_array_equal(out, np.full((2, 2), 5.0))
    kv.set_optimizer(psnet.optimizer.SGD(learning_rate=0.5))
    kv.push(3, np.full((2, 2), 1.0, dtype=np.float32))
    kv.pull(3, out=out)
    np.testing.assert_array_equal(out, np.full((2, 2), 4.5))  # 5 - 0.5 * 1
    with pytest.raises(ValueError):
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    with pytest.raises(ValueError):
        kv.pull(4, out=out)
    with pytest.raises(ValueError):
        kv.init(3, np.ones((2, 2), dtype=np.float32))
    # A key named twice in one call gets both values, summed (MXNet groups them).
    kv2 = psnet.kvstore.create("local")
    kv2.init("k", np.zeros(2, dtype=np.float32))
    kv2.push(["k", "k"], [np.ones(2, dtype=np.float32), np.full(2, 2, dtype=np.float32)])
    got = np.empty(2, dtype=np.float32)
    kv2.pull("k", out=got)
    np.testing.assert_array_equal(got, [3.0, 3.0])
    # A misspelt str key is refused and takes no number (MXNet numbers keys at init).
    with pytest.raises(ValueError, match="not initialized"):
        kv2.pull("typo", out=got)
    kv2.init("z", np.zeros(2, dtype=np.float32))
    assert kv2._key("z") == 1


def test_a_dist_store_outside_a_job_says_how_to_start_one(monkeypatch):
    for k in ("DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_SERVER",
              "DMLC_NUM_WORKER"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(psnet.KvError, match="psnet-launch"):
        psnet.kvstore.create("dist_sync")
    with pytest.raises(ValueError, match="unknown kvstore type"):
        psnet.kvstore.create("nccl")


def test_the_numpy_example_trains(tmp_path):
    from conftest import REPO
    script = (REPO / "python" / "examples" / "numpy_dist_sync.py").read_text()
    _, output, _ = launch(tmp_path, 2, 2, script)
    losses = {}
    for line in output.splitlines():
        if "epoch" in line and "loss" in line:
            words = line.split()
            worker = words[words.index("worker") + 1].rstrip(":")
            losses.setdefault(worker, []).append(float(words[words.index("loss") + 1]))
    assert set(losses) == {"0", "1"}, output
    for series in losses.values():
        assert len(series) == 5 and series[-1] < series[0] * 0.5, series


ROWS_JOB = """
import sys
import numpy as np
import psnet

out = sys.argv[1]
kv = psnet.kvstore.create('dist_sync')
r = kv.rank
table = np.arange(50 * 6, dtype=np.float32).reshape(50, 6) * 0.25
kv.init('emb', table)
kv.init('half', table.astype(np.float16))
# One round: the sum of both workers' pushes replaces the value (no optimizer).
kv.push('emb', np.full((50, 6), 1.0 + r, dtype=np.float32))
res = {}
sets = [[], [3], [49, 0, 49, 0], list(range(50)), [7, 2, 30, 2, 41]]
for i, ids in enumerate(sets):
    o = np.full((50, 6), -1.0, dtype=np.float32)
    kv.row_sparse_pull('emb', out=o, row_ids=np.array(ids, dtype=np.int64))
    res[f"emb{i}"] = o
    h = np.full((50, 6), -1.0, dtype=np.float16)
    kv.row_sparse_pull('half', out=h, row_ids=ids)
    res[f"half{i}"] = h
# MXNet's list form: one key, an out and row ids per device.
outs = [np.zeros((50, 6), dtype=np.float32) for _ in range(2)]
kv.row_sparse_pull('emb', out=outs, row_ids=[np.array([1]), np.array([2, 1])])
res["dev0"], res["dev1"] = outs
# psnet's compact form: row_ids[i] in out[i], nothing else written.
res["compact"] = kv.pull_rows('emb', [7, 2, 7])
res["compact_half"] = kv.pull_rows('half', np.array([49, 0]))
try:
    kv.row_sparse_pull('emb', out=np.zeros((50, 6), dtype=np.float32), row_ids=[50])
except ValueError as e:
    res["past"] = np.frombuffer(str(e).encode(), dtype=np.uint8)
kv.barrier()
np.savez(f"{out}/worker{r}.npz", **res)
"""


def test_row_sparse_pull_sends_the_rows_asked_for_and_reads_as_mxnets_dense_view(tmp_path):
    """2 workers, 2 servers, the table split over both (rows straddle the split); each row
    set is checked against a NumPy model: the rows asked for hold the key's values, every
    other row zeros, as MXNet's row_sparse result reads densely."""
    _, output, out = launch(tmp_path, 2, 2, ROWS_JOB, env={"MXNET_KVSTORE_BIGARRAY_BOUND": "100"})
    table = np.arange(50 * 6, dtype=np.float32).reshape(50, 6) * 0.25
    summed = np.full((50, 6), 3.0, dtype=np.float32)
    sets = [[], [3], [49, 0, 49, 0], list(range(50)), [7, 2, 30, 2, 41]]

    def dense(values, ids):
        want = np.zeros_like(values)
        want[ids] = values[ids]
        return want

    for r in range(2):
        got = dict(np.load(out / f"worker{r}.npz"))
        for i, ids in enumerate(sets):
            assert got[f"emb{i}"].tobytes() == dense(summed, ids).tobytes(), (r, ids)
            half = table.astype(np.float16)
            assert got[f"half{i}"].tobytes() == dense(half, ids).tobytes(), (r, ids)
        assert got["dev0"].tobytes() == dense(summed, [1]).tobytes()
        assert got["dev1"].tobytes() == dense(summed, [1, 2]).tobytes()
        assert got["compact"].tobytes() == summed[[7, 2, 7]].tobytes()
        assert got["compact_half"].tobytes() == table.astype(np.float16)[[49, 0]].tobytes()
        assert "row 50 asked for, it has 50 rows" in got["past"].tobytes().decode(), output


def test_row_sparse_pull_on_the_local_store_and_its_refusals():
    kv = psnet.kvstore.create("local")
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    kv.init(9, table)
    out = np.full((4, 3), 7.0, dtype=np.float32)
    kv.row_sparse_pull(9, out=out, row_ids=[2, 2, 0])
    want = np.zeros((4, 3), dtype=np.float32)
    want[[0, 2]] = table[[0, 2]]
    assert out.tobytes() == want.tobytes()
    with pytest.raises(ValueError, match="row_ids is required"):
        kv.row_sparse_pull(9, out=out)
    with pytest.raises(ValueError, match="row -1 asked for"):
        kv.row_sparse_pull(9, out=out, row_ids=[-1])
    with pytest.raises(TypeError, match="row ids are integers"):
        kv.row_sparse_pull(9, out=out, row_ids=[0.5])
    with pytest.raises(ValueError, match="holds shape"):
        kv.row_sparse_pull(9, out=np.zeros((2, 3), dtype=np.float32), row_ids=[0])
    assert kv.pull_rows(9, [3, 0, 3]).tobytes() == table[[3, 0, 3]].tobytes()
    mine = np.zeros((1, 3), dtype=np.float32)
    assert kv.pull_rows(9, [1], out=mine) is mine and mine.tobytes() == table[[1]].tobytes()
    with pytest.raises(ValueError, match="go into"):
        kv.pull_rows(9, [1, 2], out=mine)
    with pytest.raises(ValueError, match="row 4 asked for"):
        kv.pull_rows(9, [4])
    with pytest.raises(TypeError, match="holds float32 values, out is float16"):
        kv.pull_rows(9, [1], out=np.zeros((1, 3), dtype=np.float16))
    # Per-device outs with one plain list of ids: the same rows for every device.
    outs = [np.zeros((4, 3), dtype=np.float32) for _ in range(2)]
    kv.row_sparse_pull(9, out=outs, row_ids=[0, 3])
    want = np.zeros((4, 3), dtype=np.float32)
    want[[0, 3]] = table[[0, 3]]
    assert outs[0].tobytes() == want.tobytes() and outs[1].tobytes() == want.tobytes()


ROW_PUSH_JOB = """
import sys
import numpy as np
import psnet

out = sys.argv[1]
kv = psnet.kvstore.create('dist_sync')
r = kv.rank
table = np.arange(50 * 6, dtype=np.float32).reshape(50, 6) * 0.25
kv.init('emb', table, stype='row_sparse')
kv.init('half', table.astype(np.float16), stype='row_sparse')
kv.init('dense', table)
kv.set_optimizer(psnet.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01))
res = {}
for step in range(4):
    rng = np.random.default_rng(100 * r + step)
    ids = rng.permutation(50)[: [0, 50, 7, 13][(step + r) % 4]]
    g = rng.standard_normal((ids.size, 6)).astype(np.float32)
    kv.push_rows('emb', ids, g)
    kv.push('half', _RowSparse(ids, g.astype(np.float16)))
    res[f"emb{step}"] = kv.pull_rows('emb', np.arange(50))
    res[f"half{step}"] = kv.pull_rows('half', np.arange(50))
for name, call in [
    ("dense", lambda: kv.push('emb', table)),
    ("twice", lambda: kv.push_rows('emb', [3, 3], np.zeros((2, 6), dtype=np.float32))),
    ("not_rows", lambda: kv.push_rows('dense', [3], np.zeros((1, 6), dtype=np.float32))),
    ("short", lambda: kv.push_rows('emb', [3, 4], np.zeros((1, 6), dtype=np.float32))),
]:
    try:
        call()
    except (ValueError, psnet.KvError) as e:
        res[name] = np.frombuffer(str(e).encode(), dtype=np.uint8)
kv.barrier()
np.savez(f"{out}/worker{r}.npz", **res)
"""

ROW_SPARSE_VALUE = '''
class _RowSparse:
    """A value as MXNet's RowSparseNDArray presents itself: stype, indices, data."""
    stype = "row_sparse"

    def __init__(self, indices, data):
        self.indices, self.data = indices, data
'''


class _RowSparse:
    """A value as MXNet's RowSparseNDArray presents itself: stype, indices, data."""
    stype = "row_sparse"

    def __init__(self, indices, data):
        self.indices, self.data = indices, data


def lazy_sgd(w, mom, ids, g, lr=np.float32(0.1), mom_f=np.float32(0.9), wd=np.float32(0.01)):
    """MXNet's lazy sgd_mom_update: the rows pushed only, term by term in f32."""
    mom[ids] = mom_f * mom[ids] - (lr * wd) * w[ids] - (lr * np.float32(1.0)) * g
    w[ids] = w[ids] + mom[ids]


def test_row_sparse_pushes_update_only_the_rows_pushed_bit_for_bit(tmp_path):
    """2 workers, 2 servers, the tables split over both (rows straddle the split); 4 rounds
    of random row sets (none, all, some) with SGD, momentum and weight decay, against a NumPy
    model of MXNet's lazy update: each row summed in rank order where pushed, untouched rows
    and their momentum as they were."""
    body = ROW_PUSH_JOB.replace("res = {}", ROW_SPARSE_VALUE + "res = {}", 1)
    _, output, out = launch(tmp_path, 2, 2, body, env={"MXNET_KVSTORE_BIGARRAY_BOUND": "100"})
    table = np.arange(50 * 6, dtype=np.float32).reshape(50, 6) * 0.25
    w, mom = table.copy(), np.zeros_like(table)
    hw = table.astype(np.float16).astype(np.float32)
    hmom = np.zeros_like(table)
    got = [dict(np.load(out / f"worker{r}.npz")) for r in range(2)]
    for step in range(4):
        total = {}
        for r in range(2):
            rng = np.random.default_rng(100 * r + step)
            ids = rng.permutation(50)[: [0, 50, 7, 13][(step + r) % 4]]
            g = rng.standard_normal((ids.size, 6)).astype(np.float32)
            for i, row in enumerate(ids):
                total[row] = total[row] + g[i] if row in total else g[i].copy()
        ids = np.array(sorted(total), dtype=np.int64)
        if ids.size:
            g = np.stack([total[i] for i in ids])
            lazy_sgd(w, mom, ids, g)
            # The f16 key: the workers' f16 gradients widened, summed and applied in f32.
            hg = np.zeros_like(g)
            for r in range(2):
                rng = np.random.default_rng(100 * r + step)
                rids = rng.permutation(50)[: [0, 50, 7, 13][(step + r) % 4]]
                rg = rng.standard_normal((rids.size, 6)).astype(np.float32)
                for i, row in enumerate(rids):
                    hg[np.searchsorted(ids, row)] += rg[i].astype(np.float16).astype(np.float32)
            lazy_sgd(hw, hmom, ids, hg)
        for r in range(2):
            assert got[r][f"emb{step}"].tobytes() == w.tobytes(), (step, r, output)
            assert got[r][f"half{step}"].tobytes() == hw.astype(np.float16).tobytes(), (step, r)
    text = {k: got[0][k].tobytes().decode() for k in ("dense", "twice", "not_rows", "short")}
    assert "is row-sparse" in text["dense"], text
    assert "row 3 is pushed twice" in text["twice"], text
    assert "is dense" in text["not_rows"], text
    assert "need 12 values" in text["short"], text


def test_row_sparse_pushes_on_the_local_store():
    kv = psnet.kvstore.create("local")
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    kv.init("e", table, stype="row_sparse")
    # No optimizer: the push replaces the table, every other row zero (MXNet's server).
    kv.push_rows("e", [2, 0], np.array([[1, 1, 1], [2, 2, 2]], dtype=np.float32))
    want = np.zeros((4, 3), dtype=np.float32)
    want[2], want[0] = 1, 2
    assert kv.pull_rows("e", np.arange(4)).tobytes() == want.tobytes()
    kv.set_optimizer(psnet.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01))
    w, mom = want.copy(), np.zeros_like(want)
    for ids in ([3, 1], [1], []):
        g = np.full((len(ids), 3), 0.5, dtype=np.float32)
        kv.push_rows("e", ids, g)
        order = np.argsort(ids)
        if ids:
            lazy_sgd(w, mom, np.array(ids)[order], g[order])
        assert kv.pull_rows("e", np.arange(4)).tobytes() == w.tobytes(), ids
    with pytest.raises(ValueError, match="is row-sparse"):
        kv.push("e", table)
    with pytest.raises(ValueError, match="row 1 is pushed twice"):
        kv.push_rows("e", [1, 1], np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="row 4 asked for"):
        kv.push_rows("e", [4], np.zeros((1, 3), dtype=np.float32))
    kv.init("d", table)
    with pytest.raises(ValueError, match="is dense"):
        kv.push_rows("d", [1], np.zeros((1, 3), dtype=np.float32))
    with pytest.raises(ValueError, match=r"of shape \(2, 3\), given \(3, 2\)"):
        kv.push_rows("e", [1, 2], np.zeros((3, 2), dtype=np.float32))
    # MXNet's row_sparse values: a list per device is summed where rows meet; one pushed to
    # a dense key is refused (MXNet would update its rows lazily, a dense push every row).
    before = kv.pull_rows("e", np.arange(4))
    devices = [_RowSparse([2, 0], np.full((2, 3), 1.0, dtype=np.float32)),
               _RowSparse([2], np.full((1, 3), 2.0, dtype=np.float32))]
    kv.push("e", devices)
    ids, g = np.array([0, 2]), np.array([[1.0] * 3, [3.0] * 3], dtype=np.float32)
    lazy_sgd(w, mom, ids, g)
    assert kv.pull_rows("e", np.arange(4)).tobytes() == w.tobytes()
    assert not np.array_equal(before, w)
    plain = psnet.kvstore.create("local")
    plain.init("d", np.ones((4, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="is dense"):
        plain.push("d", _RowSparse(np.array([3]), np.full((1, 3), 5.0, dtype=np.float32)))
    lazy_off = psnet.kvstore.create("local")
    lazy_off.init("e", table, stype="row_sparse")
    lazy_off.set_optimizer(psnet.optimizer.SGD(lazy_update=False))
    with pytest.raises(ValueError, match="lazy_update=False"):
        lazy_off.push_rows("e", [1], np.zeros((1, 3), dtype=np.float32))

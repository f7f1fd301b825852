"""psnet.mxnet: MXNet 1.9.1's gluon trainer over psnet. Runs only where MXNet 1.9.1 imports
(Python 3.10 or older; ``bash scripts/test-mxnet.sh`` makes such an environment), and says
so when skipped."""

import subprocess
import sys

import numpy as np
import pytest

from conftest import JOB_TIMEOUT, REPO, _env, launcher

mx = pytest.importorskip(
    "mxnet", reason="MXNet 1.9.1 is not installed in this Python (scripts/test-mxnet.sh runs "
    "these tests in a Python 3.10 environment with it)")

import psnet.mxnet  # noqa: E402
from psnet.mxnet import _translate  # noqa: E402

EXAMPLE = REPO / "python" / "examples" / "mxnet_gluon.py"
SPARSE_EXAMPLE = REPO / "python" / "examples" / "mxnet_sparse.py"


def test_the_stores_are_in_mxnets_registry_under_names_gluon_keeps():
    registry = mx.kvstore.KVStoreBase.kv_registry
    for name, kind in (("dist_sync_psnet", "dist_sync"), ("psnet", "dist_sync"),
                       ("dist_async_psnet", "dist_async")):
        assert name in registry, name
        assert registry[name]._mode == kind
    # Gluon keeps a single device's kvstore only when its name says dist.
    assert "dist" in "dist_sync_psnet" and "dist" in "dist_async_psnet"
    assert registry["psnet"].is_capable("optimizer")
    assert not registry["psnet"].is_capable("sparse")


def test_mxnet_optimizers_translate_with_their_arguments():
    sgd = mx.optimizer.SGD(learning_rate=0.3, momentum=0.9, wd=0.01, rescale_grad=0.25,
                           clip_gradient=5.0)
    assert _translate(sgd).params == dict(learning_rate=0.3, momentum=0.9, wd=0.01,
                                          rescale_grad=0.25, clip_gradient=5.0)
    adam = mx.optimizer.Adam(learning_rate=0.002, beta1=0.8, beta2=0.99, epsilon=1e-6)
    assert _translate(adam).params == dict(learning_rate=0.002, beta1=0.8, beta2=0.99,
                                           epsilon=1e-6, wd=0.0, rescale_grad=1.0)
    assert _translate(mx.optimizer.Test(rescale_grad=2.0)).params == dict(rescale_grad=2.0)


def test_what_psnets_servers_do_not_run_is_refused_by_name():
    schedule = mx.optimizer.SGD(learning_rate=0.1,
                                lr_scheduler=mx.lr_scheduler.FactorScheduler(step=10))
    with pytest.raises(ValueError, match="lr_scheduler"):
        _translate(schedule)
    net = mx.gluon.nn.Dense(2, in_units=3)
    net.initialize()
    net.weight.lr_mult = 0.5
    params = dict(enumerate(net.collect_params().values()))
    with pytest.raises(ValueError, match="lr_mult=0.5"):
        _translate(mx.optimizer.SGD(learning_rate=0.1, param_dict=params))
    with pytest.raises(ValueError, match="RMSProp"):
        _translate(mx.optimizer.RMSProp())


def _train(tmp_path, kvstore):
    out = tmp_path / f"{kvstore}.bin"
    cmd = [launcher(), "-n", "2", "-s", "1", "--", sys.executable, str(EXAMPLE),
           "--kvstore", kvstore, "--dump", str(out)]
    done = subprocess.run(cmd, env=_env({"PS_VERBOSE": "0"}), capture_output=True, text=True,
                          timeout=JOB_TIMEOUT)
    assert done.returncode == 0, f"{kvstore}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    return np.fromfile(out, dtype=np.float32), done.stdout


def test_a_gluon_trainer_over_psnet_ends_with_mxnets_own_dist_sync_weights(tmp_path):
    """The same script, 2 workers and 1 server, once with kvstore='dist_sync_psnet' and once
    with MXNet's own 'dist_sync' (its ps-lite, started by psnet-launch): the same weights, bit
    for bit (with two workers a sum's order cannot change its bits)."""
    ours, log = _train(tmp_path, "dist_sync_psnet")
    theirs, _ = _train(tmp_path, "dist_sync")
    assert ours.size == theirs.size == 16 * 32 + 32 + 32 * 4 + 4
    assert "step 29 loss" in log
    np.testing.assert_array_equal(ours, theirs)
    assert not np.array_equal(ours, np.zeros_like(ours))


def test_a_gluon_sparse_embedding_over_psnet_ends_with_mxnets_own_weights(tmp_path):
    """gluon.contrib.nn.SparseEmbedding (a row_sparse weight: init, row pushes of its
    gradients, row_sparse_pull of the rows each batch uses) and a dense layer, 2 workers and
    2 servers, over psnet's store and over MXNet's own dist_sync: the same weights bit for
    bit."""
    weights = {}
    for kvstore in ("dist_sync_psnet", "dist_sync"):
        out = tmp_path / f"{kvstore}.bin"
        cmd = [launcher(), "-n", "2", "-s", "2", "--", sys.executable, str(SPARSE_EXAMPLE),
               "--kvstore", kvstore, "--dump", str(out)]
        done = subprocess.run(cmd, env=_env({"PS_VERBOSE": "0"}), capture_output=True,
                              text=True, timeout=JOB_TIMEOUT)
        assert done.returncode == 0, f"{kvstore}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
        weights[kvstore] = np.fromfile(out, dtype=np.float32)
    assert weights["dist_sync"].size == 200 * 8 + 8 * 4 + 4
    np.testing.assert_array_equal(weights["dist_sync_psnet"], weights["dist_sync"])


def test_load_optimizer_states_says_where_the_state_comes_from():
    store = object.__new__(psnet.mxnet.Psnet)
    with pytest.raises(NotImplementedError, match="PSNET_CHECKPOINT_DIR"):
        store.load_optimizer_states("x")


ROWS_BOTH = """
import sys
import numpy as np

lib, out, momentum = sys.argv[1], sys.argv[2], float(sys.argv[3])
ROWS, W = 40, 5
table = np.random.default_rng(7).standard_normal((ROWS, W)).astype(np.float32)
if lib == "mxnet":
    import mxnet as mx
    kv = mx.kv.create("dist_sync")
    kv.init(0, mx.nd.array(table).tostype("row_sparse"))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=momentum, wd=0.03,
                                      lazy_update=True))
else:
    import psnet
    kv = psnet.kvstore.create("dist_sync")
    kv.init(0, table, stype="row_sparse")
    kv.set_optimizer(psnet.optimizer.SGD(learning_rate=0.1, momentum=momentum, wd=0.03,
                                         lazy_update=True))
r = kv.rank
res = []
for step in range(4):
    rng = np.random.default_rng(10 * r + step)
    ids = np.sort(rng.choice(ROWS, [1, ROWS, 7, 3][(step + r) % 4], replace=False))
    g = rng.standard_normal((ids.size, W)).astype(np.float32)
    if lib == "mxnet":
        rsp = mx.nd.sparse.row_sparse_array(
            (mx.nd.array(g), mx.nd.array(ids, dtype="int64")), shape=(ROWS, W))
        kv.push(0, rsp)
        o = mx.nd.sparse.zeros("row_sparse", (ROWS, W))
        kv.row_sparse_pull(0, out=o, row_ids=mx.nd.arange(ROWS, dtype="int64"))
        res.append(o.asnumpy())
    else:
        kv.push_rows(0, ids, g)
        res.append(kv.pull_rows(0, np.arange(ROWS)))
np.save(f"{out}/{lib}{momentum}_{r}.npy", np.stack(res))
"""


@pytest.mark.parametrize("momentum", [0.5, 0.0])
def test_row_sparse_pushes_end_with_mxnets_own_lazy_update(tmp_path, momentum):
    """The same row-sparse job, 2 workers and 2 servers (the table split over both), once on
    MXNet's own dist_sync (its ps-lite servers, started by psnet-launch) and once on psnet's
    kvstore: SGD with weight decay, with momentum (MXNet's sgd_mom_update kernel) and without
    (its sgd_update kernel, whose row_sparse form differs from the dense one), lazy_update=True,
    4 rounds of row sets of every size; every round's table the same bit for bit (with two
    workers a sum's order cannot change its bits)."""
    script = tmp_path / "rows.py"
    script.write_text(ROWS_BOTH)
    got = {}
    for lib in ("mxnet", "psnet"):
        cmd = [launcher(), "-n", "2", "-s", "2", "--", sys.executable, str(script), lib,
               str(tmp_path), str(momentum)]
        done = subprocess.run(cmd, env=_env({"PS_VERBOSE": "0",
                                             "MXNET_KVSTORE_BIGARRAY_BOUND": "50"}),
                              capture_output=True, text=True, timeout=JOB_TIMEOUT)
        assert done.returncode == 0, f"{lib}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
        got[lib] = [np.load(tmp_path / f"{lib}{momentum}_{r}.npy") for r in range(2)]
    for r in range(2):
        np.testing.assert_array_equal(got["psnet"][r], got["mxnet"][r])
    # Rows no worker touched kept their values: the update was lazy.
    assert not np.array_equal(got["psnet"][0][-1], got["psnet"][0][0])

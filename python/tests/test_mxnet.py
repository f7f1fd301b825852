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


def test_load_optimizer_states_says_where_the_state_comes_from():
    store = object.__new__(psnet.mxnet.Psnet)
    with pytest.raises(NotImplementedError, match="PSNET_CHECKPOINT_DIR"):
        store.load_optimizer_states("x")

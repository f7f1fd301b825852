"""The README's Python and PyTorch examples, run as they are written, so that they keep up
with the package."""

import re

import pytest

from conftest import REPO, free_port, launch, run_ranks


def readme_blocks():
    text = (REPO / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_readme_has_a_python_and_a_pytorch_example():
    blocks = readme_blocks()
    assert len(blocks) == 2, blocks
    assert "psnet.kvstore.create" in blocks[0]
    assert "import psnet.torch" in blocks[1]


def test_the_readme_python_example_trains_as_it_says(tmp_path):
    _, output, _ = launch(tmp_path, 2, 2, readme_blocks()[0])
    finals = dict(re.findall(r"worker (\d): (-?[0-9.e-]+)", output))
    assert set(finals) == {"0", "1"}, output
    # dist_sync: both workers end with the same value, 10 steps of SGD on the sum of
    # 0.01 and 0.02, rescaled by 1/2, at a rate of 0.1.
    for value in finals.values():
        assert float(value) == pytest.approx(-10 * 0.1 * 0.03 / 2, rel=1e-4), output


def test_the_readme_pytorch_example_runs_under_torchrun_variables(tmp_path):
    pytest.importorskip("torch", reason="torch is not installed: the torch example is not run")
    # torchrun's variables, as a launcher started by the test sets them.
    shim = (
        "import os\n"
        "os.environ['RANK'] = os.environ['PSNET_RANK']\n"
        "os.environ['WORLD_SIZE'] = os.environ['PSNET_WORLD_SIZE']\n"
        "os.environ['LOCAL_RANK'] = os.environ['PSNET_RANK']\n"
        "del os.environ['PSNET_ROOT_ADDR']\n"
    )
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    run_ranks(tmp_path, 2, shim + readme_blocks()[1], env=env)

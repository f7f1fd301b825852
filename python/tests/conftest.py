"""Helpers that start real jobs: ranks of a collectives job as Python processes, and kv jobs
(scheduler, servers, workers) under psnet-launch, all on 127.0.0.1."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Every job's processes are ended after this long, so a hang fails the test instead of
# hanging it.
JOB_TIMEOUT = float(os.environ.get("PSNET_PYTEST_JOB_TIMEOUT", "120"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name, variable, package):
    """A psnet binary: $VARIABLE, on PATH, or this checkout's build."""
    candidates = [os.environ.get(variable), shutil.which(name)]
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    candidates += [str(target / p / name) for p in ("debug", "release")]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    pytest.fail(f"{name} not found: build it (cargo build -p {package}) or set {variable}")


def launcher():
    """psnet-launch: $PSNET_LAUNCH, on PATH, or this checkout's build."""
    return _binary("psnet-launch", "PSNET_LAUNCH", "psnet-launch")


def doctor():
    """psnet-doctor: $PSNET_DOCTOR, on PATH, or this checkout's build."""
    return _binary("psnet-doctor", "PSNET_DOCTOR", "psnet-recorder")


def _script(tmp_path, body, name="job.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _env(extra):
    env = dict(os.environ)
    # A test's own job only: no variables of an enclosing job.
    for k in list(env):
        if k.startswith(("DMLC_", "PSNET_RANK", "PSNET_WORLD_SIZE", "PSNET_ROOT_ADDR")) or k in (
            "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
        ):
            del env[k]
    env["PYTHONUNBUFFERED"] = "1"
    # The job scripts import jobhelpers from here.
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


class Ranks:
    """n Python processes of one collectives job (PSNET_RANK / PSNET_WORLD_SIZE /
    PSNET_ROOT_ADDR), each running the same script with argv[1] = an output directory."""

    def __init__(self, tmp_path, n, body, env=None):
        self.out = tmp_path / "out"
        self.out.mkdir(exist_ok=True)
        script = _script(tmp_path, body)
        self.script, self.root, self.n, self.env = script, f"127.0.0.1:{free_port()}", n, env
        self.procs = [self.start(r) for r in range(n)]

    def start(self, rank):
        """Starts one more process of the job as `rank` (the ranks' own are started already)."""
        e = _env({"PSNET_RANK": str(rank), "PSNET_WORLD_SIZE": str(self.n),
                  "PSNET_ROOT_ADDR": self.root})
        e.update(self.env or {})
        return subprocess.Popen(
            [sys.executable, str(self.script), str(self.out)], env=e,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )

    def wait(self, timeout=JOB_TIMEOUT):
        """(exit status, output) per rank; every rank is killed at the timeout."""
        results = []
        for p in self.procs:
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                out, _ = p.communicate()
                out += "\n[killed at the test's timeout]"
            results.append((p.returncode, out))
        return results

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def run_ranks(tmp_path, n, body, env=None, timeout=JOB_TIMEOUT):
    """Runs the job; fails the test, with every rank's output, unless all exit 0."""
    ranks = Ranks(tmp_path, n, body, env)
    results = ranks.wait(timeout)
    if any(rc != 0 for rc, _ in results):
        report = "\n".join(f"--- rank {r} exited {rc}\n{out}" for r, (rc, out) in enumerate(results))
        pytest.fail(f"a rank failed:\n{report}")
    return ranks.out, results


def launch(tmp_path, workers, servers, body, env=None, timeout=JOB_TIMEOUT, check=True):
    """Runs the script under psnet-launch (scheduler, servers and workers on 127.0.0.1), with
    argv[1] = an output directory; returns (exit status, output, the directory)."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    script = _script(tmp_path, body)
    e = _env({"PSNET_SHM_RING": "0"})
    e.update(env or {})
    cmd = [launcher(), "-n", str(workers), "-s", str(servers), "--",
           sys.executable, str(script), str(out)]
    p = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        output, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        output, _ = p.communicate()
        output += "\n[killed at the test's timeout]"
    if check and p.returncode != 0:
        pytest.fail(f"the job exited {p.returncode}:\n{output}")
    return p.returncode, output, out

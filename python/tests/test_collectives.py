"""Collectives on NumPy arrays against NumPy references, over TCP on 127.0.0.1, with 1 to 4
ranks as separate processes."""

import subprocess
import time

import numpy as np
import pytest

from conftest import Ranks, doctor, run_ranks

# Each rank's inputs: small integers (exact in every type, so a sum in any order is exact)
# and random floats (to check every rank ends with the same bits).
JOB = """
import sys
import numpy as np
import psnet

out = sys.argv[1]
psnet.init()
r, n = psnet.rank(), psnet.size()
res = {}
for name in ("float32", "float64", "float16", "int32", "int64", "uint8"):
    dt = np.dtype(name)
    for length in (0, 1, 7, 1000, 70001):
        x = ((np.arange(length) * (r + 3)) % 5).astype(dt)
        res[f"sum_{name}_{length}"] = psnet.allreduce(x.copy())
        res[f"max_{name}_{length}"] = psnet.allreduce(x.copy(), op="max")
        res[f"min_{name}_{length}"] = psnet.allreduce(x.copy(), op="min")
    y = np.full(3, r + 1, dtype=dt)
    res[f"prod_{name}"] = psnet.allreduce(y, op="prod")
rng = np.random.default_rng(r)
noise = rng.standard_normal(100003).astype(np.float32)
res["noise_sum"] = psnet.allreduce(noise.copy())
res["noise_avg"] = psnet.allreduce(noise.copy(), op="avg")
kept = noise.copy()
res["out_of_place"] = psnet.allreduce(kept, out=np.empty_like(kept))
res["kept"] = kept
b = np.arange(10, dtype=np.float64) * (r + 1)
res["bcast"] = psnet.broadcast(b, root=n - 1)
res["gather"] = psnet.allgather(np.full((2, 3), r, dtype=np.int32))
res["scatter"] = psnet.reduce_scatter(np.arange(4 * n, dtype=np.int64).reshape(2 * n, 2) + r)
red = np.full(5, r + 1, dtype=np.float32)
psnet.reduce(red, root=0)
res["reduce"] = red
psnet.barrier()
np.savez(f"{out}/rank{r}.npz", **res)
"""


def inputs(r, name, length):
    return ((np.arange(length) * (r + 3)) % 5).astype(name)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_collective_matches_numpy(tmp_path, n):
    out, _ = run_ranks(tmp_path, n, JOB)
    got = [dict(np.load(out / f"rank{r}.npz")) for r in range(n)]
    for name in ("float32", "float64", "float16", "int32", "int64", "uint8"):
        for length in (0, 1, 7, 1000, 70001):
            xs = [inputs(r, name, length) for r in range(n)]
            want_sum = xs[0].copy()
            for x in xs[1:]:
                want_sum = want_sum + x
            for r in range(n):
                g = got[r]
                np.testing.assert_array_equal(g[f"sum_{name}_{length}"], want_sum.astype(name))
                np.testing.assert_array_equal(g[f"max_{name}_{length}"], np.maximum.reduce(xs))
                np.testing.assert_array_equal(g[f"min_{name}_{length}"], np.minimum.reduce(xs))
        prod = np.prod([np.full(3, r + 1, dtype=name) for r in range(n)], axis=0, dtype=name)
        for r in range(n):
            np.testing.assert_array_equal(got[r][f"prod_{name}"], prod)
    noise = [np.random.default_rng(r).standard_normal(100003).astype(np.float32) for r in range(n)]
    for r in range(n):
        g = got[r]
        # The same bits on every rank; the value within float rounding of NumPy's sum.
        assert g["noise_sum"].tobytes() == got[0]["noise_sum"].tobytes()
        np.testing.assert_allclose(g["noise_sum"], np.sum(noise, axis=0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g["noise_avg"], np.mean(noise, axis=0), rtol=1e-5, atol=1e-5)
        assert g["out_of_place"].tobytes() == g["noise_sum"].tobytes()
        np.testing.assert_array_equal(g["kept"], noise[r])
        np.testing.assert_array_equal(g["bcast"], np.arange(10, dtype=np.float64) * n)
        np.testing.assert_array_equal(
            g["gather"], np.concatenate([np.full((2, 3), q, dtype=np.int32) for q in range(n)]))
        total = sum(np.arange(4 * n, dtype=np.int64).reshape(2 * n, 2) + q for q in range(n))
        np.testing.assert_array_equal(g["scatter"], total[2 * r:2 * r + 2])
    np.testing.assert_array_equal(got[0]["reduce"], np.full(5, n * (n + 1) / 2, dtype=np.float32))
    for r in range(1, n):
        np.testing.assert_array_equal(got[r]["reduce"], np.full(5, r + 1, dtype=np.float32))


def test_torch_cpu_tensors_are_reduced_in_place(tmp_path):
    pytest.importorskip("torch", reason="torch is not installed here: its tensors are not tested")
    run_ranks(tmp_path, 2, """
        import sys, torch, psnet
        psnet.init()
        t = torch.full((5,), float(psnet.rank() + 1))
        psnet.allreduce(t)
        assert t.tolist() == [3.0] * 5, t
    """)


def test_bad_arguments_are_python_errors(tmp_path):
    run_ranks(tmp_path, 1, """
        import numpy as np, psnet
        psnet.init()
        from jobhelpers import raises
        raises(TypeError, psnet.allreduce, np.zeros(3, dtype=np.complex64))
        raises(TypeError, psnet.allreduce, [1.0, 2.0])
        raises(ValueError, psnet.allreduce, np.zeros((4, 4), dtype=np.float32)[:, 0])
        ro = np.zeros(3, dtype=np.float32); ro.flags.writeable = False
        raises(ValueError, psnet.allreduce, ro)
        raises(ValueError, psnet.allreduce, np.zeros(3, dtype=np.int32), op="avg")
        raises(ValueError, psnet.allreduce, np.zeros(3, dtype=np.float32), op="median")
        raises(ValueError, psnet.broadcast, np.zeros(3, dtype=np.float32), root=5)
        raises(ValueError, psnet.reduce_scatter, np.zeros(3, dtype=np.float32),
               out=np.zeros(2, dtype=np.float32))
        raises(ValueError, psnet.reduce, np.zeros(3, dtype=np.int64), op="avg")
        # Refused before the call took its turn: the communicator still works.
        assert psnet.allreduce(np.ones(3, dtype=np.float32)).tolist() == [1.0, 1.0, 1.0]
    """)


def test_ranks_that_disagree_on_a_length_all_raise(tmp_path):
    ranks = Ranks(tmp_path, 3, """
        import numpy as np, psnet
        psnet.init()
        try:
            psnet.allreduce(np.zeros(10 + psnet.rank(), dtype=np.float32))
        except psnet.PsnetError as e:
            print("raised:", type(e).__name__, e)
            raise SystemExit(3)
    """)
    for r, (rc, out) in enumerate(ranks.wait()):
        assert rc == 3, f"rank {r} exited {rc}:\n{out}"
        assert "raised:" in out and "rank" in out


def test_a_rank_that_dies_is_named_by_the_others(tmp_path):
    ranks = Ranks(tmp_path, 3, """
        import os, numpy as np, psnet
        psnet.init()
        if psnet.rank() == 2:
            psnet.allreduce(np.zeros(4, dtype=np.float32))
            os._exit(9)
        try:
            psnet.allreduce(np.zeros(4, dtype=np.float32))
            psnet.allreduce(np.zeros(1 << 20, dtype=np.float32))
        except psnet.PeerLostError as e:
            print("lost:", e)
            raise SystemExit(3)
    """, env={"PSNET_COLL_TIMEOUT": "60"})
    results = ranks.wait(timeout=60)
    assert results[2][0] == 9
    for r in (0, 1):
        rc, out = results[r]
        assert rc == 3, f"rank {r} exited {rc}:\n{out}"
        assert "rank 2" in out, out


def test_a_frozen_rank_is_named_within_the_heartbeat_timeout(tmp_path):
    """Rank 2 stops itself (SIGSTOP) before an allreduce: its connections stay open, so
    only heartbeats tell. The others raise naming it within PSNET_COLL_HEARTBEAT_TIMEOUT,
    not after the 600 s call timeout."""
    ranks = Ranks(tmp_path, 3, """
        import os, signal, time, numpy as np, psnet
        psnet.init()
        psnet.allreduce(np.zeros(4, dtype=np.float32))
        if psnet.rank() == 2:
            os.kill(os.getpid(), signal.SIGSTOP)
        started = time.monotonic()
        try:
            psnet.allreduce(np.zeros(1 << 16, dtype=np.float32))
        except psnet.PeerLostError as e:
            print(f"lost after {time.monotonic() - started:.1f} s:", e, flush=True)
            raise SystemExit(3)
    """, env={"PSNET_COLL_HEARTBEAT_TIMEOUT": "2", "PSNET_RECORDER_DIR": str(tmp_path / "dumps")})
    try:
        deadline = time.monotonic() + 60
        results = {}
        for r in (0, 1):
            left = max(1.0, deadline - time.monotonic())
            out, _ = ranks.procs[r].communicate(timeout=left)
            results[r] = (ranks.procs[r].returncode, out)
    finally:
        ranks.kill()
    for r in (0, 1):
        rc, out = results[r]
        assert rc == 3, f"rank {r} exited {rc}:\n{out}"
        assert "rank 2" in out and "PSNET_COLL_HEARTBEAT_TIMEOUT" in out, out
    # Their flight recorders dumped when the call failed; the frozen rank wrote none. The
    # doctor names the call they failed in, the loss of rank 2, and rank 2's missing dump.
    verdict = subprocess.run([doctor(), str(tmp_path / "dumps")], capture_output=True,
                             text=True, timeout=60)
    assert verdict.returncode == 0, verdict.stderr
    text = verdict.stdout
    assert "ranks 0-1 failed in allreduce #" in text and "65,536 elements" in text, text
    assert "rank 2 left no dump" in text, text


def test_ranks_that_make_different_calls_are_named_by_the_doctor(tmp_path):
    """Rank 2 calls reduce_scatter where ranks 0 and 1 call allgather: every rank fails, each
    dumps its flight recorder, and psnet-doctor names the call number and both calls."""
    dumps = tmp_path / "dumps"
    ranks = Ranks(tmp_path, 3, """
        import numpy as np, psnet
        psnet.init()
        psnet.allreduce(np.zeros(4, dtype=np.float32))
        try:
            if psnet.rank() == 2:
                psnet.reduce_scatter(np.ones(30, dtype=np.float32))
            else:
                psnet.allgather(np.ones(10, dtype=np.float32))
        except psnet.PsnetError as e:
            print("failed:", e, flush=True)
            raise SystemExit(3)
    """, env={"PSNET_RECORDER_DIR": str(dumps)})
    results = ranks.wait(timeout=60)
    for r, (rc, out) in enumerate(results):
        assert rc == 3, f"rank {r} exited {rc}:\n{out}"
    verdict = subprocess.run([doctor(), str(dumps)], capture_output=True, text=True, timeout=60)
    assert verdict.returncode == 0, verdict.stderr
    assert "rank 2 called reduce_scatter, the others allgather" in verdict.stdout, verdict.stdout


def test_a_rank_that_skips_a_call_is_named_by_the_doctor(tmp_path):
    """Rank 2 skips the allreduce ranks 0 and 1 make (it stays alive, answering heartbeats):
    they time out (PSNET_COLL_TIMEOUT) and dump; rank 2 leaves cleanly afterwards and dumps
    too (PSNET_RECORDER_DUMP=always). psnet-doctor names the call and rank 2's last one."""
    dumps = tmp_path / "dumps"
    ranks = Ranks(tmp_path, 3, """
        import os, sys, time, numpy as np, psnet
        psnet.init()
        psnet.allreduce(np.ones(4, dtype=np.float32))
        out = sys.argv[1]
        if psnet.rank() == 2:
            for _ in range(600):
                if all(os.path.exists(os.path.join(out, f"gave_up{r}")) for r in (0, 1)):
                    break
                time.sleep(0.1)
            psnet.shutdown()
            raise SystemExit(0)
        try:
            psnet.allreduce(np.ones(1000, dtype=np.float32))
        except psnet.PsnetError as e:
            print("failed:", e, flush=True)
            open(os.path.join(out, f"gave_up{psnet.rank()}"), "w").close()
            raise SystemExit(3)
    """, env={"PSNET_COLL_TIMEOUT": "3", "PSNET_RECORDER_DIR": str(dumps),
              "PSNET_RECORDER_DUMP": "always"})
    results = ranks.wait(timeout=60)
    for r in (0, 1):
        rc, out = results[r]
        assert rc == 3, f"rank {r} exited {rc}:\n{out}"
        assert "PSNET_COLL_TIMEOUT" in out or "timed out" in out, out
    assert results[2][0] == 0, results[2][1]
    verdict = subprocess.run([doctor(), str(dumps)], capture_output=True, text=True, timeout=60)
    assert verdict.returncode == 0, verdict.stderr
    text = verdict.stdout
    assert "ranks 0-1 failed in allreduce #2" in text and "1,000 elements" in text, text
    assert "rank 2 never entered it: its last operation is allreduce #1" in text, text


def test_a_rank_taken_before_its_own_process_joined_fails_every_call(tmp_path):
    """A process joins as rank 2 before rank 2's own process does. The real rank 2 is refused
    (it does not hold the communicator's secret), and the job's next call fails on every
    member naming the claim, instead of going on with the squatter's data."""
    ranks = Ranks(tmp_path, 3, """
        import os, sys, time, numpy as np, psnet
        psnet.init()
        open(os.path.join(sys.argv[1], f"joined{psnet.rank()}"), "w").close()
        go = os.path.join(sys.argv[1], "go")
        for _ in range(600):
            if os.path.exists(go):
                break
            time.sleep(0.1)
        try:
            psnet.allreduce(np.ones(4, dtype=np.float32))
        except psnet.PsnetError as e:
            print("failed:", e, flush=True)
            raise SystemExit(3)
        print("the call went on", flush=True)
    """)
    try:
        joined = [ranks.out / f"joined{r}" for r in range(3)]
        for _ in range(600):
            if all(j.exists() for j in joined):
                break
            time.sleep(0.1)
        assert all(j.exists() for j in joined), "the first three processes did not join"
        real = ranks.start(2)
        out, _ = real.communicate(timeout=60)
        assert real.returncode != 0, out
        assert "without the job secret" in out, out
        (ranks.out / "go").touch()
        results = ranks.wait(timeout=60)
    finally:
        ranks.kill()
    for r, (rc, out) in enumerate(results):
        assert rc == 3, f"process {r} exited {rc}:\n{out}"
        assert "claimed rank 2" in out, out


def test_ctrl_c_in_a_waiting_call_raises_keyboard_interrupt(tmp_path):
    import signal

    ranks = Ranks(tmp_path, 2, """
        import sys, time, numpy as np, psnet
        psnet.init()
        if psnet.rank() == 1:
            time.sleep(60)
            sys.exit(0)
        print("waiting", flush=True)
        try:
            psnet.allreduce(np.zeros(4, dtype=np.float32))
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(5)
    """)
    rank0 = ranks.procs[0]
    seen = []
    for line in rank0.stdout:
        seen.append(line)
        if "waiting" in line:
            break
    assert seen and "waiting" in seen[-1], "".join(seen)
    # Well inside the call by then (it waits for rank 1, which sleeps).
    time.sleep(1.0)
    started = time.monotonic()
    rank0.send_signal(signal.SIGINT)
    out, _ = rank0.communicate(timeout=10)
    elapsed = time.monotonic() - started
    ranks.kill()
    assert rank0.returncode == 5, out
    assert "interrupted" in out
    assert elapsed < 5, f"KeyboardInterrupt took {elapsed:.1f} s"


EXCHANGE_JOB = """
import sys
import numpy as np
import psnet

out = sys.argv[1]
psnet.init()
r, n = psnet.rank(), psnet.size()
res = {}
for name in ("float32", "float64", "float16", "int32", "int64", "uint8"):
    dt = np.dtype(name)
    # Equal blocks of 3 rows x 2.
    x = (np.arange(n * 6).reshape(n * 3, 2) + 100 * r).astype(dt)
    res[f"a2a_{name}"] = psnet.alltoall(x)
    # Uneven rows, zero-length ones included: rank r sends rank j (r + j) % 3 rows.
    splits = [(r + j) % 3 for j in range(n)]
    recv_splits = [(i + r) % 3 for i in range(n)]
    y = np.concatenate([np.full(((r + j) % 3, 2), 10 * r + j, dtype=dt) for j in range(n)]) \
        if sum(splits) else np.empty((0, 2), dtype=dt)
    res[f"a2av_{name}"] = psnet.alltoall(y, send_splits=splits, recv_splits=recv_splits)
    g = psnet.gather(np.full(4, r + 1, dtype=dt), root=n - 1)
    if g is not None:
        res[f"gather_{name}"] = g
    block = np.empty(2, dtype=dt)
    src = np.arange(2 * n, dtype=dt) if r == 0 else None
    res[f"scatter_{name}"] = psnet.scatter(src, block, root=0)
# Point to point: every rank sends each other rank two messages with tag 5 and one with tag
# 6, started before any receive, received out of the order sent.
reqs = []
for j in range(n):
    if j != r:
        for k in range(2):
            reqs.append(psnet.isend(np.full(3 + k, 1000 * r + 10 * j + k, dtype=np.int64), j, tag=5))
        reqs.append(psnet.isend(np.full(1, -r, dtype=np.int64), j, tag=6))
for i in range(n):
    if i != r:
        six = psnet.recv(np.empty(1, dtype=np.int64), i, tag=6)
        first = psnet.irecv(np.empty(3, dtype=np.int64), i, tag=5)
        second = np.empty(4, dtype=np.int64)
        psnet.irecv(second, i, tag=5).wait()
        buf = np.empty(3, dtype=np.int64)
        res[f"p2p_{i}"] = np.concatenate([six, second])
for q in reqs:
    q.wait()
# Tag 8: every rank sends rank 0 its rank; rank 0 takes them from whichever comes first.
if r != 0:
    psnet.send(np.full(2, r, dtype=np.int32), 0, tag=8)
else:
    senders = []
    for _ in range(n - 1):
        got = np.empty(2, dtype=np.int32)
        src = psnet.recv_any(got, tag=8)
        assert (got == src).all(), (got, src)
        senders.append(src)
    assert sorted(senders) == list(range(1, n)), senders
np.savez(f"{out}/rank{r}.npz", **res)
"""


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_alltoall_gather_scatter_and_send_recv_match_numpy(tmp_path, n):
    run_ranks(tmp_path, n, EXCHANGE_JOB)
    for r in range(n):
        res = np.load(tmp_path / "out" / f"rank{r}.npz")
        for name in ("float32", "float64", "float16", "int32", "int64", "uint8"):
            dt = np.dtype(name)
            xs = [(np.arange(n * 6).reshape(n * 3, 2) + 100 * i).astype(dt) for i in range(n)]
            want = np.concatenate([x[3 * r:3 * r + 3] for x in xs])
            np.testing.assert_array_equal(res[f"a2a_{name}"], want)
            parts = [np.full(((i + r) % 3, 2), 10 * i + r, dtype=dt) for i in range(n)]
            want = np.concatenate(parts) if parts else np.empty((0, 2), dtype=dt)
            np.testing.assert_array_equal(res[f"a2av_{name}"], want.reshape(-1, 2))
            if r == n - 1:
                np.testing.assert_array_equal(
                    res[f"gather_{name}"], np.stack([np.full(4, i + 1, dtype=dt) for i in range(n)]))
            np.testing.assert_array_equal(res[f"scatter_{name}"], np.arange(2 * n, dtype=dt)[2 * r:2 * r + 2])
        for i in range(n):
            if i != r:
                np.testing.assert_array_equal(res[f"p2p_{i}"], [-i] + [1000 * i + 10 * r + 1] * 4)


def test_mismatched_splits_and_a_dead_sender_raise_naming_the_rank(tmp_path):
    ranks = Ranks(tmp_path, 3, """
        import os, numpy as np, psnet
        psnet.init()
        r = psnet.rank()
        # Rank 1 expects one row from rank 0; rank 0 sends two. Every other pair agrees.
        send_splits = [[1, 2, 1], [1, 1, 1], [1, 1, 1]][r]
        try:
            psnet.alltoall(np.zeros((sum(send_splits), 2), np.float32), send_splits=send_splits,
                           recv_splits=[1, 1, 1])
        except psnet.PsnetError as e:
            print("alltoall:", e, flush=True)
        if r == 2:
            os._exit(9)
        try:
            psnet.recv(np.zeros(3, np.float32), 2)
        except psnet.PeerLostError as e:
            print("recv:", e, flush=True)
            raise SystemExit(3)
    """, env={"PSNET_COLL_TIMEOUT": "60"})
    results = ranks.wait(timeout=120)
    assert results[2][0] == 9
    for r in (0, 1):
        rc, out = results[r]
        assert rc == 3, f"rank {r} exited {rc}:\n{out}"
        assert "recv:" in out and "rank 2" in out, out
    alltoall_line = [l for l in results[1][1].splitlines() if l.startswith("alltoall:")]
    assert alltoall_line and "rank 0" in alltoall_line[0], results[1][1]
    assert "split sizes differ" in alltoall_line[0], alltoall_line[0]

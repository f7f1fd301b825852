"""The Python layer's overhead: the same operation timed from Python and inside Rust, in one
job, in alternating rounds.

    python3 python/benchmarks/overhead.py [--rounds 5]

- kv: a 4 KB float32 ``pushpull`` (1 server, 1 worker under psnet-launch): through
  ``psnet.kvstore`` (MXNet's API), through the native binding alone, and the Rust API's loop
  (``Worker.bench_pushpull``).
- allreduce: 64 MB float32 sum on 2 ranks: ``psnet.allreduce`` against the Rust API's loop
  (``Comm.bench_allreduce``).

Prints a JSON line per round and measurement, then the table: mean time per operation and
the ratio Python / Rust. Needs psnet-launch (``$PSNET_LAUNCH``, on PATH, or target/).
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]


def kv_job(rounds, iterations):
    import psnet

    kv = psnet.kvstore.create("dist_sync")
    g = np.ones(1024, dtype=np.float32)
    o = np.empty_like(g)
    kv.init(0, g)
    native = kv._worker
    for _ in range(iterations // 10):  # warm-up
        kv.pushpull(0, g, out=o)
    for r in range(rounds):
        t = time.perf_counter()
        for _ in range(iterations):
            kv.pushpull(0, g, out=o)
        api = (time.perf_counter() - t) / iterations
        t = time.perf_counter()
        for _ in range(iterations):
            native.pushpull([0], [g], [o])
        binding = (time.perf_counter() - t) / iterations
        rust = native.bench_pushpull(0, g, o, iterations) / iterations
        print(json.dumps({"bench": "kv_pushpull_4KB", "round": r, "python_api_us": api * 1e6,
                          "binding_us": binding * 1e6, "rust_us": rust * 1e6}), flush=True)


def allreduce_job(rounds, iterations):
    import psnet

    psnet.init()
    buf = np.ones(16 << 20, dtype=np.float32)  # 64 MB
    comm = psnet.collectives.init()
    psnet.allreduce(buf)  # warm-up
    for r in range(rounds):
        psnet.barrier()
        t = time.perf_counter()
        for _ in range(iterations):
            psnet.allreduce(buf)
        py = (time.perf_counter() - t) / iterations
        psnet.barrier()
        rust = comm.bench_allreduce(buf, "sum", iterations) / iterations
        if psnet.rank() == 0:
            print(json.dumps({"bench": "allreduce_64MB", "round": r, "python_ms": py * 1e3,
                              "rust_ms": rust * 1e3}), flush=True)


def launcher():
    for c in (os.environ.get("PSNET_LAUNCH"), shutil.which("psnet-launch"),
              REPO / "target" / "release" / "psnet-launch", REPO / "target" / "debug" / "psnet-launch"):
        if c and Path(c).is_file():
            return str(c)
    sys.exit("psnet-launch not found: cargo build --release -p psnet-launch, or set PSNET_LAUNCH")


def lines(cmd, env):
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
    # psnet-launch prefixes each line with its process ("[worker 0] ").
    return [json.loads(l[l.index("{"):]) for l in out.splitlines() if '{"bench"' in l]


def main():
    p = argparse.ArgumentParser(description="psnet's Python overhead, Python against Rust")
    p.add_argument("part", nargs="?", choices=["kv", "allreduce"], help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kv-iterations", type=int, default=2000)
    p.add_argument("--allreduce-iterations", type=int, default=10)
    args, _ = p.parse_known_args()
    if args.part == "kv":
        return kv_job(args.rounds, args.kv_iterations)
    if args.part == "allreduce":
        return allreduce_job(args.rounds, args.allreduce_iterations)

    common = [f"--rounds={args.rounds}", f"--kv-iterations={args.kv_iterations}",
              f"--allreduce-iterations={args.allreduce_iterations}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    kv = lines([launcher(), "-n", "1", "-s", "1", "--", sys.executable, str(HERE), "kv"] + common,
               env)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        root = f"127.0.0.1:{s.getsockname()[1]}"
    ranks = [subprocess.Popen([sys.executable, str(HERE), "allreduce"] + common,
                              env=dict(env, PSNET_RANK=str(r), PSNET_WORLD_SIZE="2",
                                       PSNET_ROOT_ADDR=root),
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate()[0] for p in ranks]
    if any(p.returncode for p in ranks):
        sys.exit("an allreduce rank failed")
    ar = [json.loads(l) for l in outs[0].splitlines() if l.startswith("{")]
    for row in kv + ar:
        print(json.dumps(row))

    def mean(rows, k):
        return sum(r[k] for r in rows) / len(rows)

    api, binding, rust = (mean(kv, k) for k in ("python_api_us", "binding_us", "rust_us"))
    py_ms, rust_ms = mean(ar, "python_ms"), mean(ar, "rust_ms")
    print(f"{'operation':<34} {'Python':>12} {'Rust API':>12} {'ratio':>7}")
    print(f"{'kv pushpull 4 KB (psnet.kvstore)':<34} {api:>10.1f}us {rust:>10.1f}us {api / rust:>7.2f}")
    print(f"{'kv pushpull 4 KB (native binding)':<34} {binding:>10.1f}us {rust:>10.1f}us {binding / rust:>7.2f}")
    print(f"{'allreduce 64 MB, 2 ranks':<34} {py_ms:>10.2f}ms {rust_ms:>10.2f}ms {py_ms / rust_ms:>7.2f}")


if __name__ == "__main__":
    main()

"""What the benchmark scripts here share: a per-rank step script run under torchrun, once per
backend, psnet and gloo alternating, each run starting its own torchrun on this host."""

import os
import shutil
import subprocess
import sys
import time


def run(script, backend, ranks, args, port):
    """Runs ``script`` on ``ranks`` local ranks with ``backend``; returns rank 0's RESULT line.
    psnet's side uses sockets only (PSNET_SHM_RING=0), as gloo's TCP does."""
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PSNET_SHM_RING="0", OMP_NUM_THREADS="1")
    out = subprocess.run([torchrun, "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
                          "--master-port", str(port), script] + [str(a) for a in args[:1]]
                         + [backend] + [str(a) for a in args[1:]],
                         env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("RESULT"))
    print(line, flush=True)
    return line


def compare(step, name, ranks, rounds, args, port, value, verdict):
    """Writes ``step`` to a temporary script and runs it ``rounds`` times per backend, psnet
    then gloo; ``value`` reads the number from a RESULT line, ``verdict`` formats a round."""
    script = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"psnet-{name}-{os.getpid()}.py")
    with open(script, "w") as f:
        f.write(step)
    try:
        for r in range(rounds):
            got = {}
            for backend in ("psnet", "gloo"):
                port += 1
                got[backend] = value(run(script, backend, ranks, args, port))
                time.sleep(1)
            print(f"round {r}: {verdict(got['psnet'], got['gloo'])}", flush=True)
    finally:
        os.remove(script)


def write_step(step, path):
    """Writes the per-rank script for launchers of their own (scripts/bench-cluster.sh)."""
    with open(path, "w") as f:
        f.write(step)

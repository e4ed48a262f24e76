"""A new cluster's first job, with the zygote host and without, against torchrun, in one run.

Usage::

    sudo python benchmarks/bench_zygote_host.py [--rounds 5] [--out benchmarks/RESULTS_zygote_host.md]

Each round, for each side, starts from nothing and ends with nothing left:

* dask-ddp, ``ddp.zygote-host: true`` (the default): a ``LocalCluster(n_workers=2, threads_per_worker=1)`` is
  started, ``dispatch.run`` runs ``train`` (below: 20 SGD steps of ``DDP(Linear(32, 32))``, gloo) on both workers,
  the result comes back, the cluster closes. The rounds follow each other as a notebook's or a test suite's
  clusters do, so from the second round on the host (alive for ``ddp.zygote-host-idle`` s after the last zygote)
  forks the new workers' zygotes warm.
* dask-ddp, ``ddp.zygote-host: false``: the same, each worker importing torch in a zygote of its own.
* torchrun: ``torchrun --standalone --nproc-per-node 2`` of a script holding the same ``train``.

Each side's rounds run back to back, in two blocks (the sides' blocks in turn, so that the machine's drift
hits each alike); a block's first round starts with no host. Reported: the wall time of a round (median of the
rounds after each block's first, and the first round of the first block apart: a cold host), and the CPU seconds of
everything the round started (the cpuacct cgroup of this benchmark: every process it started, detached or not,
needs root; without it only wall times). Each side's rounds get an environment variable of their own, so the
sides never share a host.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup/cpuacct")

TRAIN = '''
def train(steps=20):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
    return dist.get_rank()
'''

ROUND = '''
import sys, dask
dask.config.set({"ddp.zygote-host": sys.argv[1] == "on"})
from dask.distributed import Client, LocalCluster
from dask_ddp import dispatch
%s
if __name__ == "__main__":
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      host="127.0.0.1") as cluster, Client(cluster) as client:
        assert dispatch.run(client, train, progress=False).result(timeout=300) == [0, 1]
''' % TRAIN

TORCHRUN = '''
import torch.distributed as dist
%s
if __name__ == "__main__":
    dist.init_process_group("gloo")
    train()
    dist.destroy_process_group()
''' % TRAIN


class CpuMeter:
    """CPU seconds of every process started inside (a cpuacct cgroup of its own); None where there is none."""

    def __init__(self):
        self.path = CGROUP / f"bench-zygote-host-{uuid.uuid4().hex[:8]}"
        try:
            self.path.mkdir()
        except OSError:
            self.path = None

    def run(self, cmd: list[str], env: dict) -> tuple[float, float | None]:
        before = self.used()
        started = time.perf_counter()
        prefix = [] if self.path is None else ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "-"]
        subprocess.run(prefix + cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=600)
        wall = time.perf_counter() - started
        return wall, (None if before is None else self.used() - before)

    def used(self) -> float | None:
        return None if self.path is None else int((self.path / "cpuacct.usage").read_text()) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/RESULTS_zygote_host.md")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    (tmp / "round.py").write_text(ROUND)
    (tmp / "torchrun_script.py").write_text(TORCHRUN)
    sides = {"dask-ddp, zygote host on": [sys.executable, str(tmp / "round.py"), "on"],
             "dask-ddp, zygote host off": [sys.executable, str(tmp / "round.py"), "off"],
             "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(tmp / "torchrun_script.py")]}
    meter = CpuMeter()
    results: dict[str, list[tuple[float, float | None]]] = {side: [] for side in sides}
    envs = {side: dict(os.environ, BENCH_SIDE=uuid.uuid4().hex, OMP_NUM_THREADS="1") for side in sides}
    for _ in range(2):  # each side's rounds back to back (as a notebook's clusters), the blocks twice over
        for side, cmd in sides.items():
            for _ in range(args.rounds // 2 + args.rounds % 2 if not results[side] else args.rounds // 2):
                results[side].append(meter.run(cmd, envs[side]))
                print(side, "%.2f s" % results[side][-1][0], results[side][-1][1], flush=True)
            time.sleep(7)  # the host's idle exit (5 s), before the next side: the next block starts cold
    firsts = {0, args.rounds // 2 + args.rounds % 2}
    later_of = {side: [r for i, r in enumerate(got) if i not in firsts] for side, got in results.items()}
    torch_ref = statistics.median(w for w, _ in later_of["torchrun"])
    lines = [f"# A new cluster's first job: zygote host on/off against torchrun ({args.rounds} rounds)", "",
             f"Command: `python benchmarks/bench_zygote_host.py --rounds {args.rounds}`; 2 ranks, gloo, CPU; "
             f"{os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}.", "",
             "| side | first round (s) | later rounds, median (s) | vs torchrun | CPU-s a round, later median |",
             "|---|---:|---:|---:|---:|"]
    for side, got in results.items():
        later = [w for w, _ in later_of[side]]
        cpu = [c for _, c in later_of[side] if c is not None]
        cpu_text = f"{statistics.median(cpu):.1f}" if cpu else "n/a"
        lines.append(f"| {side} | {got[0][0]:.2f} | {statistics.median(later):.2f} | "
                     f"{statistics.median(later) / torch_ref:.2f}x | {cpu_text} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    if meter.path is not None:
        for pid in (meter.path / "cgroup.procs").read_text().split():
            print("left in the cgroup:", pid)


if __name__ == "__main__":
    main()

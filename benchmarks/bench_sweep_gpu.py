"""Sweep turnover on a GPU: 200 consecutive early stops of trials that each hold 30 % of the GPU's memory.

Usage (on a GPU machine)::

    python benchmarks/bench_sweep_gpu.py [--trials 200] [--workers 3] [--frac 0.3] [--out RESULTS_sweep_gpu.md]

A LocalCluster of ``--workers`` worker processes on one GPU (every 1-rank trial takes ``cuda:0``), zygotes
warmed; ``dask_ddp.sweep`` of ``--trials`` trials, at most ``--workers`` at once, each a 1-rank nccl job that
allocates and fills ``--frac`` of the GPU's memory, then steps (a 1024x1024 matmul, a report, 10 ms) until the
pruner stops it: Optuna's ``ThresholdPruner(upper=0)`` prunes every trial at step 3, so all are early stops at
an agreed step. With 3 x 30 % in use at once, memory a stopped trial left behind makes a later trial's
allocation fail (CUDA OOM: recorded FAILED with its traceback). Counted: OOMs, and each trial's free GPU memory
at its start (``torch.cuda.mem_get_info``; the lowest shows whether anything was left behind). NVML (nvidia-ml-py)
is read every 10 ms on the client: peak memory used, the number of compute processes, and the time from the
sweep's end to memory back at its level before the sweep. From the sweep's record: the pruner's decision
(``stopped``) to the job's end (every rank's process exited) and to the next trial's first report on that
worker, median and p95.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import dask
import optuna
import torch
from bench_sweep import _p95, after_stops  # the same p95 and the same next trial on a stopped trial's workers
from dask.distributed import Client, LocalCluster

import dask_ddp

optuna.logging.set_verbosity(optuna.logging.WARNING)


def gpu_trial(lr, frac, log_dir, steps=200, step_time=0.01, ddp=False):
    entered = time.time()  # the function's start: the next trial's turnover ends here, CUDA's start begins
    ctx = dask_ddp.get_context()
    dev = torch.device(ctx.device)
    free0, total = mem_info(dev)
    with open(f"{log_dir}/{os.getpid()}", "a") as f:
        f.write(f"{free0} {total} {ctx.run_id} {entered}\n")
    block = torch.empty(int(total * frac), dtype=torch.uint8, device=dev)  # OOM here if memory was left behind
    block.fill_(1)
    x = torch.randn(1024, 1024, device=dev)
    if ddp:  # a DDP model, as a trial written for dispatch.run has: its construction makes the nccl communicator
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1024, 1024, device=dev))
        x = model(x).detach()
    for step in range(steps):
        x = torch.tanh(x @ x)
        dask_ddp.report(loss=lr + 1.0 / (step + 1) + float(x[0, 0]) * 0, step=step)
        time.sleep(step_time)


def mem_info(dev):
    """(free, total) bytes of ``dev``: CUDA's, or the host's with ``--device cpu`` (a check of the script)."""
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


class NvmlPoller(threading.Thread):
    """Used memory and compute processes of GPU 0 every 10 ms (the host's memory with ``--device cpu``)."""

    def __init__(self, device: str):
        super().__init__(daemon=True)
        self.nvml = None
        if device == "cuda":
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        self.samples: list[tuple[float, int, int]] = []
        self.stop = threading.Event()

    def read(self) -> tuple[float, int, int]:
        if self.nvml is None:
            import psutil

            return time.time(), psutil.virtual_memory().used, -1
        used = self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used
        try:
            procs = len(self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle))
        except self.nvml.NVMLError:
            procs = -1
        return time.time(), used, procs

    def run(self):
        while not self.stop.is_set():
            self.samples.append(self.read())
            time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--frac", type=float, default=0.3)
    ap.add_argument("--device", default="cuda", help="cpu: a check of the script without a GPU")
    ap.add_argument("--out", default="")
    ap.add_argument("--ddp", action="store_true", help="each trial wraps a model in DDP (its nccl communicator)")
    ap.add_argument("--cold", action="store_true", help="ddp.sweep.warm-cuda: false (CUDA starts in the job)")
    a = ap.parse_args()
    dask.config.set({"ddp.sweep.warm-cuda": not a.cold})
    poller = NvmlPoller(a.device)
    base = poller.read()[1]
    log_dir = tempfile.mkdtemp(prefix="sweep-gpu-")
    with LocalCluster(n_workers=a.workers, processes=True, threads_per_worker=1, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        dask_ddp.dispatch.warm_up(client)
        poller.start()
        t = time.perf_counter()
        s = dask_ddp.sweep(client, gpu_trial, {"lr": {"low": 0.0, "high": 1.0}}, n_trials=a.trials, metric="loss",
                           scheduler=optuna.pruners.ThresholdPruner(upper=0.0, n_warmup_steps=3), sampler="random",
                           kwargs={"frac": a.frac, "log_dir": log_dir, "ddp": a.ddp}, max_failures=None, seed=0,
                           progress=False,
                           run_options={"backend": "nccl" if a.device == "cuda" else "gloo"})
        assert s.wait(1800), s
        wall, ended = time.perf_counter() - t, time.time()
        df = s.results()
        while a.device == "cuda" and time.time() - ended < 30 and poller.read()[1] > base + (256 << 20):
            time.sleep(0.01)
        back = time.time() - ended
        poller.stop.set()
    states = df["state"].value_counts().to_dict()
    ooms = df[df["state"] == "FAILED"]["error"].fillna("").str.contains("out of memory|OutOfMemory").sum()
    lines = [line.split() for p in Path(log_dir).iterdir() for line in p.read_text().split("\n") if line]
    frees = [int(f[0]) for f in lines]
    entered = {f[2]: float(f[3]) for f in lines}
    to_fn, fn_to_report = [], []
    total = int(next(p for p in Path(log_dir).iterdir()).read_text().split()[1])
    gone, next_first = [], []
    for row, nxt in after_stops(df):
        gone.append((row.ended - row.stopped).total_seconds())
        if nxt is not None and nxt["first_report"] is not None and str(nxt["first_report"]) != "NaT":
            next_first.append((nxt["first_report"] - row.stopped).total_seconds())
            if nxt["run_id"] in entered:
                at = entered[nxt["run_id"]]
                to_fn.append(at - row.stopped.timestamp())
                fn_to_report.append(nxt["first_report"].timestamp() - at)
    peak = max(u for _, u, _ in poller.samples)
    procs = max(p for _, _, p in poller.samples)
    gib = 1 << 30
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu (a check of the script)"
    lines = [
        "# Sweep turnover on a GPU: consecutive early stops, GPU memory by NVML", "",
        f"`python benchmarks/bench_sweep_gpu.py --trials {a.trials} --workers {a.workers} --frac {a.frac}"
        f"{' --ddp' if a.ddp else ''}{' --cold' if a.cold else ''}` on "
        f"{name} ({total / gib:.0f} GiB), torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}."
        f" {a.trials} one-rank trials on {a.workers} workers sharing the GPU, each holding {a.frac:.0%} of its memory,"
        " every one pruned at step 3."
        f" CUDA started ahead in the next rank (ddp.sweep.warm-cuda): {'no' if a.cold else 'yes'};"
        f" trial wraps a model in DDP: {'yes' if a.ddp else 'no'}.", "",
        "| | |", "|---|---:|",
        f"| trials: states | {', '.join(f'{k} {v}' for k, v in sorted(states.items()))} |",
        f"| CUDA OOMs | **{ooms}** |",
        f"| wall, s (per trial on {a.workers} slots) | {wall:.1f} ({wall * a.workers / a.trials:.2f}) |",
        f"| free GPU memory at a trial's start: lowest / median, GiB (of {total / gib:.0f}) | "
        f"{min(frees) / gib:.1f} / {statistics.median(frees) / gib:.1f} |",
        f"| NVML: memory used before the sweep / peak during it, GiB | {base / gib:.1f} / {peak / gib:.1f} |",
        f"| NVML: most compute processes at once | {procs} |",
        f"| NVML: sweep's end to memory back at its level before, s | {back:.2f} |",
        f"| pruner's decision -> every rank's process exited, median / p95 s | "
        f"{statistics.median(gone):.3f} / {_p95(gone):.3f} |" if gone else "| decision -> exited | none pruned |",
        f"| pruner's decision -> next trial's first report on that worker, median / p95 s | "
        f"{statistics.median(next_first):.3f} / {_p95(next_first):.3f} |" if next_first else
        "| decision -> next first report | none |",
        f"| of which decision -> the next trial's function starts, median / p95 s | "
        f"{statistics.median(to_fn):.3f} / {_p95(to_fn):.3f} |" if to_fn else "| decision -> function | none |",
        f"| of which the function's start -> its first report (CUDA's start, allocation, 1 step), median / p95 s | "
        f"{statistics.median(fn_to_report):.3f} / {_p95(fn_to_report):.3f} |" if fn_to_report else "| - | - |",
    ]
    failed = df[df["state"] == "FAILED"]
    if len(failed):
        lines += ["", "First failure:", "```", str(failed.iloc[0]["error"])[-1500:], "```"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Dispatch latency at 2, 4, 8 and 16 ranks on one machine, cold and warm, side by side with torchrun.

Usage::

    python benchmarks/bench_scale.py [--sizes 2,4,8,16] [--repeats 3] [--out benchmarks/RESULTS_scale.md]

For each size N, in one run:

* **cold**: a fresh ``LocalCluster(n_workers=N, threads_per_worker=1)``; the
  time from ``run()`` to ``result()`` of the first job, which finds no warm
  zygote yet (each worker's zygote starts when the plugin is registered by
  that job, and imports torch while the job waits). What a user sees the first
  time.
* **warm**: the same cluster after :func:`bench_dispatch.wait_warm`; median of
  ``--repeats`` jobs. **back-to-back**: ``--repeats`` jobs with no pause.
* **torchrun**: ``torchrun --standalone --nproc-per-node N`` running the
  same function (``bench_dispatch.train_linear``: 20 DDP steps of
  ``Linear(32, 32)``), the whole subprocess's wall time; median of ``--repeats``.
* time to the first step: when the last rank entered the training function,
  from ``run()`` (or from torchrun's start).
* memory per warm zygote: resident set (RSS) and unique set (USS: what it
  does not share with other processes) of each worker's zygote, mean.

Every process gets ``torch.set_num_threads(1)``; gloo; CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
import bench_dispatch as bd  # noqa: E402


def torchrun(n: int, script: str, steps: int) -> dict:
    t0 = time.time()
    proc = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node",
                           str(n), script, "train_linear", json.dumps({"steps": steps})], capture_output=True,
                          text=True, env=bd.BASE_ENV, timeout=600)
    t1 = time.time()
    if proc.returncode:
        raise RuntimeError(f"torchrun --nproc-per-node {n} failed:\n{proc.stderr[-3000:]}")
    values = [json.loads(m) for m in re.findall(r"RESULT (\{[^}]*\})", proc.stdout)]
    assert sorted(v["rank"] for v in values) == list(range(n)), proc.stdout[-2000:]
    return {"wall": t1 - t0, "fn_started": max(v["start"] for v in values) - t0}


def zygote_memory(client) -> tuple[float, float]:
    """Mean RSS and USS (MiB) of the workers' zygotes (children of the worker processes running dask_ddp.rank.zygote)."""
    rss, uss = [], []
    for pid in client.run(os.getpid).values():
        for kid in psutil.Process(pid).children():
            if "dask_ddp.rank.zygote" in " ".join(kid.cmdline()):
                info = kid.memory_full_info()
                rss.append(info.rss / 2**20)
                uss.append(info.uss / 2**20)
    return statistics.mean(rss), statistics.mean(uss)


def one_size(n: int, repeats: int, steps: int, script: str) -> dict:
    from dask.distributed import Client, LocalCluster

    out = {"n": n}
    with LocalCluster(n_workers=n, threads_per_worker=1, dashboard_address=None, host="127.0.0.1") as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(n)
        cold = bd.dask_job(client, bd.train_linear, steps=steps)
        out["cold"], out["cold_first_step"] = cold["wall"], cold["fn_started"]
        bd.wait_warm(client, minimum=1.0, limit=600)
        warm = []
        for _ in range(repeats):
            warm.append(bd.dask_job(client, bd.train_linear, steps=steps))
            bd.wait_warm(client, minimum=0.5, limit=600)
        out["warm"] = statistics.median(w["wall"] for w in warm)
        out["warm_first_step"] = statistics.median(w["fn_started"] for w in warm)
        b2b = [bd.dask_job(client, bd.train_linear, steps=steps) for _ in range(repeats)]
        out["b2b"] = statistics.median(w["wall"] for w in b2b)
        bd.wait_warm(client, minimum=0.5, limit=600)
        out["rss"], out["uss"] = zygote_memory(client)
    runs = [torchrun(n, script, steps) for _ in range(repeats)]
    out["torchrun"] = statistics.median(r["wall"] for r in runs)
    out["torchrun_first_step"] = statistics.median(r["fn_started"] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,4,8,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=str(Path(__file__).with_name("RESULTS_scale.md")))
    args = ap.parse_args()
    logging.getLogger("dask_ddp").setLevel(logging.WARNING)
    load0 = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        script = bd.write_script(tmp)
        for n in (int(s) for s in args.sizes.split(",")):
            rows.append(one_size(n, args.repeats, args.steps, script))
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    lines = ["# Dispatch latency by world size, one machine", "",
             f"`python benchmarks/bench_scale.py --sizes {args.sizes} --repeats {args.repeats}` on "
             f"{platform.node()} ({os.cpu_count()} cores), {time.strftime('%Y-%m-%d')}, load average "
             f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end. gloo, CPU, 20 DDP steps of "
             "Linear(32, 32); medians. Seconds from `run()` to the results (torchrun: the subprocess's wall time); "
             "first step: when the last rank entered the function.", "",
             "| ranks | dask-ddp cold | warm | back-to-back | torchrun | warm / torchrun | b2b / torchrun "
             "| first step: warm / torchrun | warm vs 2 ranks | zygote RSS / USS MiB |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['cold']:.2f} | {r['warm']:.2f} | {r['b2b']:.2f} | {r['torchrun']:.2f} | "
                     f"{r['warm'] / r['torchrun']:.3f}x | {r['b2b'] / r['torchrun']:.3f}x | "
                     f"{r['warm_first_step']:.2f} / {r['torchrun_first_step']:.2f} | {r['warm'] / base['warm']:.2f}x | "
                     f"{r['rss']:.0f} / {r['uss']:.0f} |")
    lines += ["", "Cold: the first job on a fresh cluster; its workers' zygotes import torch while it waits "
              "(on N workers at once, sharing the machine's cores)."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

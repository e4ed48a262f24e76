"""Sweep overhead: 200 trivial trials (1 rank, a 0.1 s function) on 2 workers, beside Optuna alone and Ray Tune;
then slot occupancy and stop turnover over 40 mixed 1- and 2-rank DDP trials with ASHA on 4 workers.

Usage::

    python benchmarks/bench_sweep.py [--trials 200] [--work 0.1] [--mixed 40] [--out benchmarks/RESULTS_sweep.md]
                                     [--ray-python /work/bench-venv-ray/bin/python] [--ray both|reuse|none]

Ray Tune runs in a subprocess with ``--ray-python``, the interpreter of a virtual environment that has
``ray[tune]`` (``benchmarks/bench_sweep_ray.py`` says how to make it; Ray is no dependency of dask-ddp), twice:
with Tune's defaults (a new trial actor per trial) and with ``reuse_actors=True`` (``--ray reuse``: only the
latter, which takes about a minute where Tune's defaults take about 16; ``--ray none``: neither); skipped when
that interpreter is missing. Whatever follows the line ``<!-- kept -->`` in ``--out`` (the profile of a job's
start and end, measured by hand) is kept when the file is written again.

Ours: ``dask_ddp.sweep`` on a LocalCluster of 2 worker processes (zygotes warmed first, as
``dispatch.warm_up`` does), random sampler, no pruning; each trial is a DDP job of 1 rank that sleeps
``--work`` s and reports its value once. Optuna alone: ``study.optimize(objective, n_jobs=2)`` in this
process, the same objective without dask-ddp (a thread sleeps ``--work`` s). Per trial overhead is
``(wall - ideal) / trials * workers`` with ``ideal = trials * work / workers``: the seconds a slot spends on
other things than the function, per trial. From the sweep's record also: the turnover on a worker (one
trial's end to the next trial's start there; median and p95), and slot occupancy (time the slots spend
inside a trial's job, start to end, over 2 x wall).

Mixed (``--mixed``, 0 skips it): a LocalCluster of 4 workers, trials of 1 or 2 ranks (a parameter), each
20 steps of a gloo all-reduce and 0.05 s, ASHA (``SuccessiveHalvingPruner(min_resource=2,
reduction_factor=2)``). Slot occupancy is busy worker-seconds (ranks x a trial's job, start to end) over
4 x the makespan (first start to last end). For each pruned trial: the pruner's decision to every rank
stopped (its job's end: the job ends only once every rank's process has exited), and the decision to the
first report of the next trial on one of its workers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import optuna
from dask.distributed import Client, LocalCluster

import dask_ddp

optuna.logging.set_verbosity(optuna.logging.WARNING)
WORKERS = 2
KEPT = "<!-- kept -->"  # what follows this line in --out is written by hand, and kept


def trivial(x, work):
    began = time.time()
    time.sleep(work)
    dask_ddp.report(value=x * x, step=0, began=began, at=time.time())
    return x


def ddp_trial(lr, ranks, steps=20, step_time=0.05):
    import torch
    import torch.distributed as dist

    for step in range(steps):
        t = torch.tensor([(lr - 0.3) ** 2 + 1.0 / (step + 1)])
        dist.all_reduce(t)
        dask_ddp.report(loss=t.item() / ranks, step=step)
        time.sleep(step_time)


def mixed(trials: int) -> dict:
    with LocalCluster(n_workers=4, processes=True, threads_per_worker=1, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        dask_ddp.dispatch.warm_up(client)
        pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=2, reduction_factor=2)
        s = dask_ddp.sweep(client, ddp_trial, {"lr": {"low": 0.0, "high": 1.0}, "ranks": [1, 2]},
                           n_trials=trials, metric="loss", ranks_per_trial="ranks", scheduler=pruner, seed=0)
        assert s.wait(1800), s
        df = s.results()
    assert df["state"].isin(["COMPLETE", "PRUNED"]).all(), df["state"].value_counts()
    span = (df["ended"].max() - df["started"].min()).total_seconds()
    busy = ((df["ended"] - df["started"]).dt.total_seconds() * df["ranks"]).sum()
    gone, next_first = [], []
    for row, nxt in after_stops(df):
        gone.append((row.ended - row.stopped).total_seconds())
        if nxt is not None:
            next_first.append((nxt["first_report"] - row.stopped).total_seconds())
    return {"occupancy": busy / (4 * span), "span": span, "pruned": len(gone), "complete": int(
        (df["state"] == "COMPLETE").sum()), "gone": gone, "next_first": next_first}


def after_stops(df):
    """For each PRUNED trial of a sweep's ``results()``: ``(its row, the first trial started on one of its workers
    after it ended)``, the second None when none was (also used by bench_sweep_gpu.py)."""
    for row in df[df["state"] == "PRUNED"].itertuples():
        mine = set(row.workers.split(","))
        later = df[(df["started"] >= row.ended) & df["workers"].map(lambda w: bool(mine & set(w.split(","))))]
        yield row, (later.sort_values("started").iloc[0] if len(later) else None)


def job_phases(client, work: float, n: int = 10) -> dict:
    """Where a lone 1-rank job's time goes, back to back (medians): ``run()`` to the function's start, and
    the function's end to the job's end (its outcome and last events in)."""
    start, end = [], []
    for _ in range(n):
        t = time.time()
        job = dask_ddp.dispatch.run(client, trivial, 1.0, work, progress=False, workers=1)
        job.wait(progress=False)
        done, row = time.time(), job.metrics.iloc[0]
        start.append(row["began"] - t)
        end.append(done - row["at"])
    return {"to_start": statistics.median(start), "to_end": statistics.median(end)}


def ours(trials: int, work: float) -> dict:
    with LocalCluster(n_workers=WORKERS, processes=True, threads_per_worker=1, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        dask_ddp.dispatch.warm_up(client)
        dask_ddp.dispatch.run(client, trivial, 1.0, 0.0, progress=False).result()  # the first job's one-off costs
        t = time.perf_counter()
        s = dask_ddp.sweep(client, trivial, {"x": {"low": -1.0, "high": 1.0}}, n_trials=trials, metric="value",
                           sampler="random", scheduler="none", kwargs={"work": work}, seed=0)
        assert s.wait(1800), s
        wall = time.perf_counter() - t
        df = s.results()
        phases = job_phases(client, work)
    assert (df["state"] == "COMPLETE").all(), df["state"].value_counts()
    gaps = []
    for _, rows in df.sort_values("started").groupby("workers"):
        starts, ends = rows["started"].tolist(), rows["ended"].tolist()
        gaps += [(b - a).total_seconds() for a, b in zip(ends, starts[1:])]
    held = (df["ended"] - df["started"]).dt.total_seconds()
    return {"wall": wall, "gap_median": statistics.median(gaps), "gap_p95": _p95(gaps),
            "occupancy": held.sum() / (WORKERS * wall), "job_median": held.median(), **phases}


def optuna_alone(trials: int, work: float) -> dict:
    def objective(trial):
        x = trial.suggest_float("x", -1.0, 1.0)
        time.sleep(work)
        return x * x

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    t = time.perf_counter()
    study.optimize(objective, n_trials=trials, n_jobs=WORKERS)
    return {"wall": time.perf_counter() - t}


def ray_tune(python: str, trials: int, work: float, reuse: bool) -> dict | None:
    """Ray Tune's wall time for the same trials (``bench_sweep_ray.py`` under ``python``); None without it."""
    if not os.path.exists(python):
        return None
    script = Path(__file__).with_name("bench_sweep_ray.py")
    cmd = [python, str(script), "--trials", str(trials), "--work", str(work), "--slots", str(WORKERS)]
    out = subprocess.run(cmd + (["--reuse-actors"] if reuse else []), capture_output=True, text=True, timeout=3600,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("{")), None)
    if out.returncode or line is None:
        print(f"Ray Tune failed ({out.returncode}):\n{out.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(line)


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--work", type=float, default=0.1)
    parser.add_argument("--mixed", type=int, default=40)
    parser.add_argument("--out", default="benchmarks/RESULTS_sweep.md")
    parser.add_argument("--ray-python", default="/work/bench-venv-ray/bin/python")
    parser.add_argument("--ray", choices=("both", "reuse", "none"), default="both",
                        help="which Ray Tune runs: Tune's defaults and reuse_actors=True, only the latter, or none")
    args = parser.parse_args()
    ideal = args.trials * args.work / WORKERS
    load = os.getloadavg()
    alone = optuna_alone(args.trials, args.work)
    mine = ours(args.trials, args.work)
    modes = {"both": (False, True), "reuse": (True,), "none": ()}[args.ray]
    rays = {reuse: ray_tune(args.ray_python, args.trials, args.work, reuse) for reuse in modes}
    mix = mixed(args.mixed) if args.mixed else None

    def per_trial(wall: float) -> float:
        return (wall - ideal) / args.trials * WORKERS

    lines = [
        "# Sweep overhead", "",
        f"`python benchmarks/bench_sweep.py --trials {args.trials} --work {args.work}` on {platform.node()} "
        f"({platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} cores), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average before the run "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}. {args.trials} trials of a {args.work} s function on "
        f"{WORKERS} slots (ideal wall {ideal:.1f} s), the three one after another in this run. Goal (issue 29): "
        "overhead per trial <= 0.2 s and <= 0.5x Ray Tune's.", "",
        "| | wall s | overhead per trial s | turnover on a worker, median / p95 s | slots inside a trial's job |",
        "|---|---:|---:|---:|---:|",
        f"| dask_ddp.sweep (1-rank DDP job a trial) | {mine['wall']:.1f} | {per_trial(mine['wall']):.3f} | "
        f"{mine['gap_median']:.3f} / {mine['gap_p95']:.3f} | {mine['occupancy']:.0%} |",
        f"| Optuna alone, in-process, n_jobs=2 | {alone['wall']:.1f} | {per_trial(alone['wall']):.3f} | | |",
        *(f"| Ray Tune {r['ray']} local, {'reuse_actors=True' if reuse else 'defaults'} | {r['wall']:.1f} | "
          f"{per_trial(r['wall']):.3f} | | |" for reuse, r in rays.items() if r),
        "", "Ours over Ray Tune's overhead per trial: " + (", ".join(
            f"{per_trial(mine['wall']) / per_trial(r['wall']):.2f}x ({'reuse_actors' if reuse else 'defaults'})"
            for reuse, r in rays.items() if r) or "Ray Tune not run (no --ray-python interpreter)") + ".",
        "", f"A trial's job, start to end (median): {mine['job_median']:.3f} s for {args.work} s of work. The "
        "sweep's own bookkeeping between trials is the turnover column; the rest of the overhead is the job's "
        f"start and end: a lone 1-rank job run back to back takes {mine['to_start']:.3f} s from run() to the "
        f"function's start and {mine['to_end']:.3f} s from the function's end to the job's end (medians of 10).",
    ]
    if mix:
        lines += [
            "", f"## {args.mixed} mixed 1- and 2-rank DDP trials, ASHA, 4 workers", "",
            f"{mix['complete']} complete, {mix['pruned']} pruned; makespan {mix['span']:.1f} s. Goals (issue 29): "
            "occupancy >= 95 %; stop to processes gone <= 2 s and stop to the next trial's first step <= 0.5 s "
            "(p95).", "",
            "| slot occupancy | pruner's decision -> every rank stopped, median / p95 s | decision -> next trial's "
            "first report on its workers, median / p95 s |", "|---:|---:|---:|",
            f"| {mix['occupancy']:.0%} | {statistics.median(mix['gone']):.3f} / {_p95(mix['gone']):.3f} | "
            f"{statistics.median(mix['next_first']):.3f} / {_p95(mix['next_first']):.3f} |",
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    kept = out.read_text().partition(KEPT)[2] if out.exists() else ""
    out.write_text(text + (f"\n{KEPT}{kept}" if kept else ""))


if __name__ == "__main__":
    main()

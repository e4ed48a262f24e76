"""Dispatch latency and per-step overhead of ``dask_ddp.dispatch.run`` against ``torchrun``, in one run.

Usage::

    python benchmarks/bench_dispatch.py [--repeats 5] [--refill-wait 6] [--out benchmarks/RESULTS_dispatch.md]

Both sides run literally the same training functions (``train_linear`` and
``train_cnn`` below): dask-ddp ships them by value; for torchrun their source
is copied (``inspect.getsource``) into a script in a temporary folder that
calls ``init_process_group("gloo")`` itself. Two ranks, gloo, CPU, and
``torch.set_num_threads(1)`` on every rank on both sides.

1. Dispatch latency: 20 SGD steps of ``DDP(Linear(32, 32))``.

   * dask-ddp: a ``LocalCluster(n_workers=2, threads_per_worker=1)``, warmed by
     one job; time from ``run()`` to ``result()`` returning. "Warm": before
     each job the benchmark sleeps ``--refill-wait`` seconds (default 6) and
     then also waits until each worker's spare rank process (started in the
     background by the previous job) reports that it has imported torch.
   * dask-ddp back-to-back: the same jobs with no pause in between; the spare
     of the previous job is then still starting, so the rank process is not warm.
   * torchrun: ``torchrun --standalone --nproc-per-node 2 script.py``, the
     whole subprocess's wall time (what a user waits for).

2. Per-step overhead: 300 steps of a small CNN (two 3x3 convolutions on
   random 1x28x28 batches of 32, fixed seeds), timed inside rank 0 with
   ``time.perf_counter`` around the loop only. Each repeat runs, in a rotating
   order, three variants:

   * dask-ddp default: the job takes the warm spare and the worker at once
     starts the next spare (a Python importing torch) while the loop runs;
   * dask-ddp steady state: ``ddp.warm-spare`` is switched off on the workers
     for that job, so no spare starts during the loop (the job still starts
     from the warm spare); the spare is refilled afterwards;
   * torchrun.

   Before every variant the benchmark waits until the spares are ready, so
   that no spare's start competes with the measured loop except in "default".

The final losses of both sides are compared: the same seeds must give the
same numbers, a check that both sides really ran the same computation.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

# ---- the training code, run identically by both launchers (imports inside: shipped by value / copied) --------


def train_linear(steps=20, seed=0):
    """The dispatch-latency job: DDP(Linear(32, 32)), ``steps`` SGD steps. The process group is initialised."""
    import time

    started = time.time()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(seed)
    t_ddp = time.time()
    model = DDP(torch.nn.Linear(32, 32))  # the first DDP() of a process imports torch._dynamo (seconds)
    t_ddp = time.time() - t_ddp
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(seed + 1000 + rank)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {"rank": rank, "start": started, "end": time.time(), "loss": loss.item(), "ddp_init_s": t_ddp}


def train_cnn(steps=300, seed=0, batch=32):
    """The per-step job: a 2-conv CNN on random 1x28x28 batches; only the loop is timed (perf_counter)."""
    import time

    started = time.time()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(16 * 7 * 7, 10))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(seed + 1000 + rank)
    step_times = []
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        s = time.perf_counter()
        x = torch.randn(batch, 1, 28, 28, generator=gen)
        y = torch.randint(0, 10, (batch,), generator=gen)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step_times.append(time.perf_counter() - s)
    loop, cpu = time.perf_counter() - t0, time.process_time() - c0
    step_times.sort()
    return {"rank": rank, "start": started, "end": time.time(), "loss": loss.item(), "loop_s": loop,
            "loop_cpu_s": cpu, "step_median_s": step_times[len(step_times) // 2]}


TORCHRUN_MAIN = '''
if __name__ == "__main__":
    import json
    import sys

    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = {"train_linear": train_linear, "train_cnn": train_cnn}[sys.argv[1]](**json.loads(sys.argv[2]))
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
'''


def write_script(folder: str) -> str:
    path = os.path.join(folder, "ddp_train.py")
    src = "\n\n".join(textwrap.dedent(inspect.getsource(f)) for f in (train_linear, train_cnn))
    with open(path, "w") as fh:
        fh.write('"""Written by benchmarks/bench_dispatch.py: the same functions dask-ddp runs."""\n\n' + src
                 + "\n" + TORCHRUN_MAIN)
    return path


# ---- helpers run on the Dask workers (client.run) -------------------------------------------------------------

def _spare_state() -> str:
    """'ready' when this worker's spare rank process has imported torch and waits for a job."""
    from dask_ddp.supervisor import _SPARES

    spare = _SPARES._spare
    if spare is None:
        return "filling" if _SPARES._filling else "none"
    return "ready" if spare.conn.poll(0) else "starting"  # poll() peeks at the "ready" message, reads nothing


def _set_warm_spare(on: bool) -> None:
    import dask

    dask.config.set({"ddp.warm-spare": on})


def _refill() -> None:
    from dask_ddp.supervisor import _SPARES

    _SPARES.refill()


def wait_warm(client, minimum: float = 0.0, limit: float = 90.0) -> float:
    """Sleep ``minimum`` seconds, then until every worker's spare is ready; return the seconds waited."""
    t0 = time.monotonic()
    time.sleep(minimum)
    while True:
        states = client.run(_spare_state)
        if all(s == "ready" for s in states.values()):
            return time.monotonic() - t0
        if time.monotonic() - t0 > limit:
            raise RuntimeError(f"spares not ready after {limit} s: {states}")
        time.sleep(0.1)


# ---- the two launchers ------------------------------------------------------------------------------------------

def dask_job(client, fn, **kwargs) -> dict:
    from dask_ddp import dispatch

    t0 = time.time()
    job = dispatch.run(client, fn, progress=False, backend="gloo", **kwargs)
    t_run = time.time()
    values = job.result(timeout=300)
    t1 = time.time()
    sup = [o.started for o in job.attempt.outcomes.values()] if job.attempt else []
    return {"wall": t1 - t0, "run_returned": t_run - t0,
            "supervisor_started": (max(sup) - t0) if sup else float("nan"),
            "fn_started": max(v["start"] for v in values) - t0, "fn_ended": max(v["end"] for v in values) - t0,
            "rank0": values[0]}


TORCHRUN_FAILURES: list[str] = []  # runs that exited non-zero (retried, not counted)


def torchrun_job(torchrun: str, script: str, name: str, tries: int = 3, **kwargs) -> dict:
    for _ in range(tries):
        t0 = time.time()
        proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", script, name,
                               json.dumps(kwargs)], capture_output=True, text=True)
        t1 = time.time()
        if proc.returncode == 0:
            break
        why = [ln for ln in proc.stderr.splitlines() if "terminate" in ln or "Error" in ln or "exitcode" in ln]
        TORCHRUN_FAILURES.append(f"{name}: exit {proc.returncode} after {t1 - t0:.1f} s; "
                                 + " | ".join(dict.fromkeys(ln.strip() for ln in why[:6])))
        print("torchrun failed, retrying: " + TORCHRUN_FAILURES[-1], flush=True)
    else:
        raise RuntimeError(f"torchrun failed {tries} times:\n{proc.stdout}\n{proc.stderr}")
    # the two ranks share the pipe: their lines can interleave, so find every RESULT {...} anywhere
    values = sorted((json.loads(m) for m in re.findall(r"RESULT (\{[^}]*\})", proc.stdout)), key=lambda v: v["rank"])
    assert [v["rank"] for v in values] == [0, 1], proc.stdout
    return {"wall": t1 - t0, "fn_started": max(v["start"] for v in values) - t0,
            "fn_ended": max(v["end"] for v in values) - t0, "rank0": values[0]}


# ---- statistics and report ---------------------------------------------------------------------------------------

def med(xs):
    return statistics.median(xs)


def spread(xs, unit="s", digits=3):
    return f"{med(xs):.{digits}f} {unit} ({min(xs):.{digits}f}–{max(xs):.{digits}f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--refill-wait", type=float, default=6.0, help="seconds slept between warm dask jobs")
    ap.add_argument("--latency-steps", type=int, default=20)
    ap.add_argument("--cnn-steps", type=int, default=300)
    ap.add_argument("--no-cnn", action="store_true", help="only the latency part")
    ap.add_argument("--out", default=str(Path(__file__).with_name("RESULTS_dispatch.md")))
    args = ap.parse_args(argv)

    import dask
    import distributed
    import torch
    from dask.distributed import Client, LocalCluster

    logging.getLogger("dask_ddp").setLevel(logging.WARNING)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    n = args.repeats
    began = time.monotonic()
    load = {"start": os.getloadavg()}
    tmp = tempfile.mkdtemp(prefix="bench-dispatch-")
    script = write_script(tmp)
    lat_kw = {"steps": args.latency_steps, "seed": 0}
    cnn_kw = {"steps": args.cnn_steps, "seed": 0}
    res: dict[str, list] = {k: [] for k in ("dask", "b2b", "torchrun", "cnn_default", "cnn_steady", "cnn_torchrun")}
    waits = []

    def log(msg):
        print(f"[{time.monotonic() - began:6.1f} s] {msg}", flush=True)

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                      silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
        log("cluster up; warm-up job")
        dask_job(client, train_linear, **lat_kw)
        waits.append(wait_warm(client, max(8.0, args.refill_wait)))
        log(f"warm (waited {waits[-1]:.1f} s)")

        # 1. dispatch latency, alternating dask (warm) and torchrun
        for i in range(n):
            waits.append(wait_warm(client, args.refill_wait))
            res["dask"].append(dask_job(client, train_linear, **lat_kw))
            wait_warm(client, 0.5)  # the refill started by that job must not compete with torchrun
            res["torchrun"].append(torchrun_job(torchrun, script, "train_linear", **lat_kw))
            log(f"latency {i + 1}/{n}: dask {res['dask'][-1]['wall']:.3f} s, "
                f"torchrun {res['torchrun'][-1]['wall']:.3f} s")
        load["after latency"] = os.getloadavg()

        # 1b. back-to-back dask jobs (first one warm, then no pause)
        wait_warm(client, args.refill_wait)
        for i in range(n):
            res["b2b"].append(dask_job(client, train_linear, **lat_kw))
        log("back-to-back: " + ", ".join(f"{r['wall']:.2f}" for r in res["b2b"]))

        # 2. per-step overhead, three variants in a rotating order
        def default():
            res["cnn_default"].append(dask_job(client, train_cnn, **cnn_kw))

        def steady():
            client.run(_set_warm_spare, False)
            try:
                res["cnn_steady"].append(dask_job(client, train_cnn, **cnn_kw))
            finally:
                client.run(_set_warm_spare, True)
                client.run(_refill)

        def baseline():
            res["cnn_torchrun"].append(torchrun_job(torchrun, script, "train_cnn", **cnn_kw))

        variants = [default, steady, baseline]
        for i in range(0 if args.no_cnn else n):
            for v in variants[i % 3:] + variants[:i % 3]:
                wait_warm(client, 1.0)
                v()
            log(f"cnn {i + 1}/{n}: loop dask default {res['cnn_default'][-1]['rank0']['loop_s']:.3f} s, "
                f"steady {res['cnn_steady'][-1]['rank0']['loop_s']:.3f} s, "
                f"torchrun {res['cnn_torchrun'][-1]['rank0']['loop_s']:.3f} s")
        load["end"] = os.getloadavg()

    total = time.monotonic() - began

    # ---- checks: same computation on both sides ----
    lin_losses = {r["rank0"]["loss"] for k in ("dask", "b2b", "torchrun") for r in res[k]}
    cnn_losses = {r["rank0"]["loss"] for k in ("cnn_default", "cnn_steady", "cnn_torchrun") for r in res[k]}
    same = len(lin_losses) == 1 and len(cnn_losses) <= 1

    # ---- tables ----
    d_wall = [r["wall"] for r in res["dask"]]
    b_wall = [r["wall"] for r in res["b2b"]]
    t_wall = [r["wall"] for r in res["torchrun"]]
    if args.no_cnn:  # placeholders so the tables below can be built; the CNN rows are dropped
        for k in ("cnn_default", "cnn_steady", "cnn_torchrun"):
            res[k] = [{"rank0": {"loop_s": 1.0, "step_median_s": 1.0, "loop_cpu_s": 1.0, "loss": 0.0}}]
    loops = {k: [r["rank0"]["loop_s"] for r in res[k]] for k in ("cnn_default", "cnn_steady", "cnn_torchrun")}
    steps = {k: [r["rank0"]["step_median_s"] * 1e3 for r in res[k]] for k in loops}
    cpus = {k: [r["rank0"]["loop_cpu_s"] for r in res[k]] for k in loops}
    c_def = med(cpus["cnn_default"]) / med(cpus["cnn_torchrun"])
    c_std = med(cpus["cnn_steady"]) / med(cpus["cnn_torchrun"])
    lat_ratio = med(d_wall) / med(t_wall)
    b2b_ratio = med(b_wall) / med(t_wall)
    r_def = med(loops["cnn_default"]) / med(loops["cnn_torchrun"])
    r_std = med(loops["cnn_steady"]) / med(loops["cnn_torchrun"])
    # paired ratios (each repeat's dask run against the torchrun run of the same repeat)
    paired_std = [a / b for a, b in zip(loops["cnn_steady"], loops["cnn_torchrun"])]
    paired_def = [a / b for a, b in zip(loops["cnn_default"], loops["cnn_torchrun"])]
    s_def = med(steps["cnn_default"]) / med(steps["cnn_torchrun"])
    s_std = med(steps["cnn_steady"]) / med(steps["cnn_torchrun"])

    def ok(x, goal):
        return "yes" if x <= goal else "**no**"

    L = args.latency_steps
    lines = [
        f"| measurement (median of {n}, min–max) | dask-ddp | torchrun | dask / torchrun | goal | met |",
        "|---|---|---|---|---|---|",
        f"| dispatch latency, warm cluster ({args.refill_wait:g} s pause + spares ready), {L} steps DDP(Linear(32,32)) "
        f"| {spread(d_wall)} | {spread(t_wall)} | {lat_ratio:.3f} | ≤ 0.25 | {ok(lat_ratio, 0.25)} |",
        f"| dispatch latency, back-to-back jobs (no pause) | {spread(b_wall)} | {spread(t_wall)} | "
        f"{b2b_ratio:.3f} | (info) | {'yes' if b2b_ratio <= 0.25 else 'no'} |",
        f"| CNN {args.cnn_steps}-step loop, rank 0, steady state (no spare starting during the loop) | "
        f"{spread(loops['cnn_steady'])} | {spread(loops['cnn_torchrun'])} | {r_std:.3f} (paired: "
        f"{min(paired_std):.3f}–{max(paired_std):.3f}) | ≤ 1.02 | {ok(r_std, 1.02)} |",
        f"| CNN {args.cnn_steps}-step loop, rank 0, default (next spare starts during the loop) | "
        f"{spread(loops['cnn_default'])} | {spread(loops['cnn_torchrun'])} | {r_def:.3f} (paired: "
        f"{min(paired_def):.3f}–{max(paired_def):.3f}) | ≤ 1.02 | {ok(r_def, 1.02)} |",
        f"| CNN median step time, steady state | {spread(steps['cnn_steady'], 'ms', 2)} | "
        f"{spread(steps['cnn_torchrun'], 'ms', 2)} | {s_std:.3f} | ≤ 1.02 | {ok(s_std, 1.02)} |",
        f"| CNN median step time, default | {spread(steps['cnn_default'], 'ms', 2)} | "
        f"{spread(steps['cnn_torchrun'], 'ms', 2)} | {s_def:.3f} | ≤ 1.02 | {ok(s_def, 1.02)} |",
        f"| CNN loop, CPU seconds of rank 0's process (process_time), steady state | "
        f"{spread(cpus['cnn_steady'])} | {spread(cpus['cnn_torchrun'])} | {c_std:.3f} | (info) | |",
        f"| CNN loop, CPU seconds of rank 0's process (process_time), default | "
        f"{spread(cpus['cnn_default'])} | {spread(cpus['cnn_torchrun'])} | {c_def:.3f} | (info) | |",
    ]
    if args.no_cnn:
        lines = lines[:4]

    def mcol(rows, key):
        vals = [r[key] for r in rows]
        return f"{med(vals):.3f}"

    def mddp(rows):
        return f"{med([r['rank0']['ddp_init_s'] for r in rows]):.3f} s"

    breakdown = [
        "| latency job, seconds after launch (median) | run() returned | rank task started on worker | "
        "training fn started (all ranks) | of the fn: first DDP() (rank 0) | training fn ended | "
        "result() returned / process exited |",
        "|---|---|---|---|---|---|---|",
        f"| dask-ddp, warm | {mcol(res['dask'], 'run_returned')} | {mcol(res['dask'], 'supervisor_started')} | "
        f"{mcol(res['dask'], 'fn_started')} | {mddp(res['dask'])} | {mcol(res['dask'], 'fn_ended')} | {mcol(res['dask'], 'wall')} |",
        f"| dask-ddp, back-to-back | {mcol(res['b2b'], 'run_returned')} | {mcol(res['b2b'], 'supervisor_started')} | "
        f"{mcol(res['b2b'], 'fn_started')} | {mddp(res['b2b'])} | {mcol(res['b2b'], 'fn_ended')} | {mcol(res['b2b'], 'wall')} |",
        f"| torchrun | – | – | {mcol(res['torchrun'], 'fn_started')} | {mddp(res['torchrun'])} | "
        f"{mcol(res['torchrun'], 'fn_ended')} | "
        f"{mcol(res['torchrun'], 'wall')} |",
    ]
    raw = [
        "dask warm wall (s): " + ", ".join(f"{x:.3f}" for x in d_wall),
        "dask back-to-back wall (s): " + ", ".join(f"{x:.3f}" for x in b_wall),
        "torchrun wall (s): " + ", ".join(f"{x:.3f}" for x in t_wall),
        "CNN loop dask steady (s): " + ", ".join(f"{x:.3f}" for x in loops["cnn_steady"]),
        "CNN loop dask default (s): " + ", ".join(f"{x:.3f}" for x in loops["cnn_default"]),
        "CNN loop torchrun (s): " + ", ".join(f"{x:.3f}" for x in loops["cnn_torchrun"]),
        "waits for warm spares before warm dask jobs (s): " + ", ".join(f"{x:.1f}" for x in waits),
        "load average (1, 5, 15 min): " + "; ".join(f"{k} {v[0]:.1f}/{v[1]:.1f}/{v[2]:.1f}" for k, v in load.items()),
        f"torchrun runs that exited non-zero and were repeated: {len(TORCHRUN_FAILURES)}"
        + "".join(f"; {f}" for f in TORCHRUN_FAILURES),
        f"same final loss on every run and both launchers (same computation): {same} "
        f"(linear {sorted(lin_losses)}, cnn {sorted(cnn_losses)})",
    ]
    if args.no_cnn:
        raw = [r for r in raw if not r.startswith("CNN")]
    cmd = "python benchmarks/bench_dispatch.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    header = [
        "# dask-ddp dispatch benchmark: latency and per-step overhead against torchrun",
        "",
        f"Command: `{cmd}` (from the repository root, venv python)  ",
        f"Date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}  ",
        f"Machine: {os.cpu_count()} CPU cores (shared with other jobs, see load average below); torch "
        f"{torch.__version__}, dask {dask.__version__}, distributed {distributed.__version__}; 2 ranks, gloo, CPU, "
        f"torch.set_num_threads(1) on every rank; whole run {total:.0f} s.",
        "",
        "Method: see the docstring of `benchmarks/bench_dispatch.py`. Both launchers run the same functions "
        "(torchrun gets their source copied into a script). dask-ddp latency is `run()` to `result()` on a "
        f"warm 2-worker LocalCluster: before each job the benchmark sleeps {args.refill_wait:g} s and waits until "
        "each worker's spare rank process has imported torch; the back-to-back row has no pause, so its jobs find "
        "the spare still starting. torchrun latency is the wall time of the whole `torchrun --standalone "
        "--nproc-per-node 2 script.py` subprocess. The CNN loop is timed inside rank 0 (perf_counter around the "
        "loop only); the three CNN variants alternate in a rotating order.",
        "",
    ]
    md = "\n".join(header + lines + ["", "Where the time goes (latency jobs):", ""] + breakdown
                   + ["", "Raw values:", ""] + [f"- {r}" for r in raw]) + "\n"
    print()
    print(md)
    Path(args.out).write_text(md)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
     then also waits until each worker's zygote (which forks the ranks; with
     ``ddp.zygote: false``, the spare rank process) has imported torch.
   * dask-ddp back-to-back: the same jobs with no pause in between (ranks are
     forked from the zygote: no job waits for an ``import torch``).
   * the fork limit, in turn with each back-to-back job: a warm interpreter
     (torch, DDP and ``torch._dynamo`` imported, as a zygote) forks two ranks
     that each make a ``TCPStore`` on a fresh port, the gloo process group and
     run the same ``train_linear``; from the fork to both children reaped. No
     scheduler, no supervisor, no results sent anywhere: the least any
     launcher can take for the same job on these cores (goal: back-to-back
     jobs within 1.2x of it).
   * torchrun: ``torchrun --standalone --nproc-per-node 2 script.py``, the
     whole subprocess's wall time (what a user waits for).

   The breakdown table times, inside the ranks, when the training function
   starts and how long its first ``DDP(...)`` takes: in torch 2.14 the first
   ``DistributedDataParallel`` of a process imports ``torch._dynamo`` (about
   900 modules, seconds); dask-ddp's zygotes import it before a job comes.

2. Per-step overhead: 300 steps of a small CNN (3x3 convolutions 1->8->16
   channels with max-pooling, then Linear(784, 10), on random 1x28x28 batches
   of 32, fixed seeds), timed inside rank 0 with ``time.perf_counter`` around
   the loop only (``time.process_time`` too: the CPU seconds of rank 0's
   process, less sensitive to other load on the machine). Each repeat runs
   dask-ddp and torchrun, alternating which goes first. Before each run the
   benchmark waits until the zygotes are ready (nothing starts beside a loop).

The final losses of both sides are compared: the same seeds must give the
same numbers, a check that both sides really ran the same computation.

Environment: torchrun runs with the environment this benchmark started with.
A LocalCluster writes ``distributed.nanny.pre-spawn-environ`` into the
environment of the process that starts it, and Dask workers run with
``MALLOC_TRIM_THRESHOLD_=65536``: glibc then stops adapting its mmap
threshold, so every tensor over 128 KiB is mmap'ed and unmapped again each
step (page faults, system time; 1.28x torchrun's step time in an earlier
run). dask-ddp's rank processes drop it; the report shows what the ranks saw.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import inspect
import json
import logging
import os
import re
import shutil
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
    import os
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
    return {"rank": rank, "start": started, "end": time.time(), "loss": loss.item(), "ddp_init_s": t_ddp,
            "malloc_trim": os.environ.get("MALLOC_TRIM_THRESHOLD_")}


def train_cnn(steps=300, seed=0, batch=32):
    """The per-step job: a 2-conv CNN on random 1x28x28 batches; only the loop is timed (perf_counter)."""
    import os
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
            "loop_cpu_s": cpu, "step_median_s": step_times[len(step_times) // 2],
            "malloc_trim": os.environ.get("MALLOC_TRIM_THRESHOLD_")}


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


FORK_MAIN = '''
if __name__ == "__main__":
    import json
    import os
    import socket
    import sys
    import time

    import torch
    import torch._dynamo  # noqa: F401 - warm, as a zygote
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    kwargs = json.loads(sys.argv[2])
    for line in sys.stdin:  # one round per line
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        started = time.time()
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=False)
                    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
                    train_linear(**kwargs)
                    dist.destroy_process_group()
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        codes = [os.waitpid(p, 0)[1] for p in pids]
        print(json.dumps({"wall": time.time() - started, "ok": codes == [0, 0]}), flush=True)
'''


def write_script(folder: str) -> str:
    path = os.path.join(folder, "ddp_train.py")
    src = "\n\n".join(textwrap.dedent(inspect.getsource(f)) for f in (train_linear, train_cnn))
    with open(path, "w") as fh:
        fh.write('"""Written by benchmarks/bench_dispatch.py: the same functions dask-ddp runs."""\n\n' + src
                 + "\n" + TORCHRUN_MAIN)
    return path


class ForkLimit:
    """The fork limit's warm interpreter (:data:`FORK_MAIN`), kept for the run; :meth:`round` times one job."""

    def __init__(self, folder: str, **kwargs):
        path = os.path.join(folder, "fork_limit.py")
        with open(path, "w") as fh:
            fh.write(textwrap.dedent(inspect.getsource(train_linear)) + "\n" + FORK_MAIN)
        self.proc = subprocess.Popen([sys.executable, path, "train_linear", json.dumps(kwargs)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=BASE_ENV)
        self.round()  # warm-up: the first process group of the parent's children, not counted

    def round(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        got = json.loads(self.proc.stdout.readline())
        if not got["ok"]:
            raise RuntimeError("a forked rank of the fork limit failed")
        return got["wall"]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


# ---- helpers run on the Dask workers (client.run) -------------------------------------------------------------

def _spare_state(dask_worker=None) -> str:
    """'ready' when this worker's zygote (or, with ddp.zygote false, its spare) has imported torch."""
    from dask_ddp.worker.plugin import RankHost

    return "ready" if RankHost.of(dask_worker).launcher.wait_ready(0.05) else "starting"


def wait_warm(client, minimum: float = 0.0, limit: float = 90.0) -> float:
    """Sleep ``minimum`` seconds, then until every worker's zygote is ready; return the seconds waited."""
    t0 = time.monotonic()
    time.sleep(minimum)
    while True:
        states = client.run(_spare_state)
        if all(s == "ready" for s in states.values()):
            return time.monotonic() - t0
        if time.monotonic() - t0 > limit:
            raise RuntimeError(f"zygotes not ready after {limit} s: {states}")
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


# The environment this process started with: what a user's shell gives torchrun. LocalCluster's nannies write
# distributed.nanny.pre-spawn-environ (MALLOC_TRIM_THRESHOLD_=65536, OMP_NUM_THREADS=1, ...) into os.environ of
# the process that starts them, so torchrun must not inherit os.environ as it is once the cluster is up.
BASE_ENV = dict(os.environ)
TORCHRUN_FAILURES: list[str] = []  # runs that exited non-zero (retried, not counted)


def torchrun_job(torchrun: str, script: str, name: str, tries: int = 3, **kwargs) -> dict:
    for _ in range(tries):
        t0 = time.time()
        proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", script, name,
                               json.dumps(kwargs)], capture_output=True, text=True, env=BASE_ENV)
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
    ap.add_argument("--parts", default="latency,cnn", help="comma-separated: latency, cnn")
    ap.add_argument("--out", default=str(Path(__file__).with_name("RESULTS_dispatch.md")))
    ap.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
    args = ap.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"latency", "cnn"}:
        ap.error(f"--parts: expected latency and/or cnn, got {args.parts!r}")

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
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    script = write_script(tmp)
    lat_kw = {"steps": args.latency_steps, "seed": 0}
    cnn_kw = {"steps": args.cnn_steps, "seed": 0}
    res: dict[str, list] = {k: [] for k in ("dask", "b2b", "fork", "torchrun", "cnn_dask", "cnn_torchrun")}
    waits = []

    def log(msg):
        print(f"[{time.monotonic() - began:6.1f} s] {msg}", flush=True)

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                      silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
        log("cluster up; warm-up job")
        dask_job(client, train_linear, **lat_kw)
        waits.append(wait_warm(client, max(8.0, args.refill_wait)))
        log(f"warm (waited {waits[-1]:.1f} s)")

        if "latency" in parts:
            # 1. dispatch latency, alternating dask (warm) and torchrun
            for i in range(n):
                waits.append(wait_warm(client, args.refill_wait))
                res["dask"].append(dask_job(client, train_linear, **lat_kw))
                wait_warm(client, 0.5)  # the refill started by that job must not compete with torchrun
                res["torchrun"].append(torchrun_job(torchrun, script, "train_linear", **lat_kw))
                log(f"latency {i + 1}/{n}: dask {res['dask'][-1]['wall']:.3f} s, "
                    f"torchrun {res['torchrun'][-1]['wall']:.3f} s")
            load["after latency"] = os.getloadavg()

            # 1b. back-to-back dask jobs (first one warm, then no pause), each beside a round of the fork limit
            fork = ForkLimit(tmp, **lat_kw)
            try:
                wait_warm(client, args.refill_wait)
                for i in range(n):
                    res["b2b"].append(dask_job(client, train_linear, **lat_kw))
                    res["fork"].append(fork.round())
            finally:
                fork.close()
            log("back-to-back: " + ", ".join(f"{r['wall']:.2f}" for r in res["b2b"]) + "; fork limit: "
                + ", ".join(f"{w:.2f}" for w in res["fork"]))

        # 2. per-step overhead, dask-ddp and torchrun alternating which goes first
        def dask_cnn():
            res["cnn_dask"].append(dask_job(client, train_cnn, **cnn_kw))

        def baseline():
            res["cnn_torchrun"].append(torchrun_job(torchrun, script, "train_cnn", **cnn_kw))

        for i in range(n if "cnn" in parts else 0):
            for v in ([dask_cnn, baseline] if i % 2 == 0 else [baseline, dask_cnn]):
                wait_warm(client, 1.0)
                v()
            log(f"cnn {i + 1}/{n}: loop dask {res['cnn_dask'][-1]['rank0']['loop_s']:.3f} s, "
                f"torchrun {res['cnn_torchrun'][-1]['rank0']['loop_s']:.3f} s")
        load["end"] = os.getloadavg()

    total = time.monotonic() - began
    md = report(args, parts, res, waits, load, total,
                versions=f"torch {torch.__version__}, dask {dask.__version__}, distributed {distributed.__version__}")
    print()
    print(md)
    with open(args.out, "a" if args.append else "w") as fh:
        fh.write(("\n" if args.append else "") + md)
    print(f"written to {args.out}")
    return 0


def ok(x, goal):
    return "yes" if x <= goal else "**no**"


def report(args, parts, res, waits, load, total, versions) -> str:
    n, L = args.repeats, args.latency_steps
    lines = [f"| measurement (median of {n}, min–max) | dask-ddp | torchrun | dask / torchrun | goal | met |",
             "|---|---|---|---|---|---|"]
    raw, breakdown = [], []
    if "latency" in parts:
        d_wall = [r["wall"] for r in res["dask"]]
        b_wall = [r["wall"] for r in res["b2b"]]
        t_wall = [r["wall"] for r in res["torchrun"]]
        lat, b2b = med(d_wall) / med(t_wall), med(b_wall) / med(t_wall)
        lines += [
            f"| dispatch latency, warm cluster ({args.refill_wait:g} s pause + zygotes ready), {L} steps "
            f"DDP(Linear(32,32)) | {spread(d_wall)} | {spread(t_wall)} | {lat:.3f} | ≤ 0.25 | {ok(lat, 0.25)} |",
            f"| dispatch latency, back-to-back jobs (no pause) | {spread(b_wall)} | {spread(t_wall)} | "
            f"{b2b:.3f} | (info) | {'yes' if b2b <= 0.25 else 'no'} |"]
        if res["fork"]:
            f_wall = res["fork"]
            paired = [a / b for a, b in zip(b_wall, f_wall)]
            lines.append(f"| back-to-back jobs against the fork limit (2 ranks forked from a warm interpreter: store, "
                         f"gloo, DDP, {L} steps; each beside a job) | {spread(b_wall)} | fork limit {spread(f_wall)} "
                         f"| {med(b_wall) / med(f_wall):.2f}x the limit (paired median {med(paired):.2f}x) | ≤ 1.2x "
                         f"| {ok(med(paired), 1.2)} |")
            raw.append("fork limit wall (s): " + ", ".join(f"{x:.3f}" for x in f_wall))

        def mcol(key, rows):
            return f"{med([r[key] for r in rows]):.3f}"

        def mddp(rows):
            return f"{med([r['rank0']['ddp_init_s'] for r in rows]):.3f}"

        breakdown = [
            "| latency job, seconds after launch (median) | run() returned | rank task started on worker | "
            "training fn started (all ranks) | of the fn: first DDP() took (rank 0) | training fn ended | "
            "result() returned / process exited |",
            "|---|---|---|---|---|---|---|"]
        for label, rows in (("dask-ddp, warm", res["dask"]), ("dask-ddp, back-to-back", res["b2b"])):
            breakdown.append(f"| {label} | {mcol('run_returned', rows)} | {mcol('supervisor_started', rows)} | "
                             f"{mcol('fn_started', rows)} | {mddp(rows)} | {mcol('fn_ended', rows)} | "
                             f"{mcol('wall', rows)} |")
        rows = res["torchrun"]
        breakdown.append(f"| torchrun | – | – | {mcol('fn_started', rows)} | {mddp(rows)} | "
                         f"{mcol('fn_ended', rows)} | {mcol('wall', rows)} |")
        raw += ["dask warm wall (s): " + ", ".join(f"{x:.3f}" for x in d_wall),
                "dask back-to-back wall (s): " + ", ".join(f"{x:.3f}" for x in b_wall),
                "torchrun wall (s): " + ", ".join(f"{x:.3f}" for x in t_wall)]
    if "cnn" in parts:
        keys = ("cnn_dask", "cnn_torchrun")
        loops = {k: [r["rank0"]["loop_s"] for r in res[k]] for k in keys}
        steps = {k: [r["rank0"]["step_median_s"] * 1e3 for r in res[k]] for k in keys}
        cpus = {k: [r["rank0"]["loop_cpu_s"] for r in res[k]] for k in keys}
        base = "cnn_torchrun"
        for k, label in (("cnn_dask", "wall time"),):
            r = med(loops[k]) / med(loops[base])
            paired = [a / b for a, b in zip(loops[k], loops[base])]  # each dask run against its repeat's torchrun
            lines.append(f"| CNN {args.cnn_steps}-step loop, rank 0, {label} | {spread(loops[k])} | "
                         f"{spread(loops[base])} | {r:.3f} (paired {min(paired):.2f}–{max(paired):.2f}) | ≤ 1.02 | "
                         f"{ok(r, 1.02)} |")
        for k in ("cnn_dask",):
            r = med(steps[k]) / med(steps[base])
            lines.append(f"| CNN median step time | {spread(steps[k], 'ms', 2)} | "
                         f"{spread(steps[base], 'ms', 2)} | {r:.3f} | ≤ 1.02 | {ok(r, 1.02)} |")
        for k in ("cnn_dask",):
            r = med(cpus[k]) / med(cpus[base])
            lines.append(f"| CNN loop, CPU seconds of rank 0's process (process_time) | {spread(cpus[k])} | "
                         f"{spread(cpus[base])} | {r:.3f} | (info) | |")
        raw += [f"CNN loop {k[4:]} (s): " + ", ".join(f"{x:.3f}" for x in loops[k]) for k in keys]
        raw += [f"CNN loop CPU {k[4:]} (s): " + ", ".join(f"{x:.3f}" for x in cpus[k]) for k in keys]
    lin = {r["rank0"]["loss"] for k in ("dask", "b2b", "torchrun") for r in res[k]}
    cnn = {r["rank0"]["loss"] for k in ("cnn_dask", "cnn_torchrun") for r in res[k]}
    trim = {side: sorted({str(r["rank0"]["malloc_trim"]) for k in keys_ for r in res[k]})
            for side, keys_ in (("dask-ddp", ("dask", "b2b", "cnn_dask")),
                                ("torchrun", ("torchrun", "cnn_torchrun")))}
    raw += [
        "waits for warm zygotes before warm dask jobs (s): " + ", ".join(f"{x:.1f}" for x in waits),
        "load average (1, 5, 15 min): " + "; ".join(f"{k} {v[0]:.1f}/{v[1]:.1f}/{v[2]:.1f}" for k, v in load.items()),
        f"MALLOC_TRIM_THRESHOLD_ seen by the ranks: dask-ddp {trim['dask-ddp']}, torchrun {trim['torchrun']}",
        f"torchrun runs that exited non-zero and were repeated: {len(TORCHRUN_FAILURES)}"
        + "".join(f"; {f}" for f in TORCHRUN_FAILURES),
        f"same final loss on every run and both launchers (same computation): "
        f"{len(lin) <= 1 and len(cnn) <= 1} (linear {sorted(lin)}, cnn {sorted(cnn)})",
    ]
    cmd = "python benchmarks/bench_dispatch.py" + "".join(f" {a}" for a in sys.argv[1:])
    header = [
        "# dask-ddp dispatch benchmark: latency and per-step overhead against torchrun",
        "",
        f"Command: `{cmd}` (from the repository root, venv python)  ",
        f"Date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}  ",
        f"Machine: {os.cpu_count()} CPU cores, shared with other jobs (see the load average below); {versions}; "
        f"2 ranks, gloo, CPU, torch.set_num_threads(1) on every rank; whole run {total:.0f} s.",
        "",
        "Method: see the docstring of `benchmarks/bench_dispatch.py`. Both launchers run the same functions "
        "(torchrun gets their source copied into a script and runs with the environment the benchmark started "
        "with). dask-ddp latency is `run()` to `result()` on a warm 2-worker LocalCluster: before each job the "
        f"benchmark sleeps {args.refill_wait:g} s and then waits until each worker's zygote has "
        "imported torch; the back-to-back row has no pause. torchrun latency is the wall time of the whole "
        "`torchrun --standalone --nproc-per-node 2 script.py` subprocess. The CNN loop is timed inside rank 0 "
        "(perf_counter around the loop only); dask-ddp and torchrun alternate which runs first.",
        "",
    ]
    out = header + lines
    if breakdown:
        out += ["", "Where the time goes (latency jobs):", ""] + breakdown
    return "\n".join(out + ["", "Raw values:", ""] + [f"- {r}" for r in raw]) + "\n"


if __name__ == "__main__":
    sys.exit(main())

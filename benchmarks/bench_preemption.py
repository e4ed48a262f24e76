"""Preemption, scale-down and growth: notice to save, steps lost, first step after resuming; torchrun on SIGTERM.

Usage::

    python benchmarks/bench_preemption.py [--steps 200] [--step-s 0.05] [--fault-step 25] [--ckpt-every 10]
                                          [--out benchmarks/RESULTS_preemption.md]

One run, every launcher on the same machine, literally the same training function (``train`` below): a
2-rank DDP job (``Linear(8, 16) -> ReLU -> Linear(16, 4)``, SGD with momentum, each step's batch drawn from its
step number, then ``time.sleep(--step-s)``), a periodic checkpoint every ``--ckpt-every`` steps, and the fault
once both ranks have logged step ``--fault-step``. Every rank appends a JSON line per step (time, rank, step,
attempt, world size, pid) to a log file with ``os.write``; all timings come from those lines and the launcher.

dask-ddp (default ``ddp.preemption.grace-period``: 25 s, inside Kubernetes' 30 s), the training code registers
its state with ``dask_ddp.on_preemption`` and checkpoints with ``save_checkpoint``:

1. ``SIGTERM to a worker``: two ``dask worker`` processes started from the command line (as a pod runs them);
   SIGTERM to the one running rank 1 (what Kubernetes does to a pod) and, at the same moment, a replacement
   ``dask worker`` started: the job resumes on 2 ranks;
2. ``retire_workers``: an elastic job (``workers=(1, 2)``) on a ``LocalCluster(2)``; ``client.retire_workers``
   of rank 1's worker: the job resumes on the worker left;
3. ``scale down``: the same with ``cluster.scale(1)``;
4. ``scale up``: an elastic job (``workers=(2, 3)``) on a ``LocalCluster(2)``; ``cluster.scale(3)``: the job
   saves and resumes on 3 ranks. Times count from the moment the third worker is in the scheduler.

For each: notice to save committed and the save itself (from ``job.history``), steps lost (the highest step
any rank logged in the first attempt minus the step the next attempt resumed from, plus one), steps neither
lost nor repeated overall, and the time from the fault to the first step after resuming.

torchrun (``torchrun --standalone --nproc-per-node 2``, the same function in a script; checkpoints with
``torch.save``/``torch.load`` by rank 0): SIGTERM to its agent, twice:

a. the script as written: the agent forwards SIGTERM to the ranks, which die at once (Python's default); the
   agent exits; the run is started again at once (what a Kubernetes Job would do, minus the pod's start) and
   resumes from the last periodic checkpoint. Steps lost, and the time from SIGTERM to the first step after
   resuming.
b. a script whose ranks handle SIGTERM to save later (they log it and train on): the agent SIGKILLs them
   after its 30 s close timeout (``PContext.close(timeout=30)``): when they died.

Everything listens on 127.0.0.1. Each dask-ddp case gets a fresh cluster with warm zygotes
(``dispatch.warm_up``) before its job.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # _cluster.CliWorkers
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster import CliWorkers  # noqa: E402 - after the paths above
from bench_faults import alive, read_log  # noqa: E402 - the ranks' JSON lines, a live pid

BASE_ENV = dict(os.environ)  # before any LocalCluster writes the Nanny's environment into it


def train(steps=200, step_s=0.05, ckpt_every=10, log_dir="", ckpt_dir="", launcher="dask-ddp", attempt=0,
          on_sigterm="default"):
    """DDP steps, resumable from any step; one JSON line per step; returns (rank, steps logged)."""
    import json
    import os
    import signal
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    if launcher == "dask-ddp":
        import dask_ddp

        ctx = dask_ddp.get_context()
        rank, world, attempt = ctx.rank, ctx.world_size, ctx.restart_count
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fd = os.open(os.path.join(log_dir, f"{launcher}-{rank}-{os.getpid()}.jsonl"),
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def log(**kv):
        os.write(fd, (json.dumps(dict(t=time.time(), rank=rank, attempt=attempt, world=world, pid=os.getpid(),
                                      **kv)) + "\n").encode())

    if on_sigterm == "train-on":
        signal.signal(signal.SIGTERM, lambda *_: log(ev="sigterm"))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    path = os.path.join(ckpt_dir, "latest.pt")
    if launcher == "dask-ddp":
        state = dask_ddp.load_checkpoint()
    else:
        state = torch.load(path, weights_only=True) if os.path.exists(path) else None
    start, step = 0, -1
    if state is not None:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
    log(ev="start", resume=start)

    def snapshot():
        return {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}

    if launcher == "dask-ddp":
        dask_ddp.on_preemption(snapshot)
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % ckpt_every == ckpt_every - 1:
            if launcher == "dask-ddp":
                dask_ddp.save_checkpoint(snapshot(), step=step)
            elif rank == 0:
                torch.save(snapshot(), path + ".tmp")
                os.replace(path + ".tmp", path)
        log(ev="step", step=step)
        if launcher == "dask-ddp":
            dask_ddp.report(step=step)  # the step boundary where a notice is acted on
        time.sleep(step_s)
    return rank, steps - start


TORCHRUN_MAIN = '''
import json, sys
import torch.distributed as dist

{source}

if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        print("RESULT", json.dumps(train(**json.loads(sys.argv[1]))), flush=True)
    finally:
        dist.destroy_process_group()
'''


# ---- reading the ranks' logs -------------------------------------------------------------------------------------

def steps(events, attempt=None):
    return [e for e in events if e["ev"] == "step" and (attempt is None or e["attempt"] == attempt)]


def wait_for_step(log_dir, step, timeout=180):
    """Wait until every rank of the first attempt logged ``step``."""
    end = time.time() + timeout
    while time.time() < end:
        ev = steps(read_log(log_dir), 0)
        ranks = {e["rank"] for e in ev if e["step"] >= step}
        if ranks and len(ranks) == ev[0]["world"]:
            return
        time.sleep(0.02)
    raise TimeoutError(f"{log_dir}: step {step} not reached in {timeout} s")


def coverage(events) -> str:
    """Steps of rank 0 over the whole run: 'each once', or what was repeated or missing."""
    done = sorted(e["step"] for e in steps(events) if e["rank"] == 0)
    top = max(done, default=-1)
    missing = sorted(set(range(top + 1)) - set(done))
    repeated = len(done) - len(set(done))
    if not missing and not repeated:
        return f"steps 0-{top} each once"
    return f"{repeated} steps repeated, {len(missing)} missing"


def lost_and_first(events, t0, resumed_attempt=1):
    """(steps lost, seconds from t0 to the first step of ``resumed_attempt``, the step it resumed from)."""
    top = max(e["step"] for e in steps(events, 0))
    later = steps(events, resumed_attempt)
    resume = min(e["step"] for e in later)
    return top - resume + 1, later[0]["t"] - t0, resume


# ---- dask-ddp ---------------------------------------------------------------------------------------------------

def history_figures(job) -> dict:
    """Notice to commit, the save's own time and the steps lost, as ``job.history`` states them."""
    causes = [h[3] for h in job.history if h[2] == "RESTARTING"]
    out = {"states": " -> ".join(h[2] for h in job.history), "cause": causes[0] if causes else ""}
    m = re.search(r"the save took ([\d.]+) s, notice to commit ([\d.]+) s\); (\d+) steps lost", out["cause"])
    if m:
        out.update(save=float(m[1]), commit=float(m[2]), said_lost=int(m[3]))
    return out


def dask_ddp_case(args, case: str, root: str) -> dict:
    from dask.distributed import Client, LocalCluster

    from dask_ddp import dispatch
    from dask_ddp.client.cluster import scheduler_workers

    log_dir, ckpt = os.path.join(root, case, "log"), os.path.join(root, case, "ckpt")
    os.makedirs(log_dir)
    kw = dict(steps=args.steps, step_s=args.step_s, ckpt_every=args.ckpt_every, log_dir=log_dir)
    n0, bounds = {"SIGTERM to a worker": (0, 2), "retire_workers": (2, (1, 2)), "scale down": (2, (1, 2)),
                  "scale up": (2, (2, 3))}[case]
    workers = None
    with LocalCluster(n_workers=n0, threads_per_worker=1, host="127.0.0.1", dashboard_address=":0",
                      processes=True) as cluster, Client(cluster) as client:
        try:
            if case == "SIGTERM to a worker":
                workers = CliWorkers(cluster.scheduler_address)
                for name in ("a", "b"):
                    workers.start(name)
                client.wait_for_workers(2, timeout=120)
            dispatch.warm_up(client)
            job = dispatch.run(client, train, **kw, checkpoint_dir=ckpt, workers=bounds)
            wait_for_step(log_dir, args.fault_step)
            victim = job.plan.addresses[1]
            t0 = time.time()
            if case == "SIGTERM to a worker":
                name = str(job.plan.ranks[1].name)
                workers.procs[name].send_signal(signal.SIGTERM)
                workers.start("c")
            elif case == "retire_workers":
                client.retire_workers([victim])
            elif case == "scale down":
                cluster.scale(1)
            else:
                cluster.scale(3)
                while len(scheduler_workers(client)) < 3:
                    time.sleep(0.05)
                t0 = time.time()  # growth counts from the moment the worker is there
            job.result(timeout=600)
            events = read_log(log_dir)
            lost, first, resume = lost_and_first(events, t0)
            out = dict(case=case, lost=lost, first=first, resume=resume, coverage=coverage(events),
                       world=sorted({e["world"] for e in steps(events, 1)}), **history_figures(job))
            print(case, out, flush=True)
            return out
        finally:
            if workers is not None:
                workers.close()


# ---- torchrun ---------------------------------------------------------------------------------------------------

def torchrun(script: str, kw: dict) -> subprocess.Popen:
    exe = str(Path(sys.executable).with_name("torchrun"))
    env = {**BASE_ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [exe, "--standalone", "--nproc-per-node", "2", "--local-addr", "127.0.0.1", script, json.dumps(kw)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def torchrun_case(args, how: str, root: str, script: str) -> dict:
    log_dir, ckpt = os.path.join(root, f"torchrun-{how}", "log"), os.path.join(root, f"torchrun-{how}", "ckpt")
    os.makedirs(log_dir)
    os.makedirs(ckpt)
    long = how == "train-on"  # long enough to be running when torchrun's 30 s are up
    kw = dict(steps=100_000 if long else args.steps, step_s=args.step_s, ckpt_every=args.ckpt_every,
              log_dir=log_dir, ckpt_dir=ckpt, launcher="torchrun", on_sigterm=how)
    proc = torchrun(script, kw)
    try:
        wait_for_step(log_dir, args.fault_step)
        pids = {e["pid"] for e in read_log(log_dir)}
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)  # what Kubernetes does to a pod's main process
        gone = None
        while proc.poll() is None or (gone is None and any(alive(p) for p in pids)):
            if gone is None and not any(alive(p) for p in pids):
                gone = time.time()
            if time.time() - t0 > 120:
                raise TimeoutError(f"torchrun ({how}) did not exit within 120 s of SIGTERM")
            time.sleep(0.01)
        gone = gone or time.time()
        exited = time.time() - t0
        code = proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    events = read_log(log_dir)
    top = max(e["step"] for e in steps(events, 0))
    saved = None
    if os.path.exists(os.path.join(ckpt, "latest.pt")):
        import torch

        saved = torch.load(os.path.join(ckpt, "latest.pt"), weights_only=True)["step"]
    after = [e for e in steps(events, 0) if e["t"] > t0]
    out = dict(case=f"torchrun, {how}", ranks_gone=gone - t0, exited=exited, code=code, top=top, saved=saved,
               trained_after=len({e["step"] for e in after}),
               sigterm_seen=any(e["ev"] == "sigterm" for e in events))
    if how == "default":  # start it again at once, as a Job controller would, and time its first step
        again = torchrun(script, {**kw, "attempt": 1})
        again.wait(600)
        events = read_log(log_dir)
        lost, first, resume = lost_and_first(events, t0)
        out.update(lost=lost, first=first, resume=resume, coverage=coverage(events), relaunch_code=again.returncode)
    print(out["case"], out, flush=True)
    return out


# ---- the report -------------------------------------------------------------------------------------------------

def report(args, rows: list[dict], tr: list[dict], took: float, load: tuple) -> str:
    import torch

    lines = [
        "# Preemption benchmark: notice to save, steps lost, first step after resuming; torchrun on SIGTERM",
        "",
        f"{time.strftime('%Y-%m-%dT%H:%M:%S')}, {os.cpu_count()} CPUs, load average before "
        f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, after {os.getloadavg()[0]:.1f}, Python "
        f"{sys.version.split()[0]}, torch {torch.__version__}; whole run {took:.0f} s",
        "",
        f"`{' '.join(['python benchmarks/bench_preemption.py', *sys.argv[1:]])}` (from the repository root)",
        "",
        f"2 ranks, gloo, CPU, {args.steps} steps of about {1000 * args.step_s:.0f} ms, a periodic checkpoint every "
        f"{args.ckpt_every} steps, the fault once both ranks logged step {args.fault_step}. dask-ddp's grace period: "
        "the default `ddp.preemption.grace-period` (25 s).",
        "",
        "| fault | notice -> save committed | the save | steps lost | fault -> first step after resuming | "
        "steps over the run | job.history |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| dask-ddp, {r['case']} | {r.get('commit', float('nan')):.2f} s | {r.get('save', 0):.3f} s | "
                     f"**{r['lost']}** (history says {r.get('said_lost', '?')}) | {r['first']:.1f} s on "
                     f"{'/'.join(map(str, r['world']))} rank{'s' if r['world'] != [1] else ''} | {r['coverage']} | "
                     f"{r['states']}: "
                     f"{r['cause'][:160]} |")
    for t in tr:
        if "lost" in t:
            lines.append(
                f"| torchrun, SIGTERM to its agent | none (the ranks die at once: Python's default SIGTERM) | - | "
                f"**{t['lost']}** (back to the periodic checkpoint of step {t['saved']}) | {t['first']:.1f} s "
                f"(torchrun exited {t['exited']:.2f} s after SIGTERM, code {t['code']}; started again at once) | "
                f"{t['coverage']} | - |")
        else:
            lines.append(
                f"| torchrun, SIGTERM to its agent, ranks that handle SIGTERM and train on to save later | "
                f"none: SIGKILLed **{t['ranks_gone']:.1f} s** after SIGTERM | - | {t['top'] - t['saved']} (they "
                f"trained {t['trained_after']} steps after SIGTERM; the last periodic checkpoint was step "
                f"{t['saved']}) | - (torchrun exited {t['exited']:.1f} s after SIGTERM, code {t['code']}) | - | - |")
    lines += ["", "How to read it: see the docstring of `benchmarks/bench_preemption.py`. The time to the first "
              "step after resuming includes, for dask-ddp's SIGTERM case, the replacement worker's start (its "
              "zygote imports torch) and, for scale up, the new worker's zygote; for torchrun's restart, a "
              "fresh `torchrun` with two fresh interpreters (a Kubernetes pod would add its own start)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--fault-step", type=int, default=25)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--cases", default="sigterm,retire,down,up,torchrun")
    p.add_argument("--out", default=str(Path(__file__).with_name("RESULTS_preemption.md")))
    args = p.parse_args(argv)
    load, t_start = os.getloadavg(), time.time()
    cases = args.cases.split(",")
    names = {"sigterm": "SIGTERM to a worker", "retire": "retire_workers", "down": "scale down", "up": "scale up"}
    rows, tr = [], []
    with tempfile.TemporaryDirectory(prefix="bench-preempt-") as root:
        for c in cases:
            if c in names:
                rows.append(dask_ddp_case(args, names[c], root))
        if "torchrun" in cases:
            script = os.path.join(root, "train_script.py")
            Path(script).write_text(TORCHRUN_MAIN.format(source=textwrap.dedent(inspect.getsource(train))))
            tr = [torchrun_case(args, "default", root, script), torchrun_case(args, "train-on", root, script)]
    text = report(args, rows, tr, time.time() - t_start, load)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

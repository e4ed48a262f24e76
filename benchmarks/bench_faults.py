"""Faults in a 2-rank DDP job: time to detect, time to recover and steps lost, for three launchers, in one run.

Usage::

    python benchmarks/bench_faults.py [--hang-wait 60] [--out benchmarks/RESULTS_faults.md]

The launchers run literally the same training function (``train`` below):

1. dask-ddp: ``dispatch.run(client, train, ..., max_restarts=1, checkpoint_dir=<temp dir>,
   stall_timeout=5)`` on a ``LocalCluster(n_workers=2, threads_per_worker=1)``; checkpoints through
   ``dask_ddp.save_checkpoint`` / ``load_checkpoint``, restart count from ``get_context()``.
2. torchrun: ``torchrun --standalone --nproc-per-node 2 --max-restarts 1 script.py``, the function's source
   copied (``inspect.getsource``) into a script that calls ``init_process_group("gloo")`` itself;
   checkpoints with ``torch.save`` / ``torch.load``, restart count from ``TORCHELASTIC_RESTART_COUNT``.
   torchrun runs with the environment this benchmark started with (saved before any LocalCluster writes
   the Nanny's ``pre-spawn-environ`` into it) plus ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: by default
   (torch >= 2.5) the ranks' process group uses the agent's rendezvous store, which outlives a restart,
   with the same keys in every attempt, and on torch 2.14.1 with gloo most restarts then fail or hang in
   ``init_process_group`` (the symptom of pytorch/pytorch#135712). ``--default-store-tries N`` (3) runs
   fault a. N more times with torchrun's default and reports what became of each restart.
3. dask-pytorch-ddp's approach (0.2.2), re-implemented here (``dpd_dispatch_with_ddp``): one plain
   ``client.submit(..., workers=[w], pure=False)`` per worker that sets ``MASTER_ADDR``/``MASTER_PORT``/
   ``RANK``/``WORLD_SIZE``, calls ``init_process_group`` and the function in the worker's own thread;
   ``client.gather`` of the futures; no supervision, no restarts. (0.2.2 uses the fixed port 23456; a free
   port is used here so that runs never collide.) Checkpoints as for torchrun.

The training: ``DDP(Linear(32, 64) -> ReLU -> Linear(64, 1))``, SGD with momentum, ``--steps`` steps (60)
on batches drawn from a generator seeded by (step, rank), each step followed by ``time.sleep(--step-s)``
(30 ms: a step of about 35 ms); every ``--ckpt-every`` steps (10) rank 0 saves model, optimizer and the
next step; a (re)started attempt resumes from the newest checkpoint. So a resumed run must end with the
same parameters, bitwise, as an uninterrupted one: the report compares their hashes.

Faults, injected by rank 1 at the start of step ``--fault-step`` (25) on the first attempt only (the
restarted attempt runs clean), right after it writes the fault's timestamp to its log:

a. ``raise``: rank 1 raises ``RuntimeError``.
b. ``sigkill-rank``: ``os.kill(os.getpid(), SIGKILL)``.
c. ``sigkill-worker``: the process that hosts rank 1 gets SIGKILL: for dask-ddp the Dask worker, the rank
   process's parent (``os.kill(os.getppid(), SIGKILL)``; its Nanny starts a new worker); for
   dask-pytorch-ddp's approach the function runs in the worker itself, so ``os.kill(os.getpid(), ...)``
   (the same as b. there); for torchrun the parent is the torchrun agent (``os.getppid()``), which in a
   standalone run is the one agent of both ranks. After killing its parent, rank 1 carries on training.
d. ``hang``: rank 1 sleeps forever outside a collective; rank 0 then blocks in the next all_reduce.
   dask-ddp notices through ``stall_timeout`` (no report from a rank for that long); torchrun and
   dask-pytorch-ddp's approach only through the collective timeout (gloo's default: 30 min), which the
   benchmark does not wait out: it waits ``--hang-wait`` seconds after the fault, reports "no detection",
   and cleans up (SIGTERM to torchrun, as Ctrl-C would; closing the LocalCluster).

A clean run (``none``) per launcher gives the reference parameters and the time of an undisturbed run.

Every rank appends one JSON line per event (start, resume point, each step, the fault) with
``time.time()`` and its pid to its own log file with ``os.write`` (unbuffered, so the fault's line is on
disk before a SIGKILL). All timings come from those logs and from when the launcher showed the failure:

* time to detect: from the fault's timestamp to the launcher's first sign of failure: dask-ddp, the
  ``job.history`` transition out of RUNNING (to RESTARTING, or FAILED); torchrun, the first line its agent
  logs about the failure (stderr lines are timestamped as they arrive; it logs when it stops the other
  rank, "Sending process ... closing signal SIGTERM"), else its exit; dask-pytorch-ddp's approach,
  ``client.gather`` raising.
* time to recover: from the fault to the end of the first training step of the restarted attempt.
* steps lost: steps both ranks completed in the failed attempt minus the step the restarted attempt resumed
  from (work done again).
* complete: the launcher returned every rank's result with all steps done.
* left behind: rank processes (pids from the logs) still alive once the launcher has finished or was
  cleaned up, other non-spare children of the Dask workers, rank tasks still running in a worker, and
  torch process groups still initialised in a worker (dask-pytorch-ddp's approach).

Every Dask cluster is created fresh for each run (a fault can leave a worker with a broken process group or a
thread stuck in a collective), and the ranks' spare processes are warmed (``dispatch.warm_up``) before a
dask-ddp job. Everything listens on 127.0.0.1 (``GLOO_SOCKET_IFNAME=lo``, torchrun ``--local-addr``).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import inspect
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

if os.path.exists("/sys/class/net/lo"):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo on loopback only, for every launcher

# The environment this process started with: what a user's shell gives torchrun (see bench_dispatch.py).
BASE_ENV = dict(os.environ)

FAULTS = ("none", "raise", "sigkill-rank", "sigkill-worker", "hang")
LAUNCHERS = ("dask-ddp", "torchrun", "dpd")
FAULT_LABEL = {
    "none": "none (clean run)",
    "raise": "a. rank 1 raises an exception",
    "sigkill-rank": "b. rank 1's process gets SIGKILL",
    "sigkill-worker": "c. the process hosting rank 1 gets SIGKILL (Dask worker / torchrun agent)",
    "hang": "d. rank 1 hangs outside a collective",
}
LAUNCHER_LABEL = {"dask-ddp": "dask-ddp", "torchrun": "torchrun", "dpd": "dask-pytorch-ddp's approach"}


# ---- the training code, run identically by every launcher (imports inside: shipped by value / copied) ----------

def _host_pid() -> int:
    """The process hosting this rank: torchrun's agent, or dask-ddp's Dask worker (a forked rank's zygote's parent)."""
    import psutil

    parent = psutil.Process(os.getppid())
    return parent.ppid() if any("dask_ddp.rank.zygote" in part for part in parent.cmdline()) else parent.pid


def train(steps=60, fault="none", fault_step=25, ckpt_every=10, step_s=0.03, log_dir="", ckpt_dir="",
          launcher="torchrun", seed=0):
    """``steps`` DDP SGD steps with checkpoints; rank 1 injects ``fault`` at ``fault_step`` on attempt 0."""
    import hashlib
    import json
    import os
    import signal
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    if launcher == "dask-ddp":
        import dask_ddp

        attempt = dask_ddp.get_context().restart_count
    else:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fd = os.open(os.path.join(log_dir, f"rank{rank}.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(event, **kw):  # one unbuffered write per line: on disk before any SIGKILL
        line = dict(t=time.time(), rank=rank, attempt=attempt, pid=os.getpid(), event=event, **kw)
        os.write(fd, (json.dumps(line) + "\n").encode())

    def save(state, step):
        if launcher == "dask-ddp":
            dask_ddp.save_checkpoint(state, step=step)
        elif rank == 0:
            tmp = os.path.join(ckpt_dir, f".step-{step:06d}.tmp")
            torch.save(state, tmp)
            os.replace(tmp, os.path.join(ckpt_dir, f"step-{step:06d}.pt"))

    def load():
        if launcher == "dask-ddp":
            return dask_ddp.load_checkpoint()
        names = sorted(n for n in os.listdir(ckpt_dir) if n.startswith("step-") and n.endswith(".pt"))
        return torch.load(os.path.join(ckpt_dir, names[-1]), weights_only=True) if names else None

    log("start")
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    start = 0
    state = load()
    if state is not None:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = int(state["step"])
    log("begin", step=start)
    for step in range(start, steps):
        if fault != "none" and attempt == 0 and rank == 1 and step == fault_step:
            log("fault", step=step, kind=fault)
            if fault == "raise":
                raise RuntimeError(f"injected fault: rank {rank} raises at step {step}")
            if fault == "sigkill-rank":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "sigkill-worker":  # the process hosting this rank: the worker itself for dpd
                os.kill(os.getpid() if launcher == "dpd" else _host_pid(), signal.SIGKILL)
            while fault == "hang":
                time.sleep(1)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 16 + rank)
        x = torch.randn(64, 32, generator=gen)
        y = x[:, :4].sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        time.sleep(step_s)
        log("step", step=step, loss=loss.item())
        if launcher == "dask-ddp":
            dask_ddp.report(step=step, loss=loss.item())
        if (step + 1) % ckpt_every == 0:
            save({"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step + 1}, step + 1)
    os.close(fd)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return {"rank": rank, "attempt": attempt, "start": start, "steps": steps, "params": digest[:16]}


TORCHRUN_MAIN = '''
if __name__ == "__main__":
    import json
    import sys

    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = train(**json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
'''


def write_script(folder: str) -> str:
    path = os.path.join(folder, "ddp_faults.py")
    with open(path, "w") as fh:
        fh.write('"""Written by benchmarks/bench_faults.py: the function dask-ddp runs."""\n\n'
                 + textwrap.dedent(inspect.getsource(train)) + "\n" + TORCHRUN_MAIN)
    return path


# ---- dask-pytorch-ddp 0.2.2's dispatch, re-implemented (it runs in the Dask worker's own thread) ---------------

def dpd_dispatch_with_ddp(pytorch_function, master_addr, master_port, rank, world_size, *args, backend="nccl",
                          **kwargs):
    """dask_pytorch_ddp.dispatch.dispatch_with_ddp: env vars, init_process_group, the function, destroy."""
    import os

    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["NCCL_BLOCKING_WAIT"] = "1"
    dist.init_process_group(backend=backend)
    result = pytorch_function(*args, **kwargs)
    dist.destroy_process_group()
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- one run: the record, the logs ---------------------------------------------------------------------------

@dataclass
class Run:
    launcher: str
    fault: str
    t0: float = 0.0  # launch
    t_end: float = 0.0  # the launcher returned, raised, or was given up on
    fault_t: float | None = None
    detect_t: float | None = None
    detect_how: str = ""
    recover_t: float | None = None  # end of the first step of the restarted attempt
    done_before: int | None = None  # steps both ranks completed before the fault
    resumed_from: int | None = None
    hung: bool = False
    complete: bool = False
    outcome: str = ""  # what the launcher returned / raised / how it exited
    params: str | None = None
    left: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    step_ms: float | None = None
    attempts: dict = field(default_factory=dict)  # attempt -> (first step, last step) seen in the logs
    errors: list = field(default_factory=list)  # torchrun: error lines on stderr
    gave_up: bool = False  # the benchmark stopped waiting and cleaned up

    @property
    def detect(self):
        return None if self.detect_t is None or self.fault_t is None else self.detect_t - self.fault_t

    @property
    def recover(self):
        return None if self.recover_t is None or self.fault_t is None else self.recover_t - self.fault_t

    @property
    def lost(self):
        if self.resumed_from is None or self.done_before is None:
            return None
        return self.done_before - self.resumed_from


def read_log(log_dir: str) -> list[dict]:
    events = []
    for name in sorted(os.listdir(log_dir)):
        if name.endswith(".jsonl"):
            with open(os.path.join(log_dir, name)) as fh:
                events += [json.loads(ln) for ln in fh if ln.strip().endswith("}")]
    return sorted(events, key=lambda e: e["t"])


def fault_time(log_dir: str) -> float | None:
    return next((e["t"] for e in read_log(log_dir) if e["event"] == "fault"), None)


def analyse(run: Run, log_dir: str) -> list[dict]:
    """Fill in the fault time, steps done before it, the resume point and the recovery from the logs."""
    ev = read_log(log_dir)
    fault = next((e for e in ev if e["event"] == "fault"), None)
    steps = [e for e in ev if e["event"] == "step"]
    for a in sorted({e["attempt"] for e in steps}):
        mine = [e["step"] for e in steps if e["attempt"] == a]
        run.attempts[a] = (min(mine), max(mine))
    gaps = []
    for r in (0, 1):
        ts = [e["t"] for e in steps if e["rank"] == r and e["attempt"] == 0]
        gaps += [b - a for a, b in zip(ts, ts[1:])]
    run.step_ms = statistics.median(gaps) * 1e3 if gaps else None
    if fault is None:
        return ev
    run.fault_t = fault["t"]
    last = [max((e["step"] for e in steps if e["rank"] == r and e["attempt"] == 0), default=-1) for r in (0, 1)]
    run.done_before = min(last) + 1
    later = [e for e in ev if e["attempt"] > 0]
    begin = next((e for e in later if e["event"] == "begin"), None)
    first = next((e for e in later if e["event"] == "step"), None)
    if begin is not None:
        run.resumed_from = begin["step"]
    if first is not None:
        run.recover_t = first["t"]
    return ev


def rank_pids(events: list[dict]) -> set[int]:
    return {e["pid"] for e in events}


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def describe(pid: int) -> str:
    import psutil

    try:
        p = psutil.Process(pid)
        return f"pid {pid} ({' '.join(p.cmdline())[:80]})"
    except psutil.NoSuchProcess:
        return f"pid {pid} (gone)"


def wait_gone(pids, wait: float = 10.0) -> list[int]:
    """Wait up to ``wait`` seconds for ``pids`` to exit (a launcher may still be reaping); return those alive."""
    deadline = time.monotonic() + wait
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


# ---- Dask clusters -------------------------------------------------------------------------------------------

class Cluster:
    """A fresh 2-worker LocalCluster on 127.0.0.1 and its client; closed (whatever state it is in) on exit."""

    def __enter__(self):
        from dask.distributed import Client, LocalCluster

        self.cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                    dashboard_address=":0", silence_logs=logging.CRITICAL)
        self.client = Client(self.cluster)
        return self.client

    def __exit__(self, *exc):
        for close in (self.client.close, self.cluster.close):
            try:
                close()
            except Exception as e:  # noqa: BLE001 - a broken cluster must not stop the benchmark
                print(f"  (closing: {e!r})", flush=True)


def _worker_children(dask_worker=None):
    """On a worker: pids of its child processes that are not its warm dask-ddp zygote or spare."""
    import psutil

    try:
        from dask_ddp.worker.plugin import RankHost

        spare = set(RankHost.of(dask_worker).launcher.pids())
    except Exception:  # noqa: BLE001
        spare = set()
    out = []
    for kid in psutil.Process().children(recursive=True):
        try:
            if kid.pid not in spare and kid.status() != psutil.STATUS_ZOMBIE:
                out.append((kid.pid, " ".join(kid.cmdline())[:80]))
        except psutil.NoSuchProcess:
            pass
    return out


def _process_group_initialised(dask_worker=None) -> bool:
    """On a worker: whether a torch default process group is still initialised in the worker process."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def worker_leftovers(client, wait: float = 10.0) -> list[str]:
    deadline = time.monotonic() + wait
    while True:
        try:
            got = client.run(_worker_children)
        except Exception as e:  # noqa: BLE001
            return [f"(could not ask the workers: {e!r})"]
        left = [f"pid {pid} ({cmd}) under worker {w}" for w, kids in got.items() for pid, cmd in kids]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


# ---- the three launchers -------------------------------------------------------------------------------------

def train_kwargs(args, fault, log_dir, ckpt_dir, launcher) -> dict:
    return {"steps": args.steps, "fault": fault, "fault_step": args.fault_step, "ckpt_every": args.ckpt_every,
            "step_s": args.step_s, "log_dir": log_dir, "ckpt_dir": ckpt_dir, "launcher": launcher}


def run_dask_ddp(args, fault, log_dir, ckpt_dir) -> Run:
    from dask_ddp import dispatch

    run = Run("dask-ddp", fault)
    with Cluster() as client:
        dispatch.warm_up(client)
        run.t0 = time.time()
        job = dispatch.run(client, train, progress=False, backend="gloo", max_restarts=1, checkpoint_dir=ckpt_dir,
                           stall_timeout=args.stall_timeout, **train_kwargs(args, fault, log_dir, None, "dask-ddp"))
        while not job.wait(0.2, progress=False):
            ft = fault_time(log_dir)
            left_running = any(old == "RUNNING" for _, old, _, _ in job.history)
            if ft is not None and not left_running and time.time() - ft > args.hang_wait:
                run.hung = True
                run.notes.append(f"no detection {args.hang_wait:g} s after the fault: job.cancel()")
                job.cancel()
                break
            if time.time() - run.t0 > args.hang_wait + 180:
                run.notes.append("gave up waiting for the job: job.cancel()")
                job.cancel()
                break
        run.t_end = time.time()
        try:
            values = job.result(timeout=60)
            run.complete = all(v["steps"] == args.steps for v in values) and len(values) == 2
            run.params = values[0]["params"]
            run.outcome = f"result(): {len(values)} values, {job.state}"
        except Exception as e:  # noqa: BLE001
            run.outcome = f"result() raised {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        ev = analyse(run, log_dir)
        run.notes.append("history: " + " | ".join(f"{t - run.t0:.2f} s {old}->{new} ({cause[:90]})"
                                                 for t, old, new, cause in job.history))
        if run.fault_t is not None:
            out = next(((t, new, cause) for t, old, new, cause in job.history if old == "RUNNING"
                        and t >= run.fault_t - 1), None)
            if out is not None:
                run.detect_t, run.detect_how = out[0], f"RUNNING -> {out[1]}: {out[2][:110]}"
        run.left = [describe(p) for p in wait_gone(rank_pids(ev))] + worker_leftovers(client)
    return run


def run_torchrun(args, fault, log_dir, ckpt_dir, script, shared_store=False, wait=None) -> Run:
    """One torchrun run. ``shared_store``: torchrun's default, where the ranks' process group uses the agent's
    rendezvous store (restarts then can fail; see the docstring); otherwise TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."""
    import psutil

    run = Run("torchrun", fault)
    wait = args.hang_wait if wait is None else wait
    env = dict(BASE_ENV)
    if not shared_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--local-addr", "127.0.0.1",
           script, json.dumps(train_kwargs(args, fault, log_dir, ckpt_dir, "torchrun"))]
    lines: list[tuple[float, str, str]] = []
    exited: list[float] = []

    def pump(stream, name):
        for raw in iter(stream.readline, b""):
            lines.append((time.time(), name, raw.decode(errors="replace").rstrip()))

    run.t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=True)
    helpers = [threading.Thread(target=pump, args=(s, n), daemon=True)
               for s, n in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    helpers.append(threading.Thread(target=lambda: exited.append((proc.wait(), time.time())[1]), daemon=True))
    for t in helpers:
        t.start()
    gave_up = None
    while not exited:
        ft = fault_time(log_dir)
        if ft is not None and time.time() - ft > wait and not restarted(log_dir):
            gave_up = time.time()
            run.hung = not any(_agent_line(ln) and t >= ft for t, name, ln in list(lines) if name == "stderr")
            run.notes.append(f"no restarted attempt {wait:g} s after the fault: SIGTERM to torchrun")
            break
        if time.time() - run.t0 > wait + 180:
            gave_up = time.time()
            run.notes.append("gave up waiting for torchrun: SIGTERM")
            break
        time.sleep(0.05)
    if not exited:
        proc.send_signal(signal.SIGTERM)  # what Ctrl-C or a scheduler's cancel does
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        helpers[2].join(5)
    run.t_end = exited[0] if exited else time.time()
    run.gave_up = gave_up is not None
    ev = analyse(run, log_dir)
    pids = rank_pids(ev)
    orphans = [p for p in pids if alive(p)]  # rank processes still running when torchrun has exited
    if orphans:
        run.notes.append(f"rank processes alive when torchrun had exited: {len(orphans)} (they run in sessions "
                         "of their own: nobody supervises them now)")
    left = wait_gone(orphans)
    run.left = [describe(p) for p in left]
    if orphans and not left:
        gone = max(e["t"] for e in read_log(log_dir)) - run.t_end
        run.left = [f"{len(orphans)} orphaned rank processes, training on unsupervised until their loop ended "
                    f"({gone:.1f} s after torchrun's exit)"]
    for p in left:  # clean up after torchrun
        try:
            psutil.Process(p).kill()
        except psutil.NoSuchProcess:
            pass
    for t in helpers[:2]:
        t.join(timeout=10)  # the pipes close once every process holding them has gone
    code = proc.returncode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    results = [json.loads(ln[len("RESULT "):]) for _, name, ln in lines
               if name == "stdout" and ln.startswith("RESULT ")]
    run.complete = (code == 0 and sorted(r["rank"] for r in results) == [0, 1]
                    and all(r["steps"] == args.steps for r in results))
    if results:
        run.params = results[0]["params"]
    run.outcome = f"torchrun {how} after {run.t_end - run.t0:.1f} s, {len(results)} RESULT lines"
    errors = [ln for _, name, ln in lines if name == "stderr" and "Error" in ln and "error_file" not in ln]
    run.errors = [ln.strip() for ln in errors]
    if code != 0 and errors and gave_up is None:
        run.notes.append("torchrun stderr, error lines: " + " | ".join(ln.strip()[-200:] for ln in errors[-4:]))
    if code != 0 and results:
        run.notes.append(f"the ranks printed {len(results)} RESULT lines although torchrun failed: "
                         + ", ".join(f"rank {r['rank']} attempt {r['attempt']} {r['steps']} steps" for r in results))
    if run.fault_t is not None:
        agent = [(t, ln) for t, name, ln in lines if name == "stderr" and t >= run.fault_t and _agent_line(ln)
                 and (gave_up is None or t < gave_up)]
        if agent:
            run.detect_t, run.detect_how = agent[0][0], "agent logs: " + agent[0][1].split("] ", 1)[-1][:120]
        elif gave_up is None:
            run.detect_t, run.detect_how = run.t_end, f"torchrun's process ended ({how})"
        run.notes.append("agent lines after the fault: " + " | ".join(
            f"{t - run.t0:.2f} s {ln.split('] ', 1)[-1][:100]}" for t, name, ln in lines
            if name == "stderr" and _agent_line(ln) and t >= run.fault_t and "File " not in ln)[:1200])
    return run


def _agent_line(line: str) -> bool:
    return "torch/distributed/elastic" in line or "torch.distributed.elastic" in line


def restarted(log_dir: str) -> bool:
    return any(e["attempt"] > 0 for e in read_log(log_dir))


def run_dpd(args, fault, log_dir, ckpt_dir) -> Run:
    from dask_ddp.client.cluster import scheduler_workers

    run = Run("dpd", fault)
    with Cluster() as client:
        workers = sorted(scheduler_workers(client))
        run.t0 = time.time()
        port = free_port()
        futures = [client.submit(dpd_dispatch_with_ddp, train, "127.0.0.1", port, rank, len(workers),
                                 backend="gloo", workers=[w], pure=False,
                                 **train_kwargs(args, fault, log_dir, ckpt_dir, "dpd"))
                   for rank, w in enumerate(workers)]
        got: dict = {}

        def gather():
            try:
                got["values"] = client.gather(futures)
            except BaseException as e:  # noqa: BLE001
                got["error"] = e
            got["t"] = time.time()

        th = threading.Thread(target=gather, daemon=True)
        th.start()
        while th.is_alive():
            th.join(0.2)
            ft = fault_time(log_dir)
            if th.is_alive() and ft is not None and time.time() - ft > args.hang_wait:
                run.hung = True
                run.notes.append(f"gather() neither returned nor raised {args.hang_wait:g} s after the fault: "
                                 "the cluster is closed")
                break
            if th.is_alive() and time.time() - run.t0 > args.hang_wait + 180:
                run.notes.append("gave up waiting for gather(): the cluster is closed")
                break
        run.t_end = got.get("t", time.time())
        if "values" in got:
            values = got["values"]
            run.complete = all(v["steps"] == args.steps for v in values)
            run.params = values[0]["params"]
            run.outcome = f"gather(): {len(values)} values"
        elif "error" in got:
            e = got["error"]
            run.outcome = f"gather() raised {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        else:
            run.outcome = "gather() still waiting"
        analyse(run, log_dir)
        if run.fault_t is not None and "t" in got and "error" in got:
            run.detect_t, run.detect_how = got["t"], "client.gather raised " + run.outcome.split(" raised ", 1)[-1]
        time.sleep(1.0)  # let the workers settle: a dead worker's task is rescheduled, a stuck one stays
        try:
            running = client.processing()
        except Exception:  # noqa: BLE001
            running = {}
        keys = {f.key: rank for rank, f in enumerate(futures)}
        stuck = [f"rank {keys[k]}'s task still running on worker {w} (in its thread: cannot be stopped)"
                 for w, ks in running.items() for k in ks if k in keys]
        waiting = [f"rank {rank}'s future {f.status}, its task waits for its (dead) worker {workers[rank]}"
                   for rank, f in enumerate(futures) if f.status == "pending" and
                   not any(f.key in ks for ks in running.values())]
        try:
            pg = [w for w, yes in client.run(_process_group_initialised).items() if yes]
        except Exception as e:  # noqa: BLE001
            pg = [f"(could not ask the workers: {e!r})"]
        groups = [f"a process group still initialised in worker {w} (its next init_process_group fails)"
                  for w in pg]
        run.left = stuck + waiting + groups + worker_leftovers(client, wait=2.0)
        if stuck:
            run.notes.append("a stuck rank task keeps its worker's only thread and the process group: "
                             "the cluster cannot run the next job until it is restarted")
    return run


# ---- report -----------------------------------------------------------------------------------------------------

def fmt_s(x) -> str:
    return "–" if x is None else f"{x:.2f} s"


def cell(run: Run, args) -> str:
    """detect / recover / lost, for the summary table."""
    if run.fault == "none":
        return f"clean run: {'complete' if run.complete else '**incomplete**'}, {run.t_end - run.t0:.1f} s"
    det = f"none within {args.hang_wait:g} s" if run.hung else fmt_s(run.detect)
    rec = fmt_s(run.recover) if run.recover is not None else "no restart"
    lost = "–" if run.lost is None else str(run.lost)
    return f"{det} / {rec} / {lost}" + ("" if run.complete else "; **incomplete**")


def store_verdict(run: Run, args) -> str:
    """What became of a restart under torchrun's default (shared) store."""
    if run.complete:
        return f"restarted and completed: recover {fmt_s(run.recover)}, steps lost {run.lost}"
    if 1 in run.attempts:
        return f"restarted attempt trained up to step {run.attempts[1][1]} but failed: {run.outcome}"
    if run.gave_up:
        return (f"the restarted ranks never trained: no step {args.default_store_wait:g} s after the fault "
                f"(stuck in init_process_group), then SIGTERM; {run.outcome}")
    mesh = [ln for ln in run.errors if "FullMesh" in ln] or [ln for ln in run.errors if "RuntimeError" in ln]
    if mesh:
        why = mesh[-1].split("RuntimeError: ", 1)[-1]
        return f"restart failed in init_process_group: {why[:200]} ({run.outcome})"
    return (f"restarted ranks never trained: no step {args.default_store_wait:g} s after the fault "
            f"(stuck in init_process_group); {run.outcome}")


def report(args, runs: list[Run], store_runs: list[Run], load: dict, total: float, versions: str) -> str:
    by = {(r.launcher, r.fault): r for r in runs}
    launchers = [x for x in LAUNCHERS if any(r.launcher == x for r in runs)]
    faults = [f for f in FAULTS if any(r.fault == f for r in runs)]
    summary = [f"| fault (rank 1, step {args.fault_step}, first attempt only) | "
               + " | ".join(LAUNCHER_LABEL[x] for x in launchers) + " |", "|---|" + "---|" * len(launchers)]
    for f in faults:
        summary.append(f"| {FAULT_LABEL[f]} | " + " | ".join(cell(by[(x, f)], args) if (x, f) in by else "not run"
                                                             for x in launchers) + " |")
    detail = ["| fault | launcher | time to detect | time to recover | steps done in the failed attempt | "
              "resumed from step | steps lost | complete | left behind | how the launcher showed the failure |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for f in faults:
        for x in launchers:
            r = by.get((x, f))
            if r is None:
                continue
            det = f"none within {args.hang_wait:g} s" if r.hung else fmt_s(r.detect)
            how = r.detect_how or (r.outcome if f != "none" else "")
            detail.append(
                f"| {f} | {LAUNCHER_LABEL[x]} | {det} | "
                f"{fmt_s(r.recover) if r.recover is not None else ('–' if f == 'none' else 'no restart')} | "
                f"{'–' if r.done_before is None else r.done_before} | "
                f"{'–' if r.resumed_from is None else r.resumed_from} | {'–' if r.lost is None else r.lost} | "
                f"{'yes' if r.complete else 'no'} | {'; '.join(r.left) or 'none'} | "
                f"{how.replace('|', '/')[:170]} |")
    clean = {r.params for r in runs if r.fault == "none" and r.params}
    resumed = {f"{r.launcher}/{r.fault}": r.params for r in runs if r.fault != "none" and r.complete}
    same = len(clean) == 1 and all(p in clean for p in resumed.values())
    raw = []
    for r in runs + store_runs:
        tag = " (torchrun's default shared store)" if r in store_runs else ""
        step = "–" if r.step_ms is None else f"{r.step_ms:.1f} ms"
        raw.append(f"- **{LAUNCHER_LABEL[r.launcher]}, {r.fault}{tag}**: launch to end {r.t_end - r.t0:.2f} s; "
                   f"fault {fmt_s(None if r.fault_t is None else r.fault_t - r.t0)} after launch; "
                   f"detect {fmt_s(r.detect)}, recover {fmt_s(r.recover)}; steps per attempt (first, last) "
                   f"{r.attempts}; median step {step}; outcome: {r.outcome}; parameters {r.params}")
        raw += [f"  - {n}" for n in r.notes if n]
    shared = []
    if store_runs:
        bad = sum(not r.complete for r in store_runs)
        shared = [
            "",
            "torchrun's default store. The torchrun rows above run with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`. "
            "By default (torch >= 2.5) the ranks' `init_process_group` uses the agent's rendezvous TCPStore, which "
            "outlives a restart, and the restarted ranks' keys carry no attempt prefix "
            "(`torch/distributed/rendezvous.py`: \"no need to add prefix for each attempt\"); gloo can then read "
            "the dead attempt's addresses (the symptom of pytorch/pytorch#135712, reported for nccl). Fault a. "
            f"with the default, {len(store_runs)} runs, waiting {args.default_store_wait:g} s after the fault: "
            f"**{bad} of {len(store_runs)} restarts failed**:",
            "",
        ] + [f"{i + 1}. {store_verdict(r, args)}" for i, r in enumerate(store_runs)]
    cmd = "python benchmarks/bench_faults.py" + "".join(f" {a}" for a in sys.argv[1:])
    out = [
        "# Faults in a 2-rank DDP job: dask-ddp, torchrun and dask-pytorch-ddp's approach",
        "",
        f"Command: `{cmd}` (from the repository root, venv python)  ",
        f"Date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}  ",
        f"Machine: {os.cpu_count()} CPU cores, no GPU, shared; load average (1/5/15 min) "
        + "; ".join(f"{k} {v[0]:.2f}/{v[1]:.2f}/{v[2]:.2f}" for k, v in load.items())
        + f"; {versions}; whole run {total:.0f} s.",
        "",
        f"Training: 2 ranks, gloo on 127.0.0.1, CPU, DDP(Linear(32,64)-ReLU-Linear(64,1)), {args.steps} SGD steps "
        f"(a {args.step_s * 1e3:.0f} ms sleep in each), a checkpoint every {args.ckpt_every} steps, the fault "
        f"injected by rank 1 at the start of step {args.fault_step} of the first attempt only. dask-ddp: "
        f"`dispatch.run(..., max_restarts=1, checkpoint_dir=<tmp>, stall_timeout={args.stall_timeout:g})`; "
        "torchrun: `torchrun --standalone --nproc-per-node 2 --max-restarts 1` (monitor interval: its default, "
        "0.1 s) with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (see below); dask-pytorch-ddp's approach: one "
        "`client.submit` per worker, `client.gather`, no restarts. A fresh 2-worker LocalCluster for every Dask "
        "run. Method: see the docstring of `benchmarks/bench_faults.py`.",
        "",
        "Each cell: time to detect / time to recover / steps lost. \"no restart\": the launcher does not restart; "
        "\"incomplete\": the launcher did not return both ranks' results with every step done.",
        "",
    ] + summary + [
        "",
        "Definitions (every time is `time.time()` on this one machine):",
        "",
        "- **time to detect**: from the fault's timestamp (written by rank 1 just before the fault) to the "
        "launcher's first sign of failure: dask-ddp, the `job.history` transition out of RUNNING; torchrun, the "
        "first line its agent logs about it on stderr (timestamped on arrival), else the end of its process; "
        "dask-pytorch-ddp's approach, `client.gather` raising.",
        "- **time to recover**: from the fault to the end of the first training step of the restarted attempt.",
        "- **steps lost**: steps both ranks completed in the failed attempt minus the step the restarted attempt "
        "resumed from (its newest checkpoint): work done twice. (After a worker's SIGKILL rank 1 carries on "
        "until its launcher stops it, so that attempt can get a step or two past the fault.)",
        "- **complete**: the launcher returned both ranks' results with every step done.",
        "- **left behind**: rank processes (pids from the ranks' logs) still alive once the launcher has "
        "returned or been cleaned up (after up to 10 s), other children of the Dask workers that are not a "
        "warm dask-ddp spare, rank tasks still running in a worker's thread, and process groups still "
        "initialised in a worker.",
        f"- hangs: the benchmark waits {args.hang_wait:g} s (`--hang-wait`) after the fault, then cleans up "
        "(SIGTERM to torchrun; the LocalCluster closed). torchrun and dask-pytorch-ddp's approach would only "
        "notice at the process group's collective timeout, gloo's default 30 min (1800 s), not waited out here. "
        f"dask-ddp's time to detect a hang is its `stall_timeout` ({args.stall_timeout:g} s, counted from each "
        "rank's last report) plus the watcher's poll.",
        "- fault c.: for dask-pytorch-ddp's approach the rank runs in the worker process, so c. is the same "
        "SIGKILL as b.; for torchrun the parent of rank 1 is the torchrun agent, in a standalone run the one "
        "agent of both ranks (no other agent can restart anything).",
        "",
        "Details:",
        "",
    ] + detail + shared + [
        "",
        f"Same final parameters (sha256 of the parameters) in every clean run and every complete run after a "
        f"restart, on every launcher: **{same}** (clean runs {sorted(clean)}; after restarts {resumed}).",
        "",
        "Raw values (seconds after each run's launch unless said otherwise):",
        "",
    ] + raw
    return "\n".join(out) + "\n"


# ---- main -------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hang-wait", type=float, default=60.0,
                    help="seconds to wait after a fault for a launcher to notice it before giving up")
    ap.add_argument("--stall-timeout", type=float, default=5.0, help="dask-ddp's stall_timeout")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--fault-step", type=int, default=25)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--step-s", type=float, default=0.03, help="seconds slept in every step")
    ap.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset of " + ", ".join(FAULTS))
    ap.add_argument("--launchers", default=",".join(LAUNCHERS), help="comma-separated subset of "
                    + ", ".join(LAUNCHERS))
    ap.add_argument("--default-store-tries", type=int, default=3,
                    help="extra torchrun runs of fault a. with torchrun's default shared store (0: none)")
    ap.add_argument("--default-store-wait", type=float, default=20.0,
                    help="seconds after the fault that those runs wait for the restarted attempt to train")
    ap.add_argument("--out", default=str(Path(__file__).with_name("RESULTS_faults.md")))
    args = ap.parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    launchers = [x.strip() for x in args.launchers.split(",") if x.strip()]
    if not faults or set(faults) - set(FAULTS) or not launchers or set(launchers) - set(LAUNCHERS):
        ap.error(f"--faults from {FAULTS}, --launchers from {LAUNCHERS}")
    if not 0 < args.fault_step < args.steps:
        ap.error("--fault-step must lie inside the run")

    import dask
    import distributed
    import torch

    logging.getLogger("dask_ddp").setLevel(logging.WARNING)
    for name in ("distributed", "tornado"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # a killed worker is the point here
    began = time.monotonic()
    load = {"start": os.getloadavg()}
    tmp = tempfile.mkdtemp(prefix="bench-faults-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    script = write_script(tmp)
    runs: list[Run] = []

    def log(msg):
        print(f"[{time.monotonic() - began:6.1f} s] {msg}", flush=True)

    for launcher in launchers:
        for fault in faults:
            name = f"{launcher}-{fault}"
            log_dir, ckpt_dir = os.path.join(tmp, name, "log"), os.path.join(tmp, name, "ckpt")
            os.makedirs(log_dir)
            os.makedirs(ckpt_dir)
            log(f"{LAUNCHER_LABEL[launcher]}: {fault}")
            if launcher == "dask-ddp":
                r = run_dask_ddp(args, fault, log_dir, ckpt_dir)
            elif launcher == "torchrun":
                r = run_torchrun(args, fault, log_dir, ckpt_dir, script)
            else:
                r = run_dpd(args, fault, log_dir, ckpt_dir)
            runs.append(r)
            log(f"  detect {fmt_s(r.detect)}, recover {fmt_s(r.recover)}, lost {r.lost}, "
                f"complete {r.complete}, hung {r.hung}; {r.outcome}; left {r.left or 'none'}")
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    store_runs: list[Run] = []
    for i in range(args.default_store_tries if "torchrun" in launchers else 0):
        name = f"torchrun-shared-store-{i}"
        log_dir, ckpt_dir = os.path.join(tmp, name, "log"), os.path.join(tmp, name, "ckpt")
        os.makedirs(log_dir)
        os.makedirs(ckpt_dir)
        log(f"torchrun with its default shared store: raise ({i + 1}/{args.default_store_tries})")
        r = run_torchrun(args, "raise", log_dir, ckpt_dir, script, shared_store=True, wait=args.default_store_wait)
        store_runs.append(r)
        log(f"  {store_verdict(r, args)}")
        shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    load["end"] = os.getloadavg()
    total = time.monotonic() - began
    md = report(args, runs, store_runs, load, total,
                f"torch {torch.__version__}, dask {dask.__version__}, distributed {distributed.__version__}")
    print()
    print(md)
    with open(args.out, "w") as fh:
        fh.write(md)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Chaos: a rank killed every ``--every`` s for ``--duration`` s of a 3-rank DDP job, three ways, in one run.

With ``--kind hsdp``: a 4-rank HSDP job instead (2 replica groups of 2 ranks, FSDP2 on a 2-D mesh; live:
``live_steps(build=, shards=2)``; restart: ``dask_ddp.save_sharded``/``load_sharded``; torchrun: torch's DCP
``save``/``load``), ranks 1, 2 and 3 killed in turn, a cluster of 5 workers for the live way.

Usage::

    python benchmarks/bench_live_chaos.py [--duration 120] [--every 20] [--out benchmarks/RESULTS_live_chaos.md]
    python benchmarks/bench_live_chaos.py --ways live --hidden 262144   # a 69 MB state to heal
    python benchmarks/bench_live_chaos.py --kind hsdp --duration 300 --out benchmarks/RESULTS_live_chaos_hsdp.md

``--hidden`` widens the model's hidden layer (64: a few KB of state); past 64 the script first times one gloo
broadcast of the state's bytes between two processes (the peer bandwidth a heal can have at best), for the
goal "the replacement back within state bytes / peer bandwidth + 2 s".

1. dask-ddp live: ``dispatch.run(..., recovery="live")`` on a ``LocalCluster`` of 4 workers (3 ranks and a
   free one), the loop under ``dask_ddp.live_steps`` (the plain module, momentum SGD); a lost rank's
   replacement starts on a free worker and heals from the survivors' memory (``ddp.live.max-replacements``
   raised past the kills, as ``max_restarts`` for the restart way: at the default 8, a run of more than 8 kills
   goes on with fewer ranks).
2. dask-ddp restart (today's path): ``DistributedDataParallel``, ``max_restarts=100``, a checkpoint every
   ``--ckpt-every`` steps (10) through ``dask_ddp.save_checkpoint``; each restart resumes from the newest.
3. torchrun: ``torchrun --standalone --nproc-per-node 3 --max-restarts 100``, the same DDP code with
   ``torch.save`` checkpoints (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as in bench_faults.py: torch 2.14.1's
   gloo restarts hang without it).

The training: ``Linear(32, 64) -> ReLU -> Linear(64, 1)``, batches drawn from a generator seeded by (step,
rank), a 30 ms sleep per step (``--step-s``). The driver SIGKILLs the process of rank 1 or 2 (alternately;
rank 0 hosts the store in every launcher) every ``--every`` s, and stops the job after ``--duration`` s
(``job.cancel()``; SIGTERM to torchrun). A clean run of each way, as long, gives its fault-free rate.

Every rank appends a JSON line per event to its own log (``os.write``: on disk before a SIGKILL): ``begin``
(a step starts), ``commit`` (a step's update is applied on this rank), with ``time.time()`` and its pid.
Figures, from the logs and the driver's kill times:

* failure to next committed step: the kill to the first ``commit`` after it, on any rank, of a step whose run
  began after the kill (a step the victim had voted for commits at once: that is no recovery) (median, p95).
* steps redone per failure: live, on the survivor that ran most steps again, its runs of a step beyond the
  first; restart ways, steps committed before the kill beyond the checkpoint the restart resumed from.
* efficiency: the highest step committed by the end over the clean run's; the ideal loses one step per
  failure.
* replacement back (live): the kill to the replacement's first commit.
* job.goodput (the dask-ddp ways): the job's own ledger at the end of the chaos run (issue 42 item 6): its
  productive share of the wall time, and the seconds it counted as recovery and as steps redone.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

if os.path.exists("/sys/class/net/lo"):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
BASE_ENV = dict(os.environ)
WAYS = ("live", "restart", "torchrun")


def train(mode="live", ckpt_every=10, step_s=0.03, log_dir="", ckpt_dir="", launcher="dask-ddp", hidden=64,
          kind="ddp"):
    """Steps until stopped from outside; every event logged (see the module docstring)."""
    import json
    import os
    import time

    import torch
    import torch.distributed as dist
    from torch import nn

    if launcher == "dask-ddp":
        import dask_ddp

        rank = dask_ddp.get_context().rank  # a live job's replacement has no process group yet
    else:
        rank = dist.get_rank()
    fd = os.open(os.path.join(log_dir, f"rank{rank}-{os.getpid()}.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def log(event, **kw):
        os.write(fd, (json.dumps(dict(t=time.time(), rank=rank, pid=os.getpid(), event=event, **kw)) + "\n").encode())

    def batch(step, r):
        gen = torch.Generator().manual_seed(step * 16 + r)
        x = torch.randn(64, 32, generator=gen)
        return x, x[:, :4].sum(dim=1, keepdim=True)

    log("start")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, 1))
    if kind == "hsdp":
        return train_hsdp(mode, ckpt_every, step_s, ckpt_dir, launcher, hidden, log, batch, rank)
    if mode == "live":
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        for step in dask_ddp.live_steps(10**9, model=net, optimizer=opt):
            with step:
                log("begin", step=step.index)
                x, y = batch(step.index, step.rank)
                loss = nn.functional.mse_loss(net(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                time.sleep(step_s)
            if step.committed:
                log("commit", step=step.index)
        return
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    start = 0
    if launcher == "dask-ddp":
        state = dask_ddp.load_checkpoint()
    else:
        names = sorted(n for n in os.listdir(ckpt_dir) if n.startswith("step-"))
        state = torch.load(os.path.join(ckpt_dir, names[-1]), weights_only=True) if names else None
    if state is not None:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = int(state["step"])

    def save(step):
        state = {"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step}
        if launcher == "dask-ddp":
            dask_ddp.save_checkpoint(state, step=step)
        elif rank == 0:
            tmp = os.path.join(ckpt_dir, f".step-{step:09d}.tmp")
            torch.save(state, tmp)
            os.replace(tmp, os.path.join(ckpt_dir, f"step-{step:09d}.pt"))

    restart_steps(model, opt, start, rank, step_s, ckpt_every, log, batch, save)


def train_hsdp(mode, ckpt_every, step_s, ckpt_dir, launcher, hidden, log, batch, rank):
    """The HSDP job (2 replica groups of 2 ranks, FSDP2 on gloo) of :func:`train`, the same model and steps."""
    import os
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    def build(mesh):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        for block in (net[0], net[2], net):
            fully_shard(block, mesh=mesh)
        return net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    if mode == "live":
        import dask_ddp

        for step in dask_ddp.live_steps(10**9, build=build, shards=2):
            with step:
                log("begin", step=step.index)
                x, y = batch(step.index, step.rank)
                loss = nn.functional.mse_loss(step.model(x), y)
                step.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                step.optimizer.step()
                time.sleep(step_s)
            if step.committed:
                log("commit", step=step.index)
        return
    from torch.distributed.device_mesh import init_device_mesh

    net, opt = build(init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("replicate", "shard")))
    start = 0
    if launcher == "dask-ddp":
        import dask_ddp

        state = {"model": net, "optim": opt, "step": 0}
        start = dask_ddp.load_sharded(state) or 0
    else:  # torch's own DCP, each step in a folder renamed into place once every rank has written
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        names = sorted(n for n in os.listdir(ckpt_dir) if n.startswith("step-"))
        if names:
            msd, osd = get_state_dict(net, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=os.path.join(ckpt_dir, names[-1]))
            set_state_dict(net, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            start = int(names[-1].split("-")[1])

    def save(step):
        if launcher == "dask-ddp":
            dask_ddp.save_sharded({"model": net, "optim": opt, "step": step}, step)
        else:
            msd, osd = get_state_dict(net, opt)
            tmp = os.path.join(ckpt_dir, f".tmp-{step:09d}")
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)
            dist.barrier()
            if rank == 0:
                os.replace(tmp, os.path.join(ckpt_dir, f"step-{step:09d}"))

    restart_steps(net, opt, start, rank, step_s, ckpt_every, log, batch, save)


def restart_steps(model, opt, start, rank, step_s, ckpt_every, log, batch, save):
    """The restart ways' loop (DDP and HSDP alike): steps from ``start`` until stopped, ``save(step)`` every
    ``ckpt_every`` steps."""
    import time

    from torch import nn

    log("resume", step=start)
    step = start
    while True:
        log("begin", step=step)
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        time.sleep(step_s)
        log("commit", step=step)
        step += 1
        if step % ckpt_every == 0:
            save(step)


def _events(log_dir: Path) -> list[dict]:
    out = []
    for path in log_dir.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut by a SIGKILL
                pass
    return sorted(out, key=lambda e: e["t"])


def _current_pid(log_dir: Path, rank: int) -> int | None:
    starts = [e for e in _events(log_dir) if e["rank"] == rank and e["event"] == "start"]
    return starts[-1]["pid"] if starts else None


def _chaos(way: str, duration: float, every: float, args, work: Path) -> dict:
    """One run of ``way``: killing every ``every`` s (0: a clean run); returns its figures."""
    log_dir, ckpt_dir = work / f"{way}-{every}-logs", work / f"{way}-{every}-ckpt"
    for d in (log_dir, ckpt_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    kw = dict(mode="live" if way == "live" else "restart", ckpt_every=args.ckpt_every, step_s=args.step_s,
              log_dir=str(log_dir), ckpt_dir=str(ckpt_dir), launcher="torchrun" if way == "torchrun" else "dask-ddp",
              hidden=args.hidden, kind=args.kind)
    ranks = 4 if args.kind == "hsdp" else 3
    kills, stop = [], None
    if way == "torchrun":
        script = work / "chaos_train.py"
        script.write_text("import torch.distributed as dist\n" + textwrap.dedent(inspect.getsource(train)) +
                          textwrap.dedent(inspect.getsource(train_hsdp)) +
                          textwrap.dedent(inspect.getsource(restart_steps)) +
                          f"\ndist.init_process_group('gloo')\ntrain(**{kw!r})\n")
        env = {**BASE_ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 str(ranks), "--max-restarts", "100", "--local-addr", "127.0.0.1", str(script)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        stop = lambda: os.killpg(proc.pid, signal.SIGTERM)  # noqa: E731
        cluster = client = job = None
    else:
        import dask
        from dask.distributed import Client, LocalCluster

        import dask_ddp

        dask.config.set({"ddp.live.max-replacements": 10_000})  # as max_restarts=100: never the limit here
        cluster = LocalCluster(n_workers=ranks + 1 if way == "live" else ranks, threads_per_worker=1,
                               host="127.0.0.1", dashboard_address=None)
        client = Client(cluster)
        dask_ddp.dispatch.warm_up(client)
        opts = dict(recovery="live", workers=ranks) if way == "live" else dict(max_restarts=100,
                                                                           checkpoint_dir=str(ckpt_dir))
        job = dask_ddp.dispatch.run(client, train, progress=False, **opts, **kw)
        stop = job.cancel
    while not any(e["event"] == "commit" for e in _events(log_dir)):  # timed from the first step
        time.sleep(0.05)
    began = time.time()
    victims = list(range(1, ranks))  # rank 0 hosts the store in every launcher
    while time.time() - began < duration:
        nap = every - (time.time() - began) % every if every else duration - (time.time() - began)
        time.sleep(max(0.0, min(nap, duration - (time.time() - began))))
        if every and time.time() - began < duration - 1:
            victim = victims[len(kills) % len(victims)]
            pid = _current_pid(log_dir, victim)
            if pid is not None:
                kills.append((time.time(), victim, pid))
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    kills.pop()
    ended = time.time()
    history = list(job.history) if job is not None else []
    spent = job.goodput.loc["job"].to_dict() if job is not None else {}  # dask-ddp's own ledger of the time
    stop()
    if way == "torchrun":
        proc.wait(timeout=60)
    else:
        client.close()
        cluster.close()
    if os.environ.get("CHAOS_KEEP"):
        print(json.dumps({"way": way, "every": every, "goodput": spent, "history": [h[-1] for h in history]}))
    return {**_figures(_events(log_dir), kills, began, ended, history), "goodput": spent}


def _figures(events: list[dict], kills: list, began: float, ended: float, history: list) -> dict:
    commits = [e for e in events if e["event"] == "commit" and e["t"] <= ended]
    top = max((e["step"] for e in commits), default=-1) + 1
    to_next, redone, back, detect = [], [], [], []
    for i, (t, rank, pid) in enumerate(kills):
        until = kills[i + 1][0] if i + 1 < len(kills) else ended
        after = [e for e in commits if t < e["t"] <= until]
        begun = {}  # (pid, step) -> the time its last run began
        for e in events:
            if e["event"] == "begin" and e["t"] <= until:
                begun[(e["pid"], e["step"])] = e["t"]
        fresh = [e for e in after if begun.get((e["pid"], e["step"]), 0) > t]  # run again (or first) after the kill
        if fresh:
            to_next.append(fresh[0]["t"] - t)
        before = max((e["step"] for e in commits if e["t"] <= t), default=-1)
        resumed = [e["step"] for e in events if e["event"] == "resume" and t < e["t"] <= until]
        if resumed:  # a restart: what was committed past the checkpoint it resumed from is done again
            redone.append(max(0, before + 1 - min(resumed)))
        else:  # live: on the survivor that ran most again, its runs of a step beyond the first
            runs: dict[int, list[int]] = {}
            for e in events:
                if e["event"] == "begin" and t - 1 < e["t"] <= until and e["pid"] != pid:
                    runs.setdefault(e["pid"], []).append(e["step"])
            redone.append(max((len(s) - len(set(s)) for s in runs.values()), default=0))
            new = [e for e in after if e["rank"] == rank and e["pid"] != pid]
            if new:
                back.append(new[0]["t"] - t)
        notes = [h[0] for h in history if h[0] >= t and h[0] <= until and "rank" in h[3]]
        if notes:
            detect.append(notes[0] - t)
    return {"top": top, "kills": len(kills), "seconds": ended - began, "to_next": to_next, "redone": redone,
            "back": back, "detect": detect}


def _p95(xs):
    return sorted(xs)[max(0, int(round(0.95 * len(xs))) - 1)] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--every", type=float, default=20.0)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--step-s", type=float, default=0.03)
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--hidden", type=int, default=64, help="the hidden layer's width (the state's size)")
    ap.add_argument("--kind", choices=("ddp", "hsdp"), default="ddp",
                    help="ddp: 3 ranks; hsdp: 4 ranks, 2 replica groups of 2, FSDP2")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    state = (32 * args.hidden + 2 * args.hidden + 1) * 4 * 2  # fp32 parameters and SGD's momentum
    if args.hidden > 64:  # the goal: the replacement back within state / peer bandwidth + 2 s
        seconds = _peer_seconds(state)
        print(json.dumps({"state_bytes": state, "gloo_broadcast_s": seconds, "mb_s": state / seconds / 1e6}),
              flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-live-chaos-"))
    rows = []
    try:
        for way in args.ways.split(","):
            clean = _chaos(way, args.duration, 0, args, work)
            chaos = _chaos(way, args.duration, args.every, args, work)
            rate = clean["top"] / clean["seconds"]
            step_time = 1 / rate if rate else float("nan")
            expected = rate * chaos["seconds"]
            ideal = 1 - chaos["kills"] * step_time / chaos["seconds"]
            row = {"way": way, "clean_steps_per_s": round(rate, 2), "kills": chaos["kills"],
                   "to_next_median": statistics.median(chaos["to_next"]) if chaos["to_next"] else None,
                   "to_next_p95": _p95(chaos["to_next"]), "redone": chaos["redone"],
                   "detect_median": statistics.median(chaos["detect"]) if chaos["detect"] else None,
                   "back_median": statistics.median(chaos["back"]) if chaos["back"] else None,
                   "efficiency": chaos["top"] / expected if expected else None, "ideal": ideal,
                   "goodput": chaos["goodput"].get("goodput"),
                   "recovery_s": chaos["goodput"].get("recovery_s"), "redone_s": chaos["goodput"].get("redone_s")}
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        if not os.environ.get("CHAOS_KEEP"):
            shutil.rmtree(work, ignore_errors=True)
    if args.out:
        _write(Path(args.out), rows, args)


PEER = """
import sys, time, torch, torch.distributed as dist
rank, port, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
t = torch.zeros(n // 4)
took = []
for _ in range(5):
    dist.barrier()
    began = time.perf_counter()
    dist.broadcast(t, 0)
    took.append(time.perf_counter() - began)
if rank == 1:
    print(sorted(took)[2])
"""


def _peer_seconds(nbytes: int) -> float:
    """Seconds of one gloo broadcast of ``nbytes`` between two processes on this machine (median of 5): the
    peer bandwidth the replacement's heal can have at best."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", PEER, str(r), str(port), str(nbytes)], env=BASE_ENV,
                              stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    out = [p.communicate(timeout=300)[0] for p in procs]
    return float(out[1].strip())


def _write(path: Path, rows: list[dict], args) -> None:
    def f(x, fmt="{:.2f} s"):
        return "n/a" if x is None or x != x else fmt.format(x)

    what = "3 ranks" if args.kind == "ddp" else "HSDP: 4 ranks, 2 replica groups of 2, FSDP2"
    lines = [f"# Chaos: a rank killed every {args.every:g} s for {args.duration:g} s ({what}, gloo, CPU)", "",
             f"`python benchmarks/bench_live_chaos.py{'' if args.ways == ','.join(WAYS) else ' --ways ' + args.ways}"
             f"{'' if args.kind == 'ddp' else ' --kind ' + args.kind}"
             f"{'' if args.hidden == 64 else f' --hidden {args.hidden}'} --duration {args.duration:g} "
             f"--every {args.every:g}`, "
             f"{datetime.date.today()}, the 2-core machine (shared: figures vary by ~30 % from run to run). "
             "How each figure is taken: the script's docstring.", "",
             "| way | clean steps/s | kills | failure to next committed step, median / p95 | steps redone per "
             "failure | detection, median | replacement back, median | efficiency (ideal) | job.goodput: "
             "productive share, recovery, redone |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['way']} | {f(r['clean_steps_per_s'], '{:.1f}')} | {r['kills']} | "
                     f"{f(r['to_next_median'])} / {f(r['to_next_p95'])} | {', '.join(map(str, r['redone'])) or 'n/a'} "
                     f"| {f(r['detect_median'])} | {f(r['back_median'])} | {f(r['efficiency'], '{:.1%}')} "
                     f"({f(r['ideal'], '{:.1%}')}) | {f(r['goodput'], '{:.1%}')}, {f(r['recovery_s'])}, "
                     f"{f(r['redone_s'])} |")
    lines += ["", "Raw rows:", "", "```", *(json.dumps(r) for r in rows), "```", ""]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    main()

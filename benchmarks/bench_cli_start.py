"""The command line's cold start against torchrun's, whole command to exit, and where the time goes.

Usage::

    python benchmarks/bench_cli_start.py [--rounds 5] [--out benchmarks/RESULTS_cli_start.md]

For each script, unchanged, in one sitting: ``dask-ddp run --workers 2 SCRIPT`` (its own fresh local cluster)
and ``torchrun --standalone --nproc-per-node 2 SCRIPT``, in turn (ABBA: each pair of rounds starts with the other
side), ``--rounds`` times each, timed from the command's start to its exit. The scripts: a plain DDP script (20
SGD steps of ``DDP(Linear)``, gloo) and the three trainer examples of ``examples/trainers/`` (under torchrun with
the variables those scripts need there: ``ACCELERATE_USE_CPU``, ``PL_TRAINER_DEVICES``). Every run must print its
``RESULT`` line and exit 0, or the benchmark stops.

**Cold**: before each dask-ddp round the benchmark waits until no zygote host of an earlier command is left (it
outlives its last zygote by ``ddp.zygote-host-idle`` s, 5 by default): every round imports torch afresh, as a
command on a machine that ran nothing for a while. **Back to back**: a second dask-ddp command right after the
first (the host still warm), as a user trying again or a script of commands.

Where the time goes (the plain script, one cold round of each side, marks written by the script): command
start to the script's first line on rank 0, the script itself, its last line to the command's exit; and for
dask-ddp, the same path replayed in one process with the CLI's own functions (imports, local cluster start with
its TLS material, the client, the zygote ready, the job, the close).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

DDP_SCRIPT = '''
import os, time
mark = os.environ.get("BENCH_MARKS")
if mark and os.environ.get("RANK", "0") == "0":
    open(os.path.join(mark, "first"), "w").write(repr(time.time()))
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(32, 32))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(20):
    opt.zero_grad()
    model(torch.randn(8, 32)).sum().backward()
    opt.step()
if dist.get_rank() == 0:
    print("RESULT", dist.get_world_size(), round(float(model.module.weight.detach().sum()), 4))
    if mark:
        open(os.path.join(mark, "last"), "w").write(repr(time.time()))
dist.destroy_process_group()
'''

TORCHRUN_ENV = {"ACCELERATE_USE_CPU": "true", "PL_TRAINER_DEVICES": "2", "PL_TRAINER_NUM_NODES": "1"}

REPLAY = '''
import time, sys, os
import psutil
born = psutil.Process().create_time()
marks = [("interpreter start", born)]
def mark(name):
    marks.append((name, time.time()))
mark("interpreter up")
from dask_ddp.cli import common, script as scripts
mark("CLI imports")
if __name__ == "__main__":
    loaded = scripts.load_script(sys.argv[1], [])
    with common.open_client(None, 2, dask_cuda=False) as client:
        mark("local cluster (TLS) and client")
        from dask_ddp.client import dispatch
        mark("import dispatch")
        job = dispatch.run(client, scripts.run_script, loaded, progress=False)
        job.result()
        mark("job (zygote wait, fork, rendezvous, script, results)")
    mark("cluster closed")
    print("MARKS", repr(marks))
'''


def zygote_hosts() -> list[int]:
    """Pids of this user's zygote hosts left by an earlier command."""
    out = subprocess.run(["pgrep", "-u", str(os.getuid()), "-f", "dask_ddp.rank.zygote_host"], capture_output=True,
                         text=True)
    return [int(p) for p in out.stdout.split()]


def wait_no_host(limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while zygote_hosts() and time.monotonic() < deadline:
        time.sleep(0.2)
    if zygote_hosts():
        raise SystemExit(f"a zygote host outlived {limit} s: {zygote_hosts()}")


def command(side: str, script: str) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if side == "dask-ddp":
        return [str(BIN / "dask-ddp"), "run", "--workers", "2", script], env
    return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", script], {**env, **TORCHRUN_ENV}


def timed(side: str, script: str, marks: str | None = None) -> float:
    cmd, env = command(side, script)
    if marks:
        env["BENCH_MARKS"] = marks
    started = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    took = time.time() - started
    if proc.returncode != 0 or "RESULT" not in proc.stdout + proc.stderr:
        raise SystemExit(f"{side} {script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    if marks:
        Path(marks, "start").write_text(repr(started))
        Path(marks, "end").write_text(repr(started + took))
    return took


def rounds(script: str, count: int) -> dict:
    out: dict = {"dask-ddp": [], "torchrun": [], "back to back": []}
    for i in range(count):
        order = ["dask-ddp", "torchrun"] if i % 2 == 0 else ["torchrun", "dask-ddp"]
        for side in order:
            if side == "dask-ddp":
                wait_no_host()
                out[side].append(timed(side, script))
                out["back to back"].append(timed(side, script))  # the host from the run before still warm
            else:
                out[side].append(timed(side, script))
    return out


def split(side: str, script: str) -> list[tuple[str, float]]:
    """Command start -> rank 0's first line -> its last line -> exit, one cold run."""
    with tempfile.TemporaryDirectory() as marks:
        wait_no_host()
        timed(side, script, marks)
        t = {n: float(Path(marks, n).read_text()) for n in ("start", "first", "last", "end")}
    return [("to the script's first line", t["first"] - t["start"]), ("the script", t["last"] - t["first"]),
            ("its last line to the exit", t["end"] - t["last"])]


def replay(script: str) -> list[tuple[str, float]]:
    wait_no_host()
    proc = subprocess.run([sys.executable, "-c", REPLAY, script], capture_output=True, text=True, cwd=ROOT)
    line = [x for x in proc.stdout.splitlines() if x.startswith("MARKS ")]
    if proc.returncode != 0 or not line:
        raise SystemExit(f"the replay failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    marks = eval(line[0][6:])  # noqa: S307 - our own child's repr of a list of (str, float)
    return [(name, t - marks[i - 1][1]) for i, (name, t) in enumerate(marks) if i]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default=None, help="run only the script whose name contains this")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        ddp = Path(tmp, "ddp_plain.py")
        ddp.write_text(DDP_SCRIPT)
        scripts = [("plain DDP (20 steps, gloo)", str(ddp))] + [
            (f"examples/trainers/{n}_tiny.py", str(ROOT / "examples" / "trainers" / f"{n}_tiny.py"))
            for n in ("transformers", "lightning", "accelerate")]
        if args.only:
            scripts = [s for s in scripts if args.only in s[0]]
        results = {name: rounds(path, args.rounds) for name, path in scripts}
        splits = {side: split(side, str(ddp)) for side in ("dask-ddp", "torchrun")}
        ours = replay(str(ddp))
    lines = [f"# The CLI's cold start against torchrun ({time.strftime('%Y-%m-%d')}, {platform.node()}, "
             f"{os.cpu_count()} cores, CPU)", "",
             f"`python benchmarks/bench_cli_start.py --rounds {args.rounds}`: whole command to exit, 2 ranks, gloo. "
             f"Load average (1 min) {load:.1f} before, {os.getloadavg()[0]:.1f} after.", "",
             "| script | dask-ddp run, cold: median (min-max) s | torchrun: median (min-max) s | dask-ddp / torchrun "
             "| dask-ddp run, back to back: median s | / torchrun |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        a, b, c = (statistics.median(r[k]) for k in ("dask-ddp", "torchrun", "back to back"))
        lines.append(f"| {name} | {a:.2f} ({min(r['dask-ddp']):.2f}-{max(r['dask-ddp']):.2f}) | {b:.2f} "
                     f"({min(r['torchrun']):.2f}-{max(r['torchrun']):.2f}) | **{a / b:.2f}x** | {c:.2f} | "
                     f"{c / b:.2f}x |")
    lines += ["", "Where the time goes, plain DDP script, one cold run of each (s):", "",
              "| part | dask-ddp run | torchrun |", "|---|---:|---:|"]
    for (name, a), (_, b) in zip(splits["dask-ddp"], splits["torchrun"]):
        lines.append(f"| {name} | {a:.2f} | {b:.2f} |")
    lines += ["", "dask-ddp's path replayed in one process with the CLI's functions (cold; s):", "",
              "| part | s |", "|---|---:|"]
    lines += [f"| {name} | {t:.2f} |" for name, t in ours]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

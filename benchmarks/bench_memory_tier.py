"""The memory tier's price per step (issue 42): plain FSDP2 under ``live_steps(build=)``, snapshots every step.

Usage::

    python benchmarks/bench_memory_tier.py [--hidden 1024] [--steps 60] [--ranks 3] \
        [--out benchmarks/RESULTS_memory_tier.md]

One run, on one ``LocalCluster`` (``--ranks`` worker processes, gloo on CPU; nccl where each worker has a GPU),
the same FSDP2 model (``--layers`` x ``Linear(hidden, hidden)``, Adam: the state is 3x the parameters) and the
same steps, four ways, each ``--repeats`` times in turn (ABCD ABCD ...: the machine's drift is shared):

1. ``live, tier on``: ``live_steps(build=)``, each step's shards snapshotted to host memory and sent to a peer.
2. ``live, tier off``: the same loop with ``memory_budget=0`` (no snapshot): the live loop's own price.
3. ``plain FSDP2``: the same model and steps without ``live_steps`` (no vote, no snapshot).
4. ``DCP async_save every step``: the plain loop saving its state every step with torch's
   ``torch.distributed.checkpoint.async_save`` to ``/dev/shm`` (the peer's fastest path to a copy of every step
   off the rank; on a gloo group of its own, as torch's docs ask: on the training group its background
   collectives cross the step's and gloo aborts; the next save waits for the previous one).

Each rank times its steps (``perf_counter`` around each step, from step 5 on); the figure is the median over
ranks and steps of each way, pooled over the repeats. The overhead of a way is its median step over the plain
loop's. The goal in issue 42 (a GPU figure): the tier's overhead <= 1 % of the step at every-step snapshots.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

WAYS = ("live, tier on", "live, tier off", "plain FSDP2", "DCP async_save every step")


def train(way: str, steps: int, hidden: int, layers: int, folder: str):
    """``steps`` steps of ``way``; returns this rank's step times from step 5 on and the state's local bytes."""
    import time

    import torch
    from torch import nn

    import dask_ddp

    torch.set_num_threads(1)
    ctx = dask_ddp.get_context()
    dev = ctx.device if getattr(ctx.device, "type", "cpu") == "cuda" else torch.device("cpu")

    def build(mesh):
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(layers)]).to(dev)
        dask_ddp.shard_model(net, mesh=mesh)
        return net, torch.optim.Adam(net.parameters(), lr=1e-4)

    def batch(i, rank):
        g = torch.Generator().manual_seed(i * 100 + rank)
        return torch.randn(32, hidden, generator=g).to(dev)

    times = []
    if way.startswith("live"):
        budget = None if way == "live, tier on" else 0
        for step in dask_ddp.live_steps(steps, build=build, memory_budget=budget):
            began = time.perf_counter()
            with step:
                loss = step.model(batch(step.index, step.rank)).pow(2).mean()
                step.optimizer.zero_grad()
                loss.backward()
                step.optimizer.step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
        model = step.model
    else:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, opt = build(dask_ddp.device_mesh())
        pending, side = None, dist.new_group(backend="gloo")  # async_save's collectives: a group of their own
        for i in range(steps):
            began = time.perf_counter()
            loss = model(batch(i, ctx.rank)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if way.startswith("DCP"):
                if pending is not None:
                    pending.result()
                msd, osd = get_state_dict(model, opt)
                pending = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(folder, f"s{i}"),
                                         process_group=side)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
        if pending is not None:
            pending.result()
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {"times": times[5:], "param_bytes": local}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from dask.distributed import Client, LocalCluster

    import dask_ddp

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    folder = tempfile.mkdtemp(prefix="bench-memory-tier-", dir=shm)
    pooled: dict[str, list[float]] = {w: [] for w in WAYS}
    state_bytes = 0
    try:
        with LocalCluster(n_workers=args.ranks, threads_per_worker=1, host="127.0.0.1",
                          dashboard_address=None) as cluster, Client(cluster) as client:
            dask_ddp.dispatch.warm_up(client)
            for r in range(args.repeats):
                for way in WAYS:
                    sub = os.path.join(folder, f"{r}-{WAYS.index(way)}")
                    os.makedirs(sub)
                    out = dask_ddp.dispatch.run(client, train, way, args.steps, args.hidden, args.layers, sub,
                                                recovery="live" if way.startswith("live") else "restart",
                                                progress=False).result(timeout=1800)
                    for o in out:
                        pooled[way] += o["times"]
                    state_bytes = sum(o["param_bytes"] for o in out) * 3  # parameters and Adam's two moments
                    shutil.rmtree(sub, ignore_errors=True)
                    print(json.dumps({"repeat": r, "way": way, "median_ms": 1000 * statistics.median(
                        [t for o in out for t in o["times"]])}), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    base = statistics.median(pooled["plain FSDP2"])
    rows = [{"way": w, "median_ms": 1000 * statistics.median(pooled[w]), "overhead": statistics.median(pooled[w]) / base
             - 1, "n": len(pooled[w])} for w in WAYS]
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out:
        _write(Path(args.out), rows, args, state_bytes)


def _write(path: Path, rows: list[dict], args, state_bytes: int) -> None:
    lines = [f"# The memory tier's price per step ({args.ranks} ranks, FSDP2, gloo, CPU)", "",
             f"`python benchmarks/bench_memory_tier.py --hidden {args.hidden} --layers {args.layers} --steps "
             f"{args.steps} --ranks {args.ranks} --repeats {args.repeats}`, {datetime.date.today()}, the 2-core "
             f"machine (shared). State: {state_bytes / 2**20:.1f} MiB (parameters and Adam's moments), "
             f"{state_bytes / args.ranks / 2**20:.1f} MiB per rank snapshotted every step. How each figure is taken: "
             "the script's docstring.", "",
             "| way | median step | over plain FSDP2 | steps timed |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['way']} | {r['median_ms']:.1f} ms | {r['overhead']:+.1%} | {r['n']} |")
    lines += ["", "Raw rows:", "", "```", *(json.dumps(r) for r in rows), "```", ""]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    main()

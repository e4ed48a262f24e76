"""The growth of dispatch latency and of the scheduler's CPU with the number of ranks, as one PNG.

Usage::

    python benchmarks/plot_scale.py [--out benchmarks/scale.png]

Reads the tables of ``RESULTS_scale.md`` (``bench_scale.py``: seconds from ``run()`` to the results for 2 to
16 ranks, dask-ddp warm, back to back and cold, and ``torchrun --standalone``) and ``RESULTS_events_scale.md``
(``bench_events_scale.py``: the scheduler's CPU per event batch with many sending workers), and draws:

* left: latency against ranks, log-log, each launcher a line;
* right: dask-ddp's share of one scheduler core against ranks (1 to 1,000), from the measured CPU per batch:
  with the rule dask-ddp applies (a job sends at most ``ddp.events.max-batches-per-second`` batches, each rank
  flushing every ``max(flush-interval, ranks / max)`` s) and, for comparison, one batch per rank per second
  (the rule before), and with hubs of 8 ranks a host (``ddp.events.per-host``); the measured rows (real
  senders) as points.
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent


def table(path: Path) -> list[list[str]]:
    """The rows of the first markdown table in ``path`` whose cells start with a number, as lists of cells."""
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells and re.fullmatch(r"\d+", cells[0]):
            rows.append(cells)
    return rows


def number(cell: str) -> float:
    return float(re.search(r"[\d.]+", cell)[0])


def main(argv=None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import yaml

    from dask_ddp.client.launch import HUB_COST_PER_RANK

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(HERE / "scale.png"))
    args = p.parse_args(argv)

    scale = table(HERE / "RESULTS_scale.md")
    ranks = [int(r[0]) for r in scale]
    series = {"dask-ddp, warm": 2, "dask-ddp, back to back": 3, "dask-ddp, cold (first job)": 1, "torchrun": 4}
    events = table(HERE / "RESULTS_events_scale.md")
    kept = [r for r in events if "left out" not in r[-1] and "starved" not in " ".join(r)]
    # columns: senders, ranks per event, interval, events/s, idle %, sending %, ms/event, ...
    plain = [r for r in kept if number(r[1]) == 1 and number(r[2]) == 1.0]
    per_batch = statistics.median(number(r[6]) for r in plain) / 1000  # CPU s per batch
    cfg = yaml.safe_load((HERE.parent / "dask_ddp" / "ddp.yaml").read_text())["ddp"]["events"]
    cap, interval = cfg["max-batches-per-second"], cfg["flush-interval"]

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, col in series.items():
        left.plot(ranks, [number(r[col]) for r in scale], marker="o", label=label)
    left.set(xscale="log", yscale="log", xlabel="ranks (one 2-core machine)", ylabel="s from run() to results",
             title="Dispatch latency, 20 DDP steps")
    left.set_xticks(ranks, [str(n) for n in ranks])
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)

    world = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    ruled = [100 * per_batch * n / max(interval, n / cap) for n in world]
    naive = [100 * per_batch * n / interval for n in world]
    right.plot(world, ruled, marker="o", label=f"dask-ddp: at most {cap:g} batches/s a job")
    weight = 1 + HUB_COST_PER_RANK * 7  # hubs of 8 ranks: one event a host, weighted (launch.hub_plan)
    hubbed = [100 * per_batch * weight * -(-n // 8) / max(interval, -(-n // 8) * weight / cap) for n in world]
    right.plot(world, hubbed, marker=".", linestyle=":", label="dask-ddp with hubs, 8 ranks a host")
    right.plot(world, naive, linestyle="--", label=f"one batch per rank every {interval:g} s")
    # rows at 1 s: N senders of k ranks are N k ranks; the one-rank row at the interval the rule gives 1,000
    # ranks: projected to 1,000; the hub row at its interval: 1,000 ranks' batches, measured as they are
    measured = [(number(r[0]) * number(r[1]), number(r[5]) - number(r[4]))
                if number(r[2]) == 1.0 or number(r[1]) > 1
                else (1000, (number(r[5]) - number(r[4])) * 1000 / number(r[0])) for r in kept]
    right.scatter([m[0] for m in measured], [m[1] for m in measured], color="black", zorder=3,
                  label="measured: scheduler CPU, sending - idle\n(at 1,000: N senders at its interval, x 1000/N;\n125 hubs of 8 as measured)")
    right.axhline(10, color="grey", linewidth=0.8)
    right.text(1.2, 11, "goal: 10 % of one core", fontsize=8, color="grey")
    right.set(xscale="log", yscale="log", xlabel="ranks", ylabel="% of one scheduler core",
              title=f"Scheduler CPU for events ({1000 * per_batch:.2f} ms a batch)")
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

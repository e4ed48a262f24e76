"""Trainers under dask-ddp (issue 43): a second Transformers job with and without preloading, beside torchrun;
the callback's price per step.

Usage::

    python benchmarks/bench_trainers.py [--repeats 3] [--steps 300] [--out benchmarks/RESULTS_trainers.md]

One run, 2 ranks (gloo on CPU), the same script: ``examples/trainers/transformers_tiny.py`` (a 1-layer GPT-2 from a
config, 8 steps).

1. **Run to result**, each way ``--repeats`` times in turn (ABC ABC ...): ``dask_ddp.dispatch.run`` of the script
   (``runpy``, as ``dask-ddp run`` runs it) on a warm ``LocalCluster`` of 2 workers, the job after a first one
   (the cluster warm); the same with ``ddp.zygote-preload: [transformers]`` (a second cluster); and
   ``torchrun --nproc_per_node 2`` of the script (``ACCELERATE_USE_CPU=true``: distributed, as the ranks are), from
   its start to its exit: what a torchrun user waits for every run.
2. **The callback's price**: ``Trainer.train()`` of ``--steps`` steps of the same model, with and without
   ``DaskDDPCallback`` (metrics every 10 steps), paired in turn in one job (AB BA AB ...); the figure is the median
   of the pairs' ratios of step time (``train_runtime / steps``), beside the hooks of one step timed alone. The
   goal in issue 43: <= 1 %.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "trainers" / "transformers_tiny.py"


def run_script(path: str):
    import runpy

    runpy.run_path(path, run_name="__main__")


def priced(steps: int, pairs: int):
    """``pairs`` x (train without the callback, train with it), each ``steps`` steps; seconds a step of each."""
    import tempfile

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from dask_ddp.integrations.transformers import DaskDDPCallback

    tokens = torch.randint(0, 64, (4096, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    times: dict[str, list[float]] = {"without": [], "with": []}
    for pair in range(pairs):
        for way in (("without", "with") if pair % 2 == 0 else ("with", "without")):  # ABBA: drift shared
            torch.manual_seed(0)
            model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                               bos_token_id=0, eos_token_id=0))
            args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=steps,
                                     logging_steps=10, save_strategy="no", report_to=[], seed=0, disable_tqdm=True)
            callbacks = [DaskDDPCallback()] if way == "with" else []
            trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
            out = trainer.train()
            times[way].append(out.metrics["train_runtime"] / steps)
    return times, hook_cost()


def hook_cost(n: int = 20000) -> float:
    """Seconds one step's hooks of the callback take (on_step_end, no logging step, no notice), timed alone."""
    import time
    from types import SimpleNamespace

    from dask_ddp.integrations.transformers import DaskDDPCallback

    callback = DaskDDPCallback()
    control = SimpleNamespace(should_log=False, should_save=False)
    started = time.perf_counter()
    for step in range(1, n + 1):
        callback.on_step_end(None, SimpleNamespace(global_step=step), control)
    return (time.perf_counter() - started) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS_trainers.md"))
    a = parser.parse_args()

    import dask
    from dask.distributed import Client, LocalCluster

    import dask_ddp

    def cluster(preload: bool):
        with dask.config.set({"ddp.zygote-preload": ["transformers"] if preload else []}):
            c = LocalCluster(n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address=":0")
        return c, Client(c)

    ways = {"dask-ddp, warm": cluster(False), "dask-ddp, warm, preloaded": cluster(True)}
    for _, client in ways.values():  # the first job of each cluster: the warm process starts (and preloads)
        dask_ddp.dispatch.run(client, run_script, str(SCRIPT), progress=False).result(timeout=600)
    seconds: dict[str, list[float]] = {w: [] for w in (*ways, "torchrun")}
    env = dict(os.environ, ACCELERATE_USE_CPU="true")
    for _ in range(a.repeats):
        for way, (_, client) in ways.items():
            t = time.perf_counter()
            dask_ddp.dispatch.run(client, run_script, str(SCRIPT), progress=False).result(timeout=600)
            seconds[way].append(time.perf_counter() - t)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(SCRIPT)], check=True, env=env, capture_output=True)
        seconds["torchrun"].append(time.perf_counter() - t)
    _, client = ways["dask-ddp, warm"]
    per_step, hook = dask_ddp.dispatch.run(client, priced, a.steps, a.pairs, progress=False).result(timeout=1800)[0]
    for c, client in ways.values():
        client.close()
        c.close()

    torchrun = statistics.median(seconds["torchrun"])
    lines = [f"# Trainers: run to result, and the callback's price ({datetime.date.today()})", "",
             f"`python benchmarks/bench_trainers.py --repeats {a.repeats} --steps {a.steps} --pairs {a.pairs}`, one "
             f"run, 2 ranks, gloo on CPU, {os.cpu_count()} cores; the script: "
             "`examples/trainers/transformers_tiny.py`.",
             "", "| way | run to result, median (s) | each run (s) | vs torchrun |", "|---|---|---|---|"]
    for way, values in seconds.items():
        med = statistics.median(values)
        lines.append(f"| {way} | {med:.2f} | {', '.join(f'{v:.2f}' for v in values)} | {med / torchrun:.2f}x |")
    without, with_ = statistics.median(per_step["without"]), statistics.median(per_step["with"])
    ratio = statistics.median(w / o for w, o in zip(per_step["with"], per_step["without"]))
    lines += ["", f"The callback's price: {a.pairs} pairs of `Trainer.train()` of {a.steps} steps, in one job "
              "(rank 0's `train_runtime / steps`):", "", "| | median step (ms) | each run (ms) |", "|---|---|---|",
              f"| without DaskDDPCallback | {without * 1e3:.3f} | "
              f"{', '.join(f'{v * 1e3:.3f}' for v in per_step['without'])} |",
              f"| with DaskDDPCallback | {with_ * 1e3:.3f} | {', '.join(f'{v * 1e3:.3f}' for v in per_step['with'])} |",
              "", f"Overhead: {100 * (ratio - 1):+.1f} % of a step, the median of the pairs' ratios (medians: "
              f"{100 * (with_ / without - 1):+.1f} %; goal: <= 1 %). The hooks of one step timed alone (on_step_end "
              f"at a step that does not log, no notice): {hook * 1e6:.1f} us, {100 * hook / without:.2f} % of the "
              "step without the callback.", ""]
    Path(a.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

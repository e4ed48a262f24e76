"""Per-rank telemetry and stragglers on real 2-rank gloo jobs (LocalCluster worker processes, real DDP).

The ranks train a small DDP model on a real ``DataLoader`` whose dataset
sleeps a known time per batch (input) or whose step sleeps after the
forward pass (compute); telemetry must show what the ranks really did, and
the straggler watch must name the rank that was made slow, with its cause.
"""

from __future__ import annotations

import logging

import dask
import pytest
from _cluster import run

from dask_ddp.wire.goodput import RANK_CATEGORIES

STEP_INPUT = 0.15  # seconds a slow loader sleeps per batch
STEP_COMPUTE = 0.15  # seconds a slow step sleeps after its forward pass


def train(steps, input_sleep=None, compute_sleep=None, report=True, batch=8, source="dataloader"):
    """A DDP step loop; ``input_sleep``/``compute_sleep`` map rank -> seconds slept per batch / per step.

    ``source``: a ``DataLoader`` (timed by dask-ddp on its own), or a generator wrapped in ``dask_ddp.timed``.
    """
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, Dataset

    import dask_ddp

    torch.set_num_threads(1)
    ctx = dask_ddp.get_context()
    in_sleep = (input_sleep or {}).get(ctx.rank, 0.0)
    step_sleep = (compute_sleep or {}).get(ctx.rank, 0.0)

    class Slow(Dataset):
        def __len__(self):
            return steps * batch

        def __getitem__(self, i):
            if i % batch == 0 and in_sleep:
                time.sleep(in_sleep)  # once per batch
            return torch.randn(4), torch.randn(1)

    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    def generate():
        for _ in range(steps):
            if in_sleep:
                time.sleep(in_sleep)
            yield torch.randn(batch, 4), torch.randn(batch, 1)

    data = DataLoader(Slow(), batch_size=batch) if source == "dataloader" else dask_ddp.timed(generate())
    for step, (x, y) in enumerate(data):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step_sleep:
            time.sleep(step_sleep)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if report:
            dask_ddp.report(loss=loss)
    return ctx.rank


class Seen:
    """A callback keeping every telemetry item and straggler event."""

    def __init__(self):
        self.telemetry, self.stragglers = [], []

    def on_telemetry(self, item):
        self.telemetry.append(item)

    def on_straggler(self, job, event):
        self.stragglers.append(event)


def _steady(items, rank, skip=2):
    """The items of ``rank`` with steps, past the first ``skip`` (start-up), without the final one (sent as the
    rank ends: a part of a window, whose steps' input waits may have fallen in the window before)."""
    mine = [it for it in items if it["rank"] == rank and it["steps"] and not it.get("final")]
    return mine[skip:]


@pytest.mark.slow
def test_telemetry_fields_and_known_input_wait(client):
    """A loader sleeping 0.1 s per batch on every rank: input wait is most of each step, on both ranks."""
    seen = Seen()
    job = run(client, train, 60, input_sleep={0: 0.1, 1: 0.1}, callbacks=[seen])  # ~6 windows: 2 start-up, 1 final
    assert job.result(timeout=180) == [0, 1]
    for rank in (0, 1):
        steady = _steady(seen.telemetry, rank)
        assert len(steady) >= 2, seen.telemetry
        item = steady[-1]
        expected = {"kind", "rank", "attempt", "time", "step", "steps", "step_time", "input_wait",
                    "collective_wait", "samples_per_s", "cpu_percent", "rss_bytes", "gpu_util", "gpu_mem_bytes",
                    "gpu_mem_peak_bytes", "last_report_age", "goodput_since", "goodput_step", "goodput_from",
                    "joined", "final", *(f"goodput_{c}_s" for c in RANK_CATEGORIES)}
        assert set(item) == expected
        assert item["attempt"] == 0 and isinstance(item["rss_bytes"], int) and item["rss_bytes"] > 10_000_000
        assert item["gpu_util"] is None and item["gpu_mem_bytes"] is None  # CPU ranks
        step_times = [it["step_time"] for it in steady if it["step_time"]]
        waits = [it["input_wait"] for it in steady if it["input_wait"] is not None]
        mean_step = sum(step_times) / len(step_times)
        mean_wait = sum(waits) / len(waits)
        # known: 0.1 s of sleep per step, plus a few ms of DDP on a loaded 2-core machine
        print(f"rank {rank}: step time {mean_step:.3f} s, input wait {mean_wait:.0%}, "
              f"samples/s {item['samples_per_s']:.1f}")
        assert 0.1 <= mean_step < 0.25, step_times
        expected_share = 0.1 / mean_step
        assert abs(mean_wait - expected_share) < 0.15, (waits, expected_share)
        assert item["samples_per_s"] == pytest.approx(8 / mean_step, rel=0.5)
        assert item["collective_wait"] is not None and item["collective_wait"] < 0.5
        assert item["step"] is not None and item["last_report_age"] is not None and item["last_report_age"] < 5
    page = job._repr_html_()  # the notebook's view: both ranks, their workers and step times
    assert "FINISHED" in page and page.count("<tr") == 3
    for r in job.plan.ranks:
        assert r.address in page
    assert page.count(" ms</td>") == 2
    m = job.metrics
    assert str(m["time"].dtype) == "datetime64[ns, UTC]" and list(m.columns[:5]) == ["rank", "attempt", "step",
                                                                                      "time", "elapsed"]
    assert 0 < m["elapsed"].min() <= m["elapsed"].max() < 180


def test_telemetry_without_reports_counts_ddp_steps_and_times_a_generator(client):
    """No report() at all and no DataLoader: steps come from DDP's all-reduce, input wait from dask_ddp.timed."""
    seen = Seen()
    job = run(client, train, 30, input_sleep={0: 0.08, 1: 0.08}, report=False, source="timed", callbacks=[seen])
    assert job.result(timeout=180) == [0, 1]
    steady = _steady(seen.telemetry, 0, skip=1)
    assert steady and all(it["last_report_age"] is None for it in steady)
    assert sum(it["steps"] for it in seen.telemetry if it["rank"] == 0) >= 25
    waits = [it["input_wait"] for it in steady if it["input_wait"] is not None]
    assert waits and 0.5 < sum(waits) / len(waits) <= 1.0, waits  # 80 ms of each ~85 ms step
    assert job.metrics.empty


def hooks(user_hook):
    """Rank: dask-ddp's timing hook gives DDP's own gradients; a user's hook registered later is used and timed."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    hooked, plain = DDP(torch.nn.Linear(7, 3)), DDP(torch.nn.Linear(7, 3))
    plain.module.load_state_dict(hooked.module.state_dict())
    assert hasattr(hooked, "_dask_ddp_timing") and not hasattr(plain, "_dask_ddp_timing")
    calls = []
    if user_hook:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
            allreduce_hook,
        )

        def mine(state, bucket):
            calls.append(bucket.index())
            return allreduce_hook(state, bucket)

        hooked.register_comm_hook(None, mine)  # after construction, as users do
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(torch.distributed.get_rank())) * 3
    for model in (hooked, plain):
        model(x).pow(2).sum().backward()
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(hooked.parameters(), plain.parameters()))
    from dask_ddp.rank.telemetry import COUNTERS

    return {"same": same, "calls": len(calls), "ddp_steps": COUNTERS.ddp_steps, "wait": COUNTERS.coll_wait}


@pytest.mark.parametrize("user_hook", [False, True])
def test_timing_hook_keeps_ddp_numbers_and_user_hooks(client, user_hook):
    out = run(client, hooks, user_hook).result(timeout=180)
    for rank in out:
        assert rank["ddp_steps"] == 1 and rank["wait"] >= 0
        assert rank["calls"] == (1 if user_hook else 0)
        if not user_hook:
            assert rank["same"], "the timing hook changed DDP's averaged gradients"


def _straggler_job(client, caplog, **slow):
    seen = Seen()
    with dask.config.set({"ddp.telemetry.straggler-window": 3}), caplog.at_level(logging.WARNING, "dask_ddp"):
        job = run(client, train, 60, callbacks=[seen], **slow)
        job.result(timeout=240)
    return job, seen


@pytest.mark.parametrize("where", ["input", "compute"])
@pytest.mark.slow
def test_slow_rank_is_named_with_its_cause(client, caplog, where):
    kwargs = {"input_sleep": {1: STEP_INPUT}} if where == "input" else {"compute_sleep": {1: STEP_COMPUTE}}
    job, seen = _straggler_job(client, caplog, **kwargs)
    assert len(seen.stragglers) == 1, (seen.stragglers, seen.telemetry[-6:])  # once
    event = seen.stragglers[0]
    addr = job.plan.ranks[1].address
    assert event["kind"] == "straggler" and event["run"] == job.run_id
    assert event["rank"] == 1 and event["cause"] == where and event["worker"] == addr
    assert event["host"] == job.plan.ranks[1].host
    notes = [h for h in job.history if h[1] == h[2] and "straggler" in h[3]]
    assert len(notes) == 1 and "rank 1" in notes[0][3] and addr in notes[0][3]
    warnings = [r for r in caplog.records if "straggler" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].name == "dask_ddp"
    assert f"its {where}" in warnings[0].getMessage()
    assert "straggler" in job._repr_html_()


@pytest.mark.slow
def test_uniformly_slow_job_names_nobody(client, caplog):
    job, seen = _straggler_job(client, caplog, compute_sleep={0: STEP_COMPUTE, 1: STEP_COMPUTE})
    assert seen.stragglers == []
    assert not [r for r in caplog.records if "straggler" in r.getMessage()]
    assert len(_steady(seen.telemetry, 0)) >= 3  # the job did run long enough to be judged


def test_telemetry_off(client):
    seen = Seen()
    with dask.config.set({"ddp.telemetry.enabled": False}):
        job = run(client, train, 20, input_sleep={0: 0.05, 1: 0.05}, callbacks=[seen])
    assert job.result(timeout=180) == [0, 1]
    assert seen.telemetry == [] and job._record.telemetry == {}
    assert len(job.metrics) == 40

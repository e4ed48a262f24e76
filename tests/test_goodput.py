"""Goodput (issue 42, item 6): where a job's wall time went, per job and per rank, in ``job.goodput`` and
``job.history``.

Real 2-rank gloo jobs on the shared LocalCluster: a loader that sleeps a known time per batch (data), a step that
sleeps a known time (productive), a real ``save_checkpoint`` timed by the rank itself (checkpoint), a rank that
fails once (a restart: recovery, and the steps done again). The book's rules on hand-made items (no cluster):
a replacement's place, a process gone, what rank code sends that is no ledger.
"""

from __future__ import annotations

import math

import dask
import pytest
from _cluster import run

from dask_ddp.client.goodput import GoodputBook
from dask_ddp.wire.goodput import CATEGORIES, RANK_CATEGORIES, fields

STEPS, FETCH, COMPUTE = 10, 0.08, 0.12


def steady(steps: int, fetch: float, compute: float, floats: int):
    """A DDP loop over a loader sleeping ``fetch`` per batch, each step sleeping ``compute``; rank 0 saves a
    checkpoint of ``floats`` float32 halfway and returns how long the call took."""
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, Dataset

    import dask_ddp

    torch.set_num_threads(1)

    class Slow(Dataset):
        def __len__(self):
            return steps

        def __getitem__(self, i):
            time.sleep(fetch)
            return torch.ones(4)

    net = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    saved = 0.0
    for step, x in enumerate(DataLoader(Slow(), batch_size=1)):
        loss = net(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(compute)
        dask_ddp.report(step=step, loss=loss.item())
        if step == steps // 2:
            state = {"w": torch.zeros(floats)}
            began = time.perf_counter()
            dask_ddp.save_checkpoint(state, step)  # rank 0 writes, the others return at once
            saved = time.perf_counter() - began
    return saved


def fails_once(steps: int, step_s: float):
    """A DDP loop of ``steps`` reported steps; rank 1 raises at step 5 of the first attempt (no checkpoint: the
    restart does steps 0-5 again)."""
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dask_ddp

    ctx = dask_ddp.get_context()
    net = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for step in range(steps):
        loss = net(torch.ones(2, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(step_s)
        dask_ddp.report(step=step, loss=loss.item())
        if ctx.restart_count == 0 and ctx.rank == 1 and step == 5:
            raise RuntimeError("rank 1 fails once")
    return ctx.restart_count


def _row_sums(table) -> None:
    for rank, row in table.iterrows():
        parts = sum(row[f"{k}_s"] for k in CATEGORIES)
        assert math.isclose(parts, row["wall_s"], abs_tol=1e-6), (rank, dict(row))
        assert all(row[f"{k}_s"] >= 0 for k in CATEGORIES), (rank, dict(row))


def test_a_jobs_wall_time_goes_to_its_data_steps_and_checkpoint(client, tmp_path):
    """10 steps of 0.08 s waiting for a batch and 0.12 s of work, a 16 MiB checkpoint halfway: each rank's data
    is its loader's sleeps, its productive time at least its steps' work, its checkpoint the save it timed itself;
    nothing was redone or recovered; the job's row accounts for the job's whole wall time, and the
    history's end says it."""
    job = run(client, steady, STEPS, FETCH, COMPUTE, 4 << 20, checkpoint_dir=str(tmp_path))
    saved = job.result(timeout=180)
    table = job.goodput
    print(table.round(3).to_string())
    _row_sums(table)
    assert list(table.index) == ["job", 0, 1]
    for rank in (0, 1):
        row = table.loc[rank]
        assert 0.8 * STEPS * FETCH <= row["data_s"] <= STEPS * FETCH + 1.0, dict(row)
        assert row["productive_s"] >= 0.9 * STEPS * COMPUTE, dict(row)
        assert row["startup_s"] > 0 and row["redone_s"] == 0 and row["recovery_s"] == 0, dict(row)
    assert saved[0] > 0.01
    for rank in (0, 1):  # rank 1 returns at once, past finding the folder
        assert math.isclose(table.loc[rank, "checkpoint_s"], saved[rank], abs_tol=0.01), (table.loc[rank], saved)
    ended = next(t for t, _, new, _ in job.history if new == "FINISHED")
    assert math.isclose(table.loc["job", "wall_s"], ended - job._record.created, abs_tol=1e-3)
    share = table.loc["job", "goodput"]
    assert 0 < share < 1
    *_, new, cause = job.history[-1]  # the end's cause says it too
    assert new == "FINISHED" and cause.startswith("every rank returned; ") and cause.count("goodput ") == 1
    assert f"; goodput {100 * share:.1f} % of {table.loc['job', 'wall_s']:.1f} s (start-up " in cause, cause


def test_a_restart_counts_its_price_as_recovery_and_the_steps_done_again_as_redone(client):
    """Rank 1 fails at step 5; the restart starts at step 0 again (no checkpoint): the job's recovery is the
    time from the failure to the new attempt's first step (a warm restart: tens of ms here), and its redone
    time covers the 6 steps of 0.15 s done again (counted per telemetry window, shared by step where a window
    crosses step 5)."""
    job = run(client, fails_once, 14, 0.15, max_restarts=1)
    assert job.result(timeout=180) == [1, 1]
    table = job.goodput
    print(table.round(3).to_string())
    _row_sums(table)
    row = table.loc["job"]
    assert row["recovery_s"] > 0, dict(row)
    assert 0.6 * 6 * 0.15 <= row["redone_s"] <= 6 * 0.15 + 0.5, dict(row)
    assert row["productive_s"] >= 8 * 0.15 * 0.8, dict(row)  # steps 0-5 of the first attempt, 6-13 of the second


def sharded_quiet(steps: int, step_s: float):
    """An FSDP2 loop with no DataLoader and no report() until its end (the mark a plain loop has is its model's
    first forward)."""
    import time

    import torch

    import dask_ddp

    net = dask_ddp.shard_model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for _ in range(steps):
        loss = net(torch.ones(2, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(step_s)
    dask_ddp.report(step=steps, loss=loss.item())


def test_a_loop_without_loader_or_reports_starts_at_its_models_first_forward(client):
    """8 FSDP2 steps of 0.15 s with one report() at the end: each rank's start-up ends at the first forward, so
    its productive time covers the steps (before, the first mark was that report: the whole loop counted as
    start-up, productive 0)."""
    job = run(client, sharded_quiet, 8, 0.15)
    job.result(timeout=120)
    table = job.goodput
    print(table.round(3).to_string())
    for rank in (0, 1):
        assert table.loc[rank, "productive_s"] >= 8 * 0.15 * 0.9, dict(table.loc[rank])
    _row_sums(table)


def test_goodput_is_empty_with_telemetry_off(client):
    with dask.config.set({"ddp.telemetry.enabled": False}):
        job = run(client, fails_once, 2, 0.0)
    job.result(timeout=120)
    assert job.goodput.empty and list(job.goodput.columns)[-1] == "goodput"
    assert not any("goodput" in cause for *_, cause in job.history)


def _item(rank, since, seen, final=False, joined=0, attempt=0, step=None, **split):
    ledger = {k: 0.0 for k in RANK_CATEGORIES} | split
    return {"kind": "telemetry", "rank": rank, "attempt": attempt, "time": seen, "goodput_since": since,
            "goodput_step": step, "joined": joined, "final": final, **fields(ledger)}


def test_a_replacements_place_counts_the_empty_time_and_its_start_up_as_recovery():
    """Rank 1 of 2 lost at 105 (its last ledger: 4 s since 101), its replacement started at 107 with 1 s of
    start-up: its place holds 1 s of start-up (before its first process), 4 s of its first process, 2 s empty
    and the replacement's start-up (recovery), then the replacement's steps."""
    book = GoodputBook(created=99.0)
    book.launched(0, 100.0, 2, -1)
    book.telemetry(_item(0, 100.5, 110.0, final=True, startup=1.5, productive=8.0))
    book.telemetry(_item(1, 101.0, 105.0, startup=1.0, productive=3.0))
    book.telemetry(_item(1, 107.0, 110.0, final=True, joined=1, startup=1.0, productive=2.0))
    book.ended(110.0, job=True)
    rows = {r["rank"]: r for r in book.rows(now=200.0)}
    one = rows[1]
    assert one["startup_s"] == pytest.approx(2.0) and one["recovery_s"] == pytest.approx(3.0)
    assert one["productive_s"] == pytest.approx(5.0) and one["wall_s"] == pytest.approx(10.0)
    zero = rows[0]
    assert zero["startup_s"] == pytest.approx(2.0) and zero["productive_s"] == pytest.approx(8.0)
    job = rows["job"]
    assert job["wall_s"] == pytest.approx(11.0)  # created at 99, ended at 110
    assert job["startup_s"] == pytest.approx(1.0 + (2.0 + 2.0) / 2)
    assert job["recovery_s"] == pytest.approx(3.0 / 2)


def test_a_place_whose_first_process_left_no_ledger_counts_its_time_as_other():
    book = GoodputBook(created=0.0)
    book.launched(0, 0.0, 1, -1)
    book.telemetry(_item(0, 3.0, 5.0, final=True, joined=1, startup=0.5, productive=1.5))
    book.ended(5.0, job=True)
    (job, rank) = book.rows(now=9.0)
    assert rank["other_s"] == pytest.approx(3.0) and rank["recovery_s"] == pytest.approx(0.5)
    assert rank["startup_s"] == 0 and job["wall_s"] == pytest.approx(5.0)


def test_a_process_gone_quiet_leaves_its_place_to_recovery_and_a_running_one_to_other():
    book = GoodputBook(created=0.0)
    book.launched(0, 0.0, 2, -1)
    book.telemetry(_item(0, 0.0, 10.0, productive=10.0))
    book.telemetry(_item(1, 0.0, 4.0, productive=4.0))
    rows = {r["rank"]: r for r in book.rows(now=12.0)}  # rank 0 heard 2 s ago, rank 1 8 s ago
    assert rows[0]["other_s"] == pytest.approx(2.0) and rows[0]["recovery_s"] == 0
    assert rows[1]["recovery_s"] == pytest.approx(8.0)


def test_what_rank_code_sends_that_is_no_ledger_is_ignored():
    book = GoodputBook(created=0.0)
    book.launched(0, 0.0, 2, -1)
    for bad in ({"goodput_productive_s": -1.0}, {"goodput_data_s": float("nan")}, {"goodput_startup_s": True},
                {"goodput_redone_s": "1"}, {"goodput_since": None}, {"rank": 5}, {"rank": -1}, {"attempt": 3},
                {"joined": "x"}):
        book.telemetry({**_item(0, 0.0, 1.0, productive=1.0), **bad})
    assert not book.procs
    book.telemetry(_item(0, 0.0, 1.0, productive=1.0))
    assert len(book.procs) == 1

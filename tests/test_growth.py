"""The controller's growth and stop notices (:class:`dask_ddp.client.notices.NoticeDesk`) on their own: no controller,
no cluster, no clock but the numbers the tests pass.

The desk is handed what the controller knows (the attempt, the time, whether a rank has reported, the workers a plan
may use) and sends notices through a recording port; the controller stepped with it is in ``tests/test_controller.py``
and on a real cluster in ``tests/test_preemption.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import dask
import pytest

from dask_ddp.client import notices
from dask_ddp.client.attempt import Attempt
from dask_ddp.client.notices import GROW_EVERY, NoticeDesk, growth_bounds
from dask_ddp.wire.plan import make_plan, workers_from_scheduler_info
from dask_ddp.wire.spec import LaunchSpec

ADDRESSES = [f"tcp://10.0.0.{i + 1}:4000" for i in range(6)]


class Port:
    """The cluster port's ``notify``, recorded."""

    def __init__(self):
        self.sent: list[tuple] = []

    def notify(self, task, addresses, cause, grace, kind="grow"):
        self.sent.append((task.attempt_id, addresses, cause, grace, kind))


class Workers:
    """The controller's ``_usable_workers``: what a plan may use, with how often it was asked."""

    def __init__(self, *addresses):
        self.addresses, self.asked = list(addresses), 0

    def __call__(self):
        self.asked += 1
        return list(self.addresses)


def attempt(world=2, index=0):
    info = {a: {"host": a.split("//")[1].split(":")[0], "name": str(i)} for i, a in enumerate(ADDRESSES[:world])}
    plan = make_plan(workers_from_scheduler_info({"workers": info}), None)
    tasks = [SimpleNamespace(attempt_id=f"job-1-{index}", rank=r) for r in plan.ranks]  # what notify reads of one
    return Attempt(index, plan, tasks, [None] * world, launched=0.0)


def desk(grow=(1, None), grace=30.0):
    port = Port()
    return NoticeDesk(port, grow, grace), port


# ---- growth ----------------------------------------------------------------------------------------------------

def test_a_growth_notice_names_the_workers_that_joined_once_a_rank_has_reported():
    d, port = desk()
    att, workers = attempt(2), Workers(*ADDRESSES[:4])  # two in use, two idle
    assert d.check(att, 10.0, reported=False, workers=workers) is False
    assert port.sent == [] and workers.asked == 0  # a job that has not trained yet does not grow
    assert d.check(att, 10.0, reported=True, workers=workers) is False
    (sent,) = port.sent
    assert sent == ("job-1-0", ADDRESSES[:2], f"2 worker(s) joined ({ADDRESSES[2]}, {ADDRESSES[3]}): the job grows "
                    "to 4 ranks", 30.0, "grow")
    assert d.noticed == 0


def test_one_notice_an_attempt_and_the_next_attempt_may_grow_again():
    d, port = desk()
    workers = Workers(*ADDRESSES[:3])
    first = attempt(2, index=0)
    d.check(first, 10.0, True, workers)
    for t in (11.0, 12.5, 20.0):
        d.check(first, t, True, workers)
    assert len(port.sent) == 1 and workers.asked == 1  # once noticed, the workers are not even asked
    second = attempt(2, index=1)
    d.check(second, 30.0, True, workers)
    assert len(port.sent) == 2 and port.sent[1][0] == "job-1-1"


def test_idle_workers_are_looked_for_at_most_every_grow_every_seconds():
    d, port = desk()
    att, workers = attempt(2), Workers(*ADDRESSES[:2])  # nothing idle yet
    d.check(att, 10.0, True, workers)
    d.check(att, 10.0 + GROW_EVERY / 2, True, workers)
    assert workers.asked == 1 and port.sent == []
    workers.addresses.append(ADDRESSES[2])  # a worker joins
    d.check(att, 10.0 + GROW_EVERY * 0.9, True, workers)
    assert workers.asked == 1 and port.sent == []
    d.check(att, 10.0 + GROW_EVERY, True, workers)
    assert workers.asked == 2 and "1 worker(s) joined" in port.sent[0][2] and "3 ranks" in port.sent[0][2]


@pytest.mark.parametrize("grow, world, idle, sent", [((1, None), 2, 1, True), ((1, 2), 2, 3, False),
                                                    ((1, 3), 2, 3, True), ((1, None), 2, 0, False)])
def test_the_bounds_decide_whether_idle_workers_are_a_growth(grow, world, idle, sent):
    d, port = desk(grow=grow)
    d.check(attempt(world), 10.0, True, Workers(*ADDRESSES[:world + idle]))
    assert bool(port.sent) is sent
    if sent:
        assert f"the job grows to {min(world + idle, grow[1] or 99)} ranks" in port.sent[0][2]


def test_a_job_that_may_not_grow_has_nothing_to_check():
    d, port = desk(grow=None)
    assert d.active is False
    workers = Workers(*ADDRESSES)
    assert d.check(attempt(2), 10.0, True, workers) is False
    assert port.sent == [] and workers.asked == 0


# ---- stop ----------------------------------------------------------------------------------------------------------

def test_a_stop_sends_one_stop_notice_then_says_when_it_is_overdue():
    d, port = desk(grow=None)
    d.stop("pruned at step 3", deadline=110.0)
    d.stop("a later stop", deadline=500.0)  # only the first counts
    assert d.active and d.stop_asked == ("pruned at step 3", 110.0)
    att = attempt(2)
    assert d.check(att, 100.0, False, Workers()) is False
    assert port.sent == [("job-1-0", ADDRESSES[:2], "pruned at step 3", 10.0, "stop")]
    assert d.check(att, 105.0, False, Workers()) is False
    assert d.check(att, 110.0, False, Workers()) is False  # at the deadline, not past it
    assert d.check(att, 110.5, False, Workers()) is True
    assert len(port.sent) == 1


def test_a_stop_late_for_its_deadline_still_gives_the_ranks_half_a_second():
    d, port = desk(grow=None)
    d.stop("late", deadline=100.0)
    assert d.check(attempt(2), 200.0, False, Workers()) is False  # the notice goes first
    assert port.sent[0][3] == 0.5


def test_a_stop_after_a_growth_notice_sends_no_second_notice_and_stops_growing():
    d, port = desk()
    att, workers = attempt(2), Workers(*ADDRESSES[:3])
    d.check(att, 10.0, True, workers)
    d.stop("stop", deadline=20.0)
    assert d.check(att, 15.0, True, workers) is False and d.check(att, 21.0, True, workers) is True
    assert [s[4] for s in port.sent] == ["grow"] and workers.asked == 1
    d.check(attempt(2, index=1), 22.0, True, workers)  # a new attempt (the growth's restart) gets the stop notice
    assert [s[4] for s in port.sent] == ["grow", "stop"]


# ---- what the desk is built from --------------------------------------------------------------------------------

def spec(workers, checkpoint_dir="/tmp/ckpt"):
    info = {a: {"host": "h", "name": str(i)} for i, a in enumerate(ADDRESSES[:3])}
    plan = make_plan(workers_from_scheduler_info({"workers": info}), workers)
    return LaunchSpec(call=b"", fn_name="train", run_id="job-1", first_plan=plan, workers=workers,
                      checkpoint_dir=checkpoint_dir)


def test_growth_bounds_need_an_elastic_job_a_checkpoint_folder_and_the_setting():
    assert growth_bounds(spec((2, None))) == (2, None)
    assert growth_bounds(spec((1, 3))) == (1, 3)
    assert growth_bounds(spec((2, None), checkpoint_dir=None)) is None  # nothing to restart from
    assert growth_bounds(spec(None)) is None and growth_bounds(spec(2)) is None
    with dask.config.set({"ddp.preemption.grow": False}):
        assert growth_bounds(spec((2, None))) is None


def test_the_notices_module_does_not_import_the_controller_even_for_types():
    tree = ast.parse(Path(notices.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any("controller" in m for m in imported if m), imported

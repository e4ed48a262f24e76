"""The failure policy's decisions: pure functions of plain data, each decision table row a case; no cluster."""

from __future__ import annotations

import cloudpickle
import pytest

import dask_ddp
from dask_ddp.client import policy
from dask_ddp.client.policy import (
    Action,
    Decision,
    StallBlame,
    blame_stall,
    decide,
    in_collective,
    lost_outcome,
    restart_request,
    root_cause,
    root_error,
    stall_error,
)
from dask_ddp.wire.outcome import RankOutcome, Status
from dask_ddp.wire.plan import RankSpec


def o(rank, status, t=0.0, secondary=False, error=None):
    return RankOutcome(rank, f"tcp://h:{rank}", status, time=t, secondary=secondary,
                       error=None if error is None else cloudpickle.dumps(error))


def test_policy_root_cause_and_decisions():
    # a lost worker explains the others' broken collectives, even when they were noticed first
    assert root_cause([o(0, "error", 1.0, True), o(1, "lost", 2.0)]).rank == 1
    # first-hand errors before secondary collective errors, then the earliest
    assert root_cause([o(0, "error", 1.0, True), o(1, "error", 2.0)]).rank == 1
    assert root_cause([o(0, "error", 3.0), o(1, "error", 2.0), o(2, "aborted", 0.5)]).rank == 1
    assert root_cause([o(0, "ok"), o(1, "aborted")]) is None
    assert decide([o(0, "ok"), o(1, "ok")], cancelled=False, attempt=0, max_restarts=0).action == "finish"
    d = decide([o(0, "died", 1), o(1, "aborted")], cancelled=False, attempt=0, max_restarts=2)
    assert (d.action, d.root.rank) == ("restart", 0) and "attempt 2/3" in d.reason
    assert decide([o(0, "died", 1)], cancelled=False, attempt=2, max_restarts=2).action == "fail"
    assert decide([o(0, "error", 1)], cancelled=True, attempt=0, max_restarts=5).action == "fail"
    assert d.action is Action.RESTART and Decision("fail", "x").action is Action.FAIL  # an enum, from text too
    with pytest.raises(ValueError):
        Decision("retry", "not an action")


# (outcomes, cancelled, attempt, max_restarts) -> (action, root rank or None, words in the reason)
DECIDE = [
    ([("ok",), ("ok",)], False, 0, 0, "finish", None, "every rank returned"),
    ([("ok",), ("ok",)], True, 0, 3, "fail", None, "cancelled"),
    ([("error", 1.0), ("aborted",)], False, 0, 0, "fail", 0, "rank 0 on tcp://h:0 raised"),
    ([("error", 1.0), ("aborted",)], False, 0, 1, "restart", 0, "attempt 2/2"),
    ([("error", 1.0), ("aborted",)], False, 1, 1, "fail", 0, "after 2 attempts"),
    ([("aborted",), ("died", 2.0)], False, 0, 0, "fail", 1, "rank 1 on tcp://h:1 died"),
    ([("aborted",), ("lost", 2.0)], False, 0, 0, "fail", 1, "lost its worker"),
    ([("stalled", 0.0), ("aborted",)], False, 0, 0, "fail", 0, "stalled"),
    ([("aborted",), ("aborted",)], False, 0, 2, "fail", None, "stopped without a failure of their own"),
    ([("ok",), ("aborted",)], False, 0, 2, "fail", None, "stopped without a failure of their own"),
    ([("error", 5.0, True), ("died", 9.0)], False, 0, 0, "fail", 1, "died"),       # died explains a broken collective
    ([("error", 5.0), ("lost", 9.0)], False, 0, 0, "fail", 1, "lost its worker"),  # lost explains everything
    ([("error", 5.0, True), ("error", 9.0)], False, 0, 0, "fail", 1, "raised"),     # first-hand before secondary
    ([("error", 5.0), ("error", 2.0)], False, 0, 0, "fail", 1, "raised"),           # then the earliest
]


@pytest.mark.parametrize("outcomes, cancelled, attempt, max_restarts, action, root, reason", DECIDE)
def test_decide(outcomes, cancelled, attempt, max_restarts, action, root, reason):
    got = decide([o(i, *row) for i, row in enumerate(outcomes)], cancelled=cancelled, attempt=attempt,
                 max_restarts=max_restarts)
    assert got.action == action
    assert (got.root.rank if got.root else None) == root
    assert reason in got.reason


# (workers=, world size of the ended attempt) -> (workers needed, selection planned with)
RESTART = [
    (None, 4, 4, 4),                        # every worker: the same number, whichever they are
    (3, 3, 3, 3),                           # a count: the same count
    ((2, None), 4, 2, (2, None)),           # elastic: at least min, bounds kept
    ((2, 6), 5, 2, (2, 6)),
    (["a", "b"], 2, 2, ["a", "b"]),         # named workers: those same workers
]


@pytest.mark.parametrize("selection, world, need, planned", RESTART)
def test_restart_request(selection, world, need, planned):
    assert restart_request(selection, world) == (need, planned)


IN_COLLECTIVE = 'File "/x/torch/distributed/distributed_c10d.py", line 2, in all_reduce\n'
IN_BACKWARD = 'File "/x/torch/autograd/__init__.py", line 9, in backward\n'
OUTSIDE = 'File "/home/u/train.py", line 3, in train\n    time.sleep(60)\n'

# (ages by rank, live ranks, stacks by rank) -> (blamed rank, its age, outside)
BLAME = [
    ({0: 9.0, 1: 2.0}, [0, 1], {0: IN_COLLECTIVE, 1: OUTSIDE}, 1, 2.0, True),   # the one outside, stale yet or not
    ({0: 9.0, 1: 2.0}, [0, 1], {0: IN_BACKWARD, 1: OUTSIDE}, 1, 2.0, True),     # DDP's all-reduce in backward
    ({0: 9.0, 1: 2.0}, [0, 1], {0: IN_COLLECTIVE, 1: IN_COLLECTIVE}, 0, 9.0, False),  # all inside: longest silent
    ({0: 9.0, 1: 2.0}, [0, 1], {0: OUTSIDE, 1: OUTSIDE}, 0, 9.0, False),        # all outside: longest silent
    ({0: 9.0}, [0, 1], {0: IN_COLLECTIVE, 1: OUTSIDE}, 1, None, True),          # rank 1 never reported
    ({0: 9.0, 1: 7.0, 2: 8.0}, [0, 1, 2], {0: IN_COLLECTIVE, 1: OUTSIDE, 2: OUTSIDE}, 2, 8.0, True),
    ({0: 9.0, 1: 2.0}, [0, 1], {-1: "(could not collect stacks)"}, 0, 9.0, False),  # no stacks at all
]


@pytest.mark.parametrize("ages, live, stacks, rank, age, outside", BLAME)
def test_blame_stall(ages, live, stacks, rank, age, outside):
    assert blame_stall(ages, live, stacks) == StallBlame(rank, age, outside)


def test_stall_error_names_the_rank_and_carries_every_stack():
    err = stall_error("job-1", StallBlame(1, None, True), 3.0, {0: IN_COLLECTIVE, 1: OUTSIDE}, "tcp://h:1")
    assert isinstance(err, dask_ddp.StallError) and (err.rank, err.worker) == (1, "tcp://h:1")
    assert "rank 1 made no progress yet and is not inside a collective" in str(err)
    assert "--- rank 0 ---" in str(err) and "time.sleep(60)" in str(err) and err.stacks[1] == OUTSIDE
    assert "made no progress for 12 s" in str(stall_error("j", StallBlame(0, 12.2, False), 3.0, {}, "w"))


@pytest.mark.parametrize("stack, inside", [(IN_COLLECTIVE, True), (IN_BACKWARD, True), (OUTSIDE, False),
                                           ('File "C:\\x\\torch\\distributed\\c10d.py"', True)])
def test_in_collective(stack, inside):
    assert in_collective(stack) is inside


def test_root_error_keeps_the_ranks_own_exception_and_groups_the_others():
    err = ValueError("bad batch")
    outcomes = [o(0, "aborted"), o(1, "error", 1.0, error=err), o(2, "error", 2.0, True, error=RuntimeError("x"))]
    decision = decide(outcomes, cancelled=False, attempt=0, max_restarts=0)
    got = root_error(decision, outcomes, "job-1")
    assert type(got) is ValueError and str(got) == "bad batch"
    assert got.__notes__ == ["[dask-ddp] other ranks: rank 0 was stopped; rank 2 raised"]


def test_root_error_without_a_root_cause_and_with_an_unpicklable_one():
    got = root_error(Decision("fail", "ranks were stopped"), [o(0, "aborted")], "job-1")
    assert isinstance(got, dask_ddp.RankFailedError) and "job job-1 failed: ranks were stopped" in str(got)
    broken = RankOutcome(3, "tcp://h:3", Status.ERROR, error=b"not a pickle", message="it broke")
    got = root_error(Decision("fail", "r", broken), [broken], "job-1")
    assert isinstance(got, dask_ddp.RankFailedError) and got.rank == 3 and "it broke" in str(got)


def test_lost_outcome_says_how_the_worker_went():
    r = RankSpec(rank=1, local_rank=0, node_rank=1, world_size=2, local_world_size=1, num_nodes=2,
                 address="tcp://10.0.0.2:4000", host="10.0.0.2", name="w1")
    left, silent = lost_outcome(r, 5.0), lost_outcome(r, 5.0, silent=7.4)
    assert left.status == Status.LOST and left.time == 5.0 and "left the cluster" in left.message
    assert "no heartbeat for 7 s" in silent.message and "tcp://10.0.0.2:4000" in silent.message
    err = cloudpickle.loads(silent.error)
    assert isinstance(err, dask_ddp.WorkerLostError) and (err.rank, err.worker) == (1, "tcp://10.0.0.2:4000")


def test_status_is_a_str_enum():
    assert Status.OK == "ok" and str(Status.LOST) == "lost"
    assert RankOutcome(0, "w", "died").status is Status.DIED
    assert RankOutcome(0, "w", "aborted").failed is False and RankOutcome(0, "w", "died").failed is True


def test_queued_message_names_each_waiting_rank_with_what_holds_its_worker():
    found = {"tcp://b:2": {"queued": ["k1", "k3"], "running": ["etl-1", "etl-2"], "more": 3, "threads": 2},
             "tcp://a:1": {"queued": ["k0"], "running": ["other-job-rank0"], "more": 0, "threads": 1},
             "tcp://c:3": {"queued": [], "running": [], "more": 0, "threads": 1}}
    message = policy.queued_message(found, {"k0": 0, "k1": 1, "k3": 3})
    assert message == ("ranks wait for a free Dask thread: rank 0 on worker tcp://a:1, whose 1 thread runs "
                       "other-job-rank0; ranks 1, 3 on worker tcp://b:2, whose 2 threads run etl-1, etl-2 and 3 more. "
                       "The job starts once those tasks end (other Dask work, or another job's ranks); cancel() "
                       "stops it")
    assert policy.queued_message({"tcp://c:3": found["tcp://c:3"]}, {"k0": 0}) is None  # nothing waits: no word
    assert policy.queued_message({"tcp://a:1": found["tcp://a:1"]}, {}) is None  # another job's keys: not ours


def test_a_retired_workers_rank_is_lost_as_a_preemption_not_a_crash():
    from dask_ddp.client import elastic
    from dask_ddp.wire.plan import RankSpec

    r = RankSpec(rank=1, local_rank=0, node_rank=1, world_size=2, local_world_size=1, num_nodes=2,
                 address="tcp://10.0.0.2:4000", host="10.0.0.2", name="w1")
    crash = lost_outcome(r, 100.0)
    assert crash.preempt is None and elastic.preemption([crash]) is None
    retired = lost_outcome(r, 100.0, retired=True)
    assert retired.status == Status.LOST and "was retired" in retired.message
    pre = elastic.preemption([retired])
    assert pre is not None and pre.notice.worker == r.address and pre.step is None and not pre.safe
    assert elastic.reason(pre, 12, 9, 25).startswith(f"preempted: worker {r.address} was retired; the ranks did "
                                                     "not stop at an agreed step")

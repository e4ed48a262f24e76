"""The sweep's queue of asked trials alone (:class:`dask_ddp.sweeps.queue.TrialQueue`): a real Optuna study in
memory, no cluster, no driver. What was asked and not told, the line to start and its head's passes, the count
against ``n_trials``, a walked grid."""

from __future__ import annotations

import pytest

optuna = pytest.importorskip("optuna")

from dask_ddp.sweeps.queue import TrialQueue  # noqa: E402

State = optuna.trial.TrialState
SPACE = {"x": optuna.distributions.FloatDistribution(0.0, 1.0)}


@pytest.fixture(autouse=True)
def quiet_optuna():
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    yield
    optuna.logging.set_verbosity(level)


def make(n_trials=10, sampler=None, space=SPACE):
    study = optuna.create_study(sampler=sampler or optuna.samplers.RandomSampler(seed=0))
    return study, TrialQueue(study, space, n_trials)


def states(study):
    return {t.number: t.state for t in study.get_trials(deepcopy=False)}


def test_asked_trials_count_against_n_trials_unless_they_continue_another():
    study, q = make(n_trials=2)
    a = q.ask()
    assert (q.asked, q.more()) == (1, True)
    q.ask(counted=False)  # a resumed trial
    assert (q.asked, q.more()) == (1, True)
    q.ask()
    assert (q.asked, q.more()) == (2, False)
    assert q.untold() == [a.number, a.number + 1, a.number + 2]
    assert q.waiting() == []  # asked is not lined up: the driver lines a trial up once it knows its size
    assert set(states(study).values()) == {State.RUNNING}


def test_count_takes_an_earlier_sweeps_ended_trials_into_the_count():
    _, q = make(n_trials=3)
    q.count(2)
    q.count()
    assert (q.asked, q.more()) == (3, False)
    assert q.untold() == []


def test_the_line_keeps_order_and_a_first_trial_goes_ahead():
    _, q = make()
    a, b, c = (q.ask().number for _ in range(3))
    q.line_up(a)
    q.line_up(b)
    q.line_up(c, first=True)
    assert q.waiting() == [c, a, b]
    q.line_up(b, first=True)  # already in line: it moves, it is not there twice
    assert q.waiting() == [b, c, a]
    line = q.waiting()
    line.clear()  # a copy
    assert q.waiting() == [b, c, a]


def test_only_an_asked_untold_trial_may_wait_in_line():
    _, q = make()
    t = q.ask()
    q.tell(t.number, 0.5)
    with pytest.raises(KeyError, match=f"trial {t.number} was not asked by this sweep or was already told"):
        q.line_up(t.number)
    with pytest.raises(KeyError, match="trial 99 "):
        q.line_up(99)
    assert q.waiting() == []


def test_start_takes_a_trial_out_and_counts_the_passes_of_the_head():
    _, q = make()
    a, b, c, d = (q.ask().number for _ in range(4))
    for n in (a, b, c, d):
        q.line_up(n)
    assert q.passes() == 0
    assert q.start(1) == b  # b passes the head a
    assert q.passes() == 1
    assert q.start(2) == d
    assert (q.waiting(), q.passes()) == ([a, c], 2)
    assert q.start(0) == a  # the head starts: c is a new head, never passed
    assert (q.waiting(), q.passes()) == ([c], 0)
    assert q.untold() == [a, b, c, d]  # started trials stay untold until their end is told
    with pytest.raises(IndexError):
        q.start(3)


def test_a_new_head_put_first_starts_with_no_passes_and_the_old_head_too_when_it_is_head_again():
    _, q = make()
    a, b, c = (q.ask().number for _ in range(3))
    q.line_up(a)
    q.line_up(b)
    q.start(1)
    assert q.passes() == 1
    q.line_up(c, first=True)  # a resumed trial
    assert q.passes() == 0
    q.drop(c)
    assert q.passes() == 0  # as the driver counted: a head seen anew starts at 0


def test_drop_and_clear_leave_the_trials_untold():
    _, q = make()
    a, b, c = (q.ask().number for _ in range(3))
    for n in (a, b, c):
        q.line_up(n)
    assert q.drop(b) is True
    assert q.drop(b) is False
    assert q.clear() == [a, c]
    assert q.waiting() == []
    assert q.untold() == [a, b, c]


def test_tell_tells_optuna_forgets_the_trial_and_takes_it_out_of_the_line():
    study, q = make()
    a, b, c = (q.ask() for _ in range(3))
    q.line_up(a.number)
    q.line_up(b.number)
    assert q.held(a.number) is a
    q.tell(a.number, 0.25)
    q.tell(b.number, state=State.FAIL)
    q.tell(c.number, state=State.PRUNED)
    assert states(study) == {a.number: State.COMPLETE, b.number: State.FAIL, c.number: State.PRUNED}
    assert study.trials[a.number].value == 0.25
    assert (q.untold(), q.waiting(), q.held(a.number)) == ([], [], None)
    with pytest.raises(ValueError, match="Cannot tell a COMPLETE trial"):  # told twice: Optuna's error, not hidden
        q.tell(a.number, 0.5)


def test_a_trial_an_earlier_sweep_left_running_is_told_by_its_number():
    study, q = make()
    left = study.ask(SPACE)  # asked by a notebook that died
    q.tell(left.number, state=State.FAIL)
    assert states(study) == {left.number: State.FAIL}


def test_ask_with_params_enqueues_the_searched_ones_first():
    study, q = make(space={**SPACE, "y": optuna.distributions.IntDistribution(1, 8)})
    t = q.ask(counted=False, params={"x": 0.125, "y": 3, "fixed": "not searched"})
    assert t.params == {"x": 0.125, "y": 3}
    assert q.asked == 0 and q.untold() == [t.number]


def test_a_walked_grid_exhausts_the_queue_and_telling_the_last_point_raises_nothing():
    grid = optuna.samplers.GridSampler({"a": [1, 2, 3]}, seed=0)
    study, q = make(n_trials=10, sampler=grid, space={"a": optuna.distributions.CategoricalDistribution([1, 2, 3])})
    seen = []
    while q.more():
        t = q.ask()
        seen.append(t.params["a"])
        q.tell(t.number, float(t.params["a"]))
    assert sorted(seen) == [1, 2, 3]
    assert (q.exhausted, q.asked, q.more()) == (True, 3, False)
    assert set(states(study).values()) == {State.COMPLETE}


def test_another_samplers_runtime_error_is_not_taken_for_a_walked_grid():
    class Refusing:
        sampler = optuna.samplers.RandomSampler()

        def ask(self, space):
            return optuna.create_study().ask(space)

        def tell(self, trial, value=None, state=None):
            raise RuntimeError("the storage refused")

    q = TrialQueue(Refusing(), SPACE, 5)
    t = q.ask()
    with pytest.raises(RuntimeError, match="the storage refused"):
        q.tell(t.number, 1.0)
    assert q.exhausted is False

"""The stall clock on its own: what counts as a rank's progress (no cluster, a number for the clock)."""

from dask_ddp.client.stall import StallClock


def test_a_report_or_a_changed_step_is_progress_and_a_repeated_step_is_not():
    clock = StallClock()
    clock.telemetry(0, None, 1.0)  # no step yet: the clock has not started
    assert clock.ages(5.0, ()) == {} and not clock.reported
    clock.telemetry(0, 3, 2.0)
    clock.telemetry(0, 3, 4.0)  # the same step again: no progress
    clock.report(1, 3.0)
    assert clock.ages(10.0, ()) == {0: 8.0, 1: 7.0} and clock.reported
    clock.telemetry(0, 4, 9.0)
    clock.report(1, 9.5)
    assert clock.ages(10.0, {1}) == {0: 1.0}  # a rank with an outcome is not watched


def test_a_new_attempt_starts_every_clock_again():
    clock = StallClock()
    clock.report(0, 1.0)
    clock.telemetry(1, 7, 1.0)
    clock.reset()
    assert clock.ages(100.0, ()) == {} and not clock.reported
    clock.telemetry(1, 7, 50.0)  # the step seen before the reset counts again: a new attempt's first
    assert clock.ages(100.0, ()) == {1: 50.0}

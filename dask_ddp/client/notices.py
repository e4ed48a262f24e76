"""The notices a job's controller sends its ranks: save and stop at one agreed step, to grow or to end.

Runs in: the client (the controller's thread; for a detached job, the driver in the scheduler's process). Both
go through the preemption protocol of :mod:`dask_ddp.rank.preemption`: every rank stops at the same report,
saving what its code registered (``on_preemption``). A growth restarts the job on more workers; a stop
(:meth:`Controller.stop <dask_ddp.client.controller.Controller.stop>`, what a sweep's pruned trial gets) ends it
there, and the controller cancels it (every rank killed together) if the ranks have not stopped in time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dask_ddp.client import elastic

if TYPE_CHECKING:
    from dask_ddp.client.controller import Controller

__all__ = ["check_growth", "check_stop"]


def check_growth(ctrl: Controller) -> None:
    """An elastic job below its maximum saves and restarts on more workers once idle ones have joined."""
    att, now = ctrl.attempt, ctrl.clock()
    if att.grow_asked or now < ctrl._next_grow or not ctrl.last_report:
        return
    ctrl._next_grow = now + 1.0
    idle = [a for a in ctrl._usable_workers()
            if a not in att.plan.addresses and a not in ctrl.silence.silent and a not in ctrl.departed]
    more = elastic.grow_by(ctrl._grow, att.plan.world_size, len(idle))
    if more:
        att.grow_asked = True
        ctrl.cluster.notify(att.tasks[0], list(att.plan.addresses), f"{len(idle)} worker(s) joined "
                            f"({', '.join(sorted(idle))}): the job grows to {att.plan.world_size + more} ranks",
                            ctrl.grace)


def check_stop(ctrl: Controller) -> None:
    """After ``stop()``: send the ranks the ``stop`` notice once; past its deadline, cancel the job."""
    att, (cause, deadline) = ctrl.attempt, ctrl.stop_asked
    if not att.grow_asked:  # one notice an attempt, a growth's or a stop's
        att.grow_asked = True
        ctrl.cluster.notify(att.tasks[0], list(att.plan.addresses), cause, max(deadline - ctrl.clock(), 0.5), "stop")
    elif ctrl.clock() > deadline and not ctrl.cancel_requested:
        ctrl.cancel()  # the ranks did not reach a report in time: stop them all together (killed)

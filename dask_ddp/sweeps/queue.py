"""The sweep's asked trials: what was asked of Optuna and not yet told, and the line of those waiting to start.

Runs in: the client (the sweep's driver thread, and :func:`~.pickup.adopt` before that
thread starts; for a detached sweep, the scheduler's process). Every Optuna call of a sweep goes through one
:class:`TrialQueue`, so the study is used from one thread only.

A trial is *asked* (:meth:`TrialQueue.ask`: ``study.ask``, counted against ``n_trials`` unless it continues
another trial), then *lined up* (:meth:`TrialQueue.line_up`) once the driver knows its size, *started*
(:meth:`TrialQueue.start`: taken out of the line) and finally *told* (:meth:`TrialQueue.tell`: ``study.tell``,
after which the queue forgets it). A trial may be told without ever being lined up or started (its
``ranks_per_trial`` failed, it never fits, the sweep stopped). The queue also keeps how often the head of the
line was passed over by a smaller trial (:meth:`TrialQueue.passes`), which the placement's patience reads, and
whether a grid sampler has nothing left to ask (:attr:`TrialQueue.exhausted`).
"""

from __future__ import annotations

from typing import Any

from dask_ddp.sweeps.search import optuna_module

__all__ = ["TrialQueue"]


class TrialQueue:
    """The trials of one study asked and not yet told, and the line of those waiting to start, in order.

    ``study`` is an Optuna study, ``searched`` the space of distributions asked for, ``n_trials`` the number of
    counted trials the sweep may ask. Not thread-safe: one thread (the sweep's driver) uses it."""

    def __init__(self, study: Any, searched: dict, n_trials: int) -> None:
        self.study, self.searched, self.n_trials = study, searched, n_trials
        self.asked = 0  # trials counted against n_trials (asked here, or ended earlier in a continued study)
        self.exhausted = False  # the sampler has nothing left to ask (a walked grid)
        self._untold: dict[int, Any] = {}  # trial number -> its optuna Trial, from ask() until tell()
        self._line: list[int] = []  # lined up, not started, in order
        self._head: int | None = None  # the head of the line when passes() last looked
        self._passed = 0  # times that head was passed over

    # ---- asking ------------------------------------------------------------------------------------------
    def ask(self, counted: bool = True, params: dict | None = None) -> Any:
        """Ask Optuna for a trial and hold it until told; ``params`` (the searched ones are kept) are enqueued
        first, so the trial gets them (a resumed or interrupted trial asked again). A ``counted`` trial counts
        against ``n_trials``. Returns Optuna's trial. Raises what ``study.ask`` raises (a storage error)."""
        if params is not None:
            self.study.enqueue_trial({k: v for k, v in params.items() if k in self.searched}, skip_if_exists=False)
        trial = self.study.ask(self.searched)
        self.asked += counted
        self._untold[trial.number] = trial
        return trial

    def count(self, n: int = 1) -> None:
        """Count ``n`` trials against ``n_trials`` that were not asked here (an earlier sweep's ended trials)."""
        self.asked += n

    def more(self) -> bool:
        """Whether the sweep may ask another counted trial (``n_trials`` not reached, the sampler not exhausted)."""
        return self.asked < self.n_trials and not self.exhausted

    # ---- the line ----------------------------------------------------------------------------------------
    def line_up(self, number: int, first: bool = False) -> None:
        """Put asked trial ``number`` in line, last (or ``first``: a resumed trial goes ahead of the others); a
        trial already in line moves. Raises KeyError for a trial not asked here or already told."""
        if number not in self._untold:
            raise KeyError(f"trial {number} was not asked by this sweep or was already told: it cannot wait in line")
        if number in self._line:
            self._line.remove(number)
        self._line.insert(0, number) if first else self._line.append(number)

    def waiting(self) -> list[int]:
        """The trials in line (asked, not started), first to last: a copy."""
        return list(self._line)

    def passes(self) -> int:
        """Times the head of the line has been passed over by a trial started before it (0 for a new head)."""
        if self._line and self._line[0] != self._head:
            self._head, self._passed = self._line[0], 0
        return self._passed

    def start(self, index: int) -> int:
        """Take the trial at ``index`` of the line out to start it (one more pass of the head when it is not the
        head); returns its number. Raises IndexError for an index outside the line."""
        self.passes()
        number = self._line.pop(index)
        self._passed += index != 0
        return number

    def drop(self, number: int) -> bool:
        """Take trial ``number`` out of the line without starting it; False when it was not in line."""
        if number not in self._line:
            return False
        self._line.remove(number)
        return True

    def clear(self) -> list[int]:
        """Empty the line; returns the trials that were in it, in order (still untold)."""
        line, self._line = self._line, []
        return line

    # ---- telling -----------------------------------------------------------------------------------------
    def untold(self) -> list[int]:
        """The trials asked and not yet told (running or in line), in the order asked."""
        return list(self._untold)

    def held(self, number: int) -> Any:
        """Optuna's trial for ``number`` while untold, else None."""
        return self._untold.get(number)

    def tell(self, number: int, value: float | None = None, state: Any = None) -> None:
        """``study.tell`` trial ``number`` (``value`` or ``state``) and forget it; a trial not asked here (one an
        earlier sweep left running) is told by its number. The trial leaves the line if it was in it.

        Optuna's GridSampler calls ``study.stop()`` in ``tell``, which only ``study.optimize`` allows
        (RuntimeError), once its grid is walked: the trial's end is stored all the same (Optuna stores it in a
        ``finally``), and the queue is then :attr:`exhausted` (every point of the grid has had its trial).

        Raises
        ------
        RuntimeError, KeyError
            From ``study.tell`` with another sampler than GridSampler (or a RuntimeError before the grid is walked).
        ValueError
            The trial was told already (Optuna's "Cannot tell a COMPLETE trial").
        Exception
            What the study's storage raises.
        """
        optuna = optuna_module()
        trial = self._untold.pop(number, number)
        self.drop(number)
        try:
            self.study.tell(trial, value, state=state)
        except (RuntimeError, KeyError) as err:
            sampler = self.study.sampler
            if not isinstance(sampler, optuna.samplers.GridSampler):
                raise
            if isinstance(err, KeyError):  # an enqueued trial (resumed, continued) has no grid point of its own:
                return  # GridSampler.after_trial looks its 'grid_id' up; Optuna stored the trial's end all the same
            if not sampler.is_exhausted(self.study):
                raise
            self.exhausted = True

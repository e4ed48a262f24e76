"""What :func:`dask_ddp.sweep` checks before anything ships: counts, names, the ranks rule, the workers.

Runs in: the client.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from dask_ddp.client import dispatch
from dask_ddp.wire.errors import PlanError

__all__ = ["count", "check_names", "ranks_rule", "check_workers"]


def count(name: str, value, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name}={value!r}: expected an int >= 1" + (" or None" if allow_none else ""))
    return value


_RUN_KEYWORDS = [p.name for p in inspect.signature(dispatch.run).parameters.values()
                 if p.kind == inspect.Parameter.KEYWORD_ONLY]
_TAKEN = ("workers", "callbacks", "detach", "name", "progress")  # the sweep sets these for each trial


def check_names(searched: dict, fixed: dict, kwargs: dict, run_options: dict) -> None:
    params = set(searched) | set(fixed)
    for what, names in (("space parameter", params), ("kwargs key", set(kwargs))):
        clash = sorted(names & set(_RUN_KEYWORDS))
        if clash:
            raise ValueError(f"{what} {', '.join(map(repr, clash))} is also a keyword of dispatch.run: rename it "
                             "(run's own keywords go in run_options=)")
    both = sorted(params & set(kwargs))
    if both:
        raise ValueError(f"{', '.join(map(repr, both))} is both in space and in kwargs: keep it in one")
    unknown = sorted(set(run_options) - set(_RUN_KEYWORDS))
    taken = sorted(set(run_options) & set(_TAKEN))
    if unknown or taken:
        raise ValueError(f"run_options: {', '.join(unknown + taken)} " + ("is not a keyword of dispatch.run" if
                         unknown else "is set by the sweep for each trial") + f" (allowed: "
                         f"{', '.join(k for k in _RUN_KEYWORDS if k not in _TAKEN)})")


def ranks_rule(ranks_per_trial, searched: dict, fixed: dict) -> Callable[[dict], int]:
    if isinstance(ranks_per_trial, bool):
        raise TypeError("ranks_per_trial: expected an int, a parameter name or a function of the parameters")
    if isinstance(ranks_per_trial, int):
        count("ranks_per_trial", ranks_per_trial)
        return lambda params: ranks_per_trial
    if isinstance(ranks_per_trial, str):
        if ranks_per_trial not in searched and ranks_per_trial not in fixed:
            raise ValueError(f"ranks_per_trial={ranks_per_trial!r} names no parameter of space (it has "
                             f"{', '.join(sorted({*searched, *fixed}))})")
        return lambda params: params[ranks_per_trial]
    if callable(ranks_per_trial):
        return ranks_per_trial
    raise TypeError(f"ranks_per_trial={ranks_per_trial!r}: expected an int, a parameter name or a function of "
                    "the parameters")


def check_workers(client, workers, max_workers, ranks_per_trial) -> tuple[str, ...] | None:
    """The ``workers=`` selection (as a tuple); with an int ``ranks_per_trial``, that it fits the workers the
    sweep may use."""
    if workers is not None and (isinstance(workers, str) or not all(isinstance(w, str) for w in workers)):
        raise TypeError(f"workers={workers!r}: expected a list of worker addresses or names")
    selected = tuple(workers) if workers is not None else None
    if isinstance(ranks_per_trial, int):
        n = len(dispatch.plan_ranks(client, list(selected) if selected is not None else None).ranks)
        room = n if max_workers is None else min(n, max_workers)
        if ranks_per_trial > room:
            raise PlanError(f"ranks_per_trial={ranks_per_trial}, but the sweep may use only {room} workers (the "
                            f"cluster has {n}{'' if selected is None else ' of those named in workers='}, "
                            f"max_workers={max_workers}): lower ranks_per_trial or add workers")
    return selected

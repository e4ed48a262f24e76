"""A sweep's search and early-stopping decisions, made by Optuna through its ask/tell API.

Runs in: the client (the sweep's driver thread; never a rank). Optuna is optional (``pip install
dask-ddp[sweep]``) and imported here only, when a sweep is made.

Nothing here touches a cluster: :func:`distributions` reads a search space, :func:`make_sampler` and
:func:`make_pruner` name Optuna's samplers and pruners, and a :class:`Decider` feeds one trial's metric
trace (step, value) to Optuna and answers "prune now?" at each step, so that a recorded trace replayed
through it gives the decisions Optuna's pruner gives on its own (``tests/test_sweep.py``).
"""

from __future__ import annotations

import importlib.util
import math
import numbers
from collections.abc import Mapping
from typing import Any

__all__ = ["optuna_module", "distributions", "make_sampler", "make_pruner", "Decider", "SAMPLERS", "SCHEDULERS"]

SAMPLERS = ("tpe", "random", "grid", "gp")
SCHEDULERS = ("asha", "hyperband", "median", "none")


def optuna_module():
    """The ``optuna`` module.

    Raises
    ------
    ImportError
        Optuna is not installed: says how to install it.
    """
    try:
        import optuna
    except ImportError as exc:
        raise ImportError("dask_ddp.sweep needs Optuna (>= 4): pip install 'dask-ddp[sweep]' or pip install "
                          "optuna") from exc
    return optuna


def distributions(space: Any) -> tuple[dict, dict]:
    """Read a search space: ``({name: optuna distribution}, {name: fixed value})``.

    Each entry is an Optuna distribution (``optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)``),
    a list or tuple of choices (categorical), a dict ``{"low": .., "high": .., "log": .., "step": ..}`` (int
    when ``low`` and ``high`` are ints, else float), or a plain str/number/bool/None (fixed: passed as is).

    Raises
    ------
    TypeError
        ``space`` is not a dict with str keys, or an entry is of none of these kinds (names it).
    ValueError
        The space is empty, or Optuna refuses an entry (empty choices, ``low > high``, ...; names it).
    """
    dist = optuna_module().distributions
    if not isinstance(space, Mapping):
        raise TypeError(f"space= takes a dict {{parameter name: distribution}}, got {type(space).__name__}")
    searched, fixed = {}, {}
    for name, entry in space.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(f"space: parameter names are Python identifiers (they reach train_fn as keyword "
                            f"arguments), got {name!r}")
        try:
            if isinstance(entry, dist.BaseDistribution):
                searched[name] = entry
            elif isinstance(entry, (list, tuple)):
                searched[name] = dist.CategoricalDistribution(list(entry))
            elif isinstance(entry, Mapping):
                searched[name] = _range(dist, entry)
            elif entry is None or isinstance(entry, (str, bool, numbers.Number)):
                fixed[name] = entry
            else:
                raise TypeError(f"{type(entry).__name__} is not a distribution: give an Optuna distribution, a "
                                "list of choices, a dict {'low': .., 'high': .., 'log': .., 'step': ..} or a fixed "
                                "value")
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"space[{name!r}] = {entry!r}: {exc}") from exc
    if not searched:
        raise ValueError(f"space={space!r} has nothing to search: give at least one distribution, list of choices "
                         "or {'low': .., 'high': ..} range")
    return searched, fixed


def _range(dist, entry: Mapping):
    unknown = set(entry) - {"low", "high", "log", "step"}
    if unknown or not {"low", "high"} <= set(entry):
        raise ValueError(f"a range is {{'low': .., 'high': .., 'log': bool, 'step': ..}}; unknown keys "
                         f"{sorted(unknown)}" if unknown else "a range needs both 'low' and 'high'")
    low, high = entry["low"], entry["high"]
    for bound in (low, high):
        if isinstance(bound, bool) or not isinstance(bound, numbers.Real) or not math.isfinite(bound):
            raise ValueError(f"range bounds must be finite numbers, got {bound!r}")
    if isinstance(low, numbers.Integral) and isinstance(high, numbers.Integral):
        return dist.IntDistribution(int(low), int(high), log=bool(entry.get("log", False)),
                                    step=int(entry.get("step", 1)))
    return dist.FloatDistribution(float(low), float(high), log=bool(entry.get("log", False)),
                                  step=entry.get("step"))


def make_sampler(sampler: Any, searched: dict, seed: int | None = None):
    """An Optuna sampler: an instance as is, or by name (``"tpe"`` default, ``"random"``, ``"grid"``, ``"gp"``).

    ``"grid"`` needs every searched entry to be a list of choices (it walks their product).

    Raises
    ------
    ValueError
        An unknown name; ``"grid"`` over a range.
    ImportError
        ``"gp"`` without scipy and torch (Optuna's GPSampler needs them).
    TypeError
        Neither a name nor an Optuna sampler.
    """
    optuna = optuna_module()
    if isinstance(sampler, optuna.samplers.BaseSampler):
        return sampler
    name = "tpe" if sampler is None else sampler
    if not isinstance(name, str):
        raise TypeError(f"sampler={sampler!r}: give one of {', '.join(SAMPLERS)} or an optuna.samplers instance")
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True)  # liar: concurrent trials spread out
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        ranges = [n for n, d in searched.items() if not isinstance(d, optuna.distributions.CategoricalDistribution)]
        if ranges:
            raise ValueError(f"sampler='grid' walks lists of choices; {', '.join(ranges)} is a range: give a list")
        return optuna.samplers.GridSampler({n: list(d.choices) for n, d in searched.items()}, seed=seed)
    if name == "gp":
        missing = [m for m in ("scipy", "torch") if importlib.util.find_spec(m) is None]
        if missing:
            raise ImportError(f"sampler='gp' (Optuna's GPSampler) needs {' and '.join(missing)}: pip install "
                              f"{' '.join(missing)}, or use sampler='tpe'")
        return optuna.samplers.GPSampler(seed=seed)
    raise ValueError(f"sampler={sampler!r}: unknown; use one of {', '.join(SAMPLERS)} or an optuna.samplers instance")


def make_pruner(scheduler: Any):
    """An Optuna pruner: an instance as is, or by name: ``"asha"`` (SuccessiveHalvingPruner), ``"hyperband"``,
    ``"median"``, ``"none"`` (never prune; also None).

    Raises
    ------
    ValueError
        An unknown name.
    TypeError
        Neither a name nor an Optuna pruner.
    """
    optuna = optuna_module()
    if isinstance(scheduler, optuna.pruners.BasePruner):
        return scheduler
    if scheduler is None or scheduler == "none":
        return optuna.pruners.NopPruner()
    if not isinstance(scheduler, str):
        raise TypeError(f"scheduler={scheduler!r}: give one of {', '.join(SCHEDULERS)} or an optuna.pruners "
                        "instance")
    makers = {"asha": optuna.pruners.SuccessiveHalvingPruner, "hyperband": optuna.pruners.HyperbandPruner,
              "median": optuna.pruners.MedianPruner}
    if scheduler not in makers:
        raise ValueError(f"scheduler={scheduler!r}: unknown; use one of {', '.join(SCHEDULERS)} or an "
                         "optuna.pruners instance")
    return makers[scheduler]()


class Decider:
    """One trial's early-stopping decisions: each reported (step, value) goes to Optuna, which answers.

    The value of a step is the first one reported for it (later duplicates and steps below the last are
    ignored: Optuna keeps one value a step). Once it answers "prune", the decision and its step stay.
    """

    def __init__(self, trial):
        self.trial = trial
        self.last_step: int | None = None
        self.pruned_at: int | None = None

    def report(self, step: int, value: float) -> bool:
        """Tell Optuna the trial's ``value`` at ``step``; True when the trial is to be pruned at this step."""
        if self.pruned_at is not None:
            return True
        if self.last_step is not None and step <= self.last_step:
            return False
        self.last_step = step
        self.trial.report(value, step)
        if self.trial.should_prune():
            self.pruned_at = step
            return True
        return False

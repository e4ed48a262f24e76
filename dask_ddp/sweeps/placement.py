"""Gang placement for a sweep's trials: which free workers a trial of ``k`` ranks starts on, all at once.

Runs in: the client (the sweep's driver thread). Pure functions, no cluster.

A trial of ``k`` ranks starts only when ``k`` workers are free, and then on all ``k`` together (never part
of it waiting for the rest). Among the ways to seat it, :func:`place` takes the best fit:

1. one host with at least ``k`` free workers, the one with the fewest free (it leaves the largest holes
   whole for larger trials), ties to the host that sorts first;
2. else as few hosts as possible: the hosts with the most free workers first.

Workers keep the rank order of :mod:`dask_ddp.wire.plan` (host, then name, then port) within a host.
:func:`pick` chooses which waiting trial starts next: the first in line that fits, but a trial that has
been passed over ``patience`` times holds the free workers for itself until it fits (no starvation of
large trials by a stream of small ones).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from dask_ddp.wire.plan import WorkerInfo, make_plan

__all__ = ["place", "pick", "ordered"]


def ordered(workers: Sequence[WorkerInfo]) -> list[WorkerInfo]:
    """``workers`` in rank order (host, then name, then port), as :func:`~dask_ddp.wire.plan.make_plan` orders them."""
    if not workers:
        return []
    by_address = {w.address: w for w in workers}
    return [by_address[a] for a in make_plan(list(workers)).addresses]


def place(k: int, free: Sequence[WorkerInfo]) -> list[str] | None:
    """The addresses of ``k`` of the ``free`` workers for one trial (best fit, same host first), or None when
    fewer than ``k`` are free.

    Raises
    ------
    ValueError
        ``k`` is not a positive int.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"a trial needs a positive int number of ranks, got {k!r}")
    if len(free) < k:
        return None
    hosts: dict[str, list[WorkerInfo]] = defaultdict(list)
    for w in ordered(free):
        hosts[w.host].append(w)
    names = list(hosts)  # hosts in rank order
    fits = [h for h in names if len(hosts[h]) >= k]
    if fits:
        best = min(fits, key=lambda h: (len(hosts[h]), names.index(h)))
        return [w.address for w in hosts[best][:k]]
    chosen: list[str] = []
    for h in sorted(names, key=lambda h: (-len(hosts[h]), names.index(h))):
        chosen += [w.address for w in hosts[h][:k - len(chosen)]]
        if len(chosen) == k:
            break
    return chosen


def pick(sizes: Sequence[int], free: int, passed: int, patience: int) -> int | None:
    """Which of the waiting trials (their rank counts ``sizes``, in line order) starts now on ``free`` workers.

    The first that fits; but once the head of the line has been passed over ``patience`` times (``passed``),
    only the head may start. None when nothing may start now.
    """
    if not sizes:
        return None
    if sizes[0] <= free:
        return 0
    if passed >= patience:
        return None
    return next((i for i, k in enumerate(sizes) if k <= free), None)

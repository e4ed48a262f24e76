"""A rank may fork ``multiprocessing`` Pools, again and again, as the notebook itself can.

Seen: a rank that opened ``fork`` Pools hung in ``Pool.__exit__`` (every job after the first on a cluster, with
20 pools a rank; the notebook test's one pool, once in ~8 runs under load): ``Pool.terminate()`` SIGTERMs its
workers and joins them, and the workers had inherited the rank's SIGTERM handler (a preemption notice in the
rank itself). A child the rank forks now takes SIGTERM's default action. A rarer hang remained under load (the
12th job of a probe, twice): a SIGTERM that reached a worker before its after-fork signal set-up was lost; SIGTERM
is now held blocked across the fork (tests/test_fork_signals.py). A probe of 30 jobs x 10 pools a rank then passed
twice, beside other agents' test runs (load average 6-16).
"""

from __future__ import annotations

import pytest
from _cluster import run

import dask_ddp


def pools(n: int) -> int:
    import multiprocessing

    for i in range(n):
        with multiprocessing.get_context("fork").Pool(2) as pool:
            assert pool.map(abs, [-1, -2, 3]) == [1, 2, 3]  # a builtin: the rank cannot import this test module
        dask_ddp.report(i=i)
    return n


@pytest.mark.slow
def test_ranks_open_and_close_fork_pools_again_and_again(client):
    # 10 pools a rank: fewer did not hang reliably before the fix (5 pools x 2 jobs passed without it)
    for _ in range(3):  # jobs after the first hung too (a rank forked from the warm zygote)
        job = run(client, pools, 10)
        try:
            assert job.result(timeout=120) == [10, 10]
        finally:
            job.cancel()  # a hung job must not hold the module's workers for the tests after it

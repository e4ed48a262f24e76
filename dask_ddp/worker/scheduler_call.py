"""The bounded scheduler call: a best-effort ``client.run_on_scheduler`` that cannot hold up a job's or sweep's end.

Runs in: wherever a Dask client calls the scheduler at an end: the worker (a rank's supervisor forgetting its
attempt's variables), the notebook (a job's event feed dropping its topic, a sweep claiming and releasing its name)
and a detached driver's client in the scheduler's process.

It sits in the worker wing, the lowest wing that both of its kinds of caller may import (``client/`` imports
``worker/``; ``worker/`` may not import ``client/``), and not in ``wire/``, which holds frozen values and their
rules, not calls over a live Dask connection. It imports nothing of dask_ddp.
"""

from __future__ import annotations

__all__ = ["on_scheduler", "SCHEDULER_CALL_TIMEOUT"]

SCHEDULER_CALL_TIMEOUT = 10.0  # seconds a best-effort call to the scheduler may take (a job's end waits for it)


def on_scheduler(client, fn, *args):
    """``client.run_on_scheduler(fn, *args)`` for the best-effort calls at a job's or sweep's end, bounded.

    Raises
    ------
    ConnectionError
        The client is not running: a closing client's call never returned (its loop closed under it).
    TimeoutError
        No answer within :data:`SCHEDULER_CALL_TIMEOUT` seconds.
    """
    if getattr(client, "status", None) != "running":
        raise ConnectionError(f"the Dask client is not running (status {getattr(client, 'status', None)!r})")
    return client.run_on_scheduler(fn, *args, callback_timeout=SCHEDULER_CALL_TIMEOUT)

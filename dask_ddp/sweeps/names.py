"""One running sweep per name on a cluster: the DDP page, Prometheus (label ``sweep``) and
:func:`dask_ddp.attach_sweep` know a sweep by its name, so a second sweep of a name that runs already is refused.

Runs in: the scheduler's process (:func:`take`, :func:`scheduler_claim`, :func:`scheduler_release`, which
:func:`claim` and :func:`release` call there through ``on_scheduler``, and :mod:`.detach` calls for a detached
sweep) and the client (:func:`claim`, :func:`release`).

A running sweep's name is claimed on the scheduler by its owner: the client whose notebook drives it, or
:data:`DETACHED` for a detached sweep (whose driver runs in the scheduler's process). The claim ends with the
sweep, or with its client: a claim whose client the scheduler no longer knows is void (the notebook died, and
``load_if_exists=True`` continues its study under the same name). Where the scheduler cannot run dask-ddp's
code (not installed there) a notebook's sweep starts unchecked.
"""

from __future__ import annotations

import logging
import threading

from dask_ddp.worker.scheduler_call import on_scheduler

__all__ = ["claim", "release", "refusal", "take", "scheduler_claim", "scheduler_release", "DETACHED"]

logger = logging.getLogger("dask_ddp")

DETACHED = "detached"  # the owner of a detached sweep's name: its driver, in the scheduler's process
_CLAIMS: dict[str, str] = {}  # sweep name -> its owner: a client's id, or DETACHED
LOCK = threading.Lock()


# ---- in the scheduler's process --------------------------------------------------------------------------
def take(name: str, owner: str, dask_scheduler) -> str | None:
    """Claim ``name`` for ``owner`` (call under :data:`LOCK`); the reason it cannot be, or None once claimed."""
    for gone in [n for n, o in _CLAIMS.items() if o != DETACHED and o not in dask_scheduler.clients]:
        del _CLAIMS[gone]  # its client is gone (a dead notebook): so is its sweep; no claim outlives its client
    held = _CLAIMS.get(name)
    if held == DETACHED:
        return f"a detached sweep named {name!r} is running on this cluster"
    if held is not None:
        whose = "this client's own" if held == owner else f"client {held}"
        return f"a sweep named {name!r} is running on this cluster from a notebook ({whose})"
    _CLAIMS[name] = owner
    return None


def scheduler_claim(name: str, owner: str, dask_scheduler=None) -> str | None:
    """In the scheduler's process: :func:`take` under :data:`LOCK`; the reason ``name`` cannot be ``owner``'s, or
    None once claimed. Raises nothing."""
    with LOCK:
        return take(name, owner, dask_scheduler)


def scheduler_release(name: str, owner: str, dask_scheduler=None) -> None:
    """In the scheduler's process: end ``owner``'s claim of ``name`` (nothing if another owner holds it, or none).
    Raises nothing."""
    with LOCK:
        if _CLAIMS.get(name) == owner:
            del _CLAIMS[name]


# ---- the client's side ------------------------------------------------------------------------------------
def refusal(reason: str) -> ValueError:
    """The error of a sweep whose name a running sweep has."""
    return ValueError(f"{reason}: give the new sweep another name=, or wait for that sweep to end (the DDP page, "
                      "Prometheus and attach_sweep know a sweep by its name)")


def claim(client, name: str) -> None:
    """Claim ``name`` on the scheduler for a sweep this client drives.

    Raises
    ------
    ValueError
        A sweep of that name runs on the cluster already (from a notebook, or detached).
    """
    try:
        refused = on_scheduler(client, scheduler_claim, name, client.id)
    except Exception:  # noqa: BLE001 - dask-ddp not on the scheduler, or no answer in time: nothing to check with
        logger.debug("dask-ddp could not check the sweep name %r on the scheduler", name, exc_info=True)
        return
    if refused:
        raise refusal(refused)


def release(client, name: str) -> None:
    """End this client's claim of ``name`` (best effort: a claim of a client that is gone is void anyway)."""
    try:
        on_scheduler(client, scheduler_release, name, client.id)
    except Exception:  # noqa: BLE001 - the client or the scheduler is gone
        pass

"""Preemption inside a rank: a notice that a worker leaves, one agreed step to save at, then a clean stop.

Runs in: the rank process. A notice reaches a rank three ways: its supervisor
sends :class:`~dask_ddp.wire.messages.Notice` (its worker is closing, or the job
grows), the rank process gets SIGTERM itself, or a peer announced one in the
job's rendezvous store (each rank has a watcher thread blocked on its queue of
notices there, on a store connection of its own). What crosses the store is
signed with the attempt's key and checked on read
(:mod:`dask_ddp.rank.notice_board`): a notice or step written by anyone else
who reaches the store is ignored, and counted in ``job.history``. The notice
sets one module flag; ``report()`` checks it (its only cost before a notice)
and then, at each report:

1. posts the step it is at under ``dask_ddp/pre/seen/<rank>``, once;
2. once every rank has posted, takes ``M`` = the largest posted step: every
   rank stops at its first report whose step is greater than ``M``.

No rank can be past that report when it learns ``M``: between two reports
each rank runs at least one collective, so no rank is more than one report
ahead of the last rank to post (hence: every rank must call ``report()`` at
the same points, as with any collective). At the agreed step dask-ddp saves
what :func:`on_preemption` registered (``save_checkpoint`` on the job's
``checkpoint_dir``) and raises :class:`Preempted` from ``report()``; without a
registered save, :func:`preempted` returns the notice there so that the code
saves and raises it itself. The rank process then waits at a store barrier
until every rank has stopped (the save is committed) and tells its supervisor
(:class:`~dask_ddp.wire.messages.Saved`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable

from dask_ddp.checkpoint.whole import save_checkpoint
from dask_ddp.rank.notice_board import END, KEY, Forgeries, NoticeBoard
from dask_ddp.wire.notices import Notice, Seal, Stopped, grace_period

__all__ = ["Preempted", "preempted", "on_preemption", "grace_period", "KEY", "END"]

_FOREVER = timedelta(days=7)  # a watcher's wait: a timed-out wait logs warnings, so wait long


class Preempted(BaseException):
    """Raised by ``report()`` at the step every rank agreed to stop at; a job restarts from what was saved there.

    A ``BaseException`` (like ``KeyboardInterrupt``): an ``except Exception`` in training code lets it pass.
    Attributes: ``step`` (the agreed step), ``cause``, ``deadline`` (``time.time()`` by which the save must be
    committed), ``time_left`` (seconds left now), ``saved`` (dask-ddp saved the registered state).
    """

    def __init__(self, step: int, cause: str, deadline: float, saved: bool = False) -> None:
        super().__init__(f"preempted at step {step}: {cause}")
        self.step, self.cause, self.deadline, self.saved = step, cause, deadline, saved

    @property
    def time_left(self) -> float:
        return self.deadline - time.time()

    def __reduce__(self):
        return (Preempted, (self.step, self.cause, self.deadline, self.saved))


class _Rank:
    """This rank's side of the protocol: its store, its notice, where it stands."""

    def __init__(self, store, rank: int, world_size: int, send: Callable, grace: float, seal: Seal,
                 forgeries: Forgeries):
        self.store, self.rank, self.world_size, self.send, self.grace = store, rank, world_size, send, grace
        self.seal, self.forgeries = seal, forgeries
        self.board = NoticeBoard(store, seal, rank, world_size, forgeries)
        self.notice: Notice | None = None
        self.heard = 0.0  # time.time() the notice reached this rank
        self.posted = False
        self.stop_after: int | None = None  # M: stop at the first report with a step above it
        self.due: Preempted | None = None
        self.raised_by_us = False
        self.forced = False
        self.times: dict[str, float] = {}  # when each phase was reached (time.time()), for job.history and tests
        self.lock = threading.Lock()


_RANK: _Rank | None = None
_SAVE: tuple[Callable[[], dict], dict] | None = None
_EARLY: Notice | None = None  # a notice that came before start()
_POLLED = False  # the code called preempted(): it saves by itself
_WATCHER: threading.Thread | None = None  # this rank's watcher of the notice key
_ON_SIGTERM: Callable | None = None  # the SIGTERM handler start() installed


def sigterm_is_ours() -> bool:
    """Whether SIGTERM does what dask-ddp set (the default, or :func:`start`'s handler), not what the job's
    code set (its own handler, or SIG_IGN): a rank that ends on purpose then lets SIGTERM end it at once."""
    handler = signal.getsignal(signal.SIGTERM)
    return handler is signal.SIG_DFL or (handler is not None and handler is _ON_SIGTERM)


def on_preemption(state: Callable[[], dict], *, all_ranks: bool = False, keep: int | None = None,
                  sharded: bool = False) -> None:
    """Register what to save when this job is preempted: ``state()`` returns the dict to save.

    At the step every rank agreed to stop at, ``report()`` calls ``state()`` and
    ``save_checkpoint(state(), step=that step, all_ranks=all_ranks, keep=keep)`` in the
    job's ``checkpoint_dir``, then raises :class:`Preempted`; the job restarts and
    ``load_checkpoint()`` returns that state. Call it on every rank, before the loop.
    With ``sharded=True`` it is ``save_sharded(state(), that step, keep=keep)`` instead
    (``state()`` returns the dict of model, optimizer and values; ``load_sharded`` resumes
    at any number of ranks); a step the code saved already is not saved again.

    Raises
    ------
    TypeError
        ``state`` is not callable.
    """
    global _SAVE
    if not callable(state):
        raise TypeError(f"on_preemption(state=...) takes a function returning the dict to save, got "
                        f"{type(state).__name__}")
    _SAVE = (state, {"keep": keep, **({"sharded": True} if sharded else {"all_ranks": all_ranks})})


def preempted() -> Preempted | None:
    """The preemption due at this step, or None (always None outside a rank, or before any notice).

    Without :func:`on_preemption`, ``report()`` returns normally at the agreed step and this returns a
    :class:`Preempted`: save with ``save_checkpoint(state, step=p.step)``, then ``raise p``. A ``report()``
    after that step raises it anyway. ``p.time_left`` is the time left in the grace period.
    """
    global _POLLED
    _POLLED = True
    return _RANK.due if _RANK is not None else None


def can_save() -> bool:
    """Whether this rank's code takes part in preemption: it registered a save or polls :func:`preempted`."""
    return _SAVE is not None or _POLLED


# ---- the rank process's side -------------------------------------------------------------------------
def start(store, master_addr: str, port: int, rank: int, world_size: int, send: Callable, grace: float,
          worker: str = "", prefix: str = "", ending: Callable[[], bool] = lambda: False, key: bytes = b"",
          attempt: int = 0) -> None:
    """Set up this rank (in its main thread): the SIGTERM handler and the watcher of its queue of notices.

    ``store``: the job's store under the attempt's ``prefix`` (the watcher opens its own connection to
    ``master_addr:port`` and uses the same prefix). ``key``: the attempt's signing key
    (:attr:`~dask_ddp.wire.task.RankTask.signing_key`), the same in every rank; empty, this rank draws its own
    (a rank alone, as in tests). A SIGTERM is a notice unless ``ending()``: the rank's supervisor ends it on
    purpose (a cancel, a stop: it hangs up first) or it ends itself; then, as in a DataLoader worker or code
    that cannot save, it dies.

    Raises
    ------
    ValueError
        ``key`` is neither empty nor 16 bytes or more.
    """
    global _RANK
    seal = Seal(key or os.urandom(32))
    forgeries = Forgeries(rank, attempt, send)
    _RANK = _Rank(store, rank, world_size, send, grace, seal, forgeries)
    owner = os.getpid()

    def on_sigterm(signum, frame):
        if os.getpid() != owner or ending() or not can_save():  # a DataLoader worker, a stop, code that cannot save
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        announce(Notice(time.time() + grace, f"rank {rank}'s process on worker {worker} received SIGTERM", worker,
                        "signal"), thread=True)

    global _ON_SIGTERM, _WATCHER
    if _ON_SIGTERM is None:  # once per process: a child this rank forks (a multiprocessing Pool's worker, a
        # DataLoader worker) takes SIGTERM's default action, not this handler: Pool.terminate() SIGTERMs its
        # workers and joins them, and with the handler inherited, jobs that used fork Pools hung there
        os.register_at_fork(before=_block_sigterm, after_in_parent=_unblock_sigterm,
                            after_in_child=_default_sigterm_in_child)
    _ON_SIGTERM = on_sigterm
    signal.signal(signal.SIGTERM, on_sigterm)
    _WATCHER = threading.Thread(target=_watch, args=(master_addr, port, prefix, _RANK), name="dask-ddp-notice",
                                daemon=True)
    _WATCHER.start()
    if _EARLY is not None:
        announce(_EARLY)


_FORKING = threading.local()  # .blocked: SIGTERM was blocked in this thread for its fork


def _block_sigterm() -> None:
    """Before a fork, in the forking thread: hold SIGTERM back until the child has SIGTERM's default action.

    Without this a SIGTERM that reaches the child between the fork and :func:`_default_sigterm_in_child` (a Pool
    worker not yet scheduled when ``Pool.terminate()`` signals it) is caught by the inherited Python handler's
    trampoline and then lost (CPython's after-fork reset clears it, and it runs no Python handler for a signal
    whose handler became SIG_DFL): the worker lives on and ``Pool.__exit__`` joins it forever (seen, with
    stack dumps). Blocked, the kernel keeps it pending instead.
    """
    _FORKING.blocked = (signal.getsignal(signal.SIGTERM) is _ON_SIGTERM
                        and signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}))


def _unblock_sigterm() -> None:
    """After a fork, in the parent (and last in the child): undo :func:`_block_sigterm`."""
    if getattr(_FORKING, "blocked", False):
        _FORKING.blocked = False
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _default_sigterm_in_child() -> None:
    """After a fork, in the child: SIGTERM ends it (the rank's handler is the rank's, see :func:`start`); a SIGTERM
    held back since the fork (:func:`_block_sigterm`) is delivered now, with that default action."""
    if signal.getsignal(signal.SIGTERM) is _ON_SIGTERM:  # the job's own handler, if it set one, stays
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:  # not the main thread: the inherited handler still ends a child (it is not the rank)
            pass
    _unblock_sigterm()


def _watch(master_addr: str, port: int, prefix: str, st: _Rank) -> None:
    """The watcher thread: wait on this rank's queue for the first genuine notice (or the job's end)."""
    import torch.distributed as dist

    try:
        own = dist.TCPStore(master_addr, port, is_master=False, timeout=_FOREVER)
        if prefix:
            own = dist.PrefixStore(prefix, own)
        note = NoticeBoard(own, st.seal, st.rank, st.world_size, st.forgeries).next_notice()
        if note is not None:
            _heard(note)
    except Exception:  # noqa: BLE001 - the store closed: the job ended
        return


def release(store, rank: int, world_size: int, wait: float = 2.0) -> None:
    """At the end of a job whose ranks all returned (after the ``done`` count): let the notice watchers go.

    A watcher blocks in a store wait; if rank 0 closed the store under it, torch would print a warning with a
    C++ stack trace into the rank's output. So each rank puts :data:`END` in its own queue (signed: no forged
    end sends a watcher away early), waits up to ``wait`` seconds for its watcher to return and counts itself
    ``released``; rank 0 waits as long for every rank's count. The forged values counted but not yet told
    go to the job now, before the rank's outcome.
    """
    st = _RANK
    try:
        if st is not None:
            st.forgeries.flush()
            if _WATCHER is not None and _WATCHER.is_alive():
                st.board.end()
                _WATCHER.join(wait)
        store.add(KEY + "released", 1)
        if rank == 0:
            _wait_count(store, KEY + "released", world_size, time.time() + wait)
    except Exception:  # noqa: BLE001 - the store is gone: nothing is left to wait for
        return


def announce(note: Notice, thread: bool = False) -> None:
    """A notice reached this rank: note it and publish it to every rank (through the store)."""
    if thread:  # from a signal handler: no store I/O there
        threading.Thread(target=announce, args=(note,), daemon=True).start()
        return
    global _EARLY
    if _RANK is None:  # before the process group exists: kept for start()
        _EARLY = note
        return
    note = _clamped(note, _RANK.grace)
    try:
        _RANK.board.publish(note)  # to every rank's queue, signed; the first notice wins
    except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
        pass
    _heard(note)


def _clamped(note: Notice, grace: float) -> Notice:
    """``note`` with its deadline no later than ``grace`` seconds from now: whoever wrote it, a notice never
    holds a job longer than the grace period (a far deadline would keep cancel() and a dead client waiting)."""
    latest = time.time() + grace
    return note if note.deadline <= latest else replace(note, deadline=latest)


def _heard(note: Notice) -> None:
    st = _RANK
    note = _clamped(note, st.grace)
    with st.lock:
        if st.notice is not None:
            return
        st.notice, st.heard = note, time.time()
    try:
        from dask_ddp.wire.messages import NoticeSeen

        st.send(NoticeSeen(note, can_save()))
    except Exception:  # noqa: BLE001 - the socket closed: the rank is being stopped
        pass


def at_report(step: int) -> None:
    """Called by ``report()`` with each step; once a notice reached this rank: agree on the step, save and stop
    there (before that, and outside a rank, it returns at once). Raises :class:`Preempted` at the agreed step."""
    st = _RANK
    if st is None or st.notice is None:
        return
    if st.due is not None:
        st.forced = st.forced or not st.raised_by_us  # the code did not stop at the agreed step: nothing saved
        raise st.due
    if st.stop_after is None:
        if not st.posted:
            st.board.post("seen", step)
            st.posted, st.times["posted"] = True, time.time()
        steps = st.board.posted("seen")  # None until every rank posted a step signed with the attempt's key
        if steps is None:
            return
        st.stop_after = max(map(int, steps))
        st.times["agreed"] = time.time()
    if step > st.stop_after:
        _stop_at(st, step)


def _stop_at(st: _Rank, step: int) -> None:
    note = st.notice
    st.due = Preempted(step, note.cause, note.deadline)
    st.due.started = time.time()
    if _SAVE is None:
        return  # preempted() tells the code; the next report() raises
    fn, kw = _SAVE
    state = fn()
    if time.time() < note.deadline:  # past it, the leaving rank is gone: a save now could never be committed
        _save(state, step, kw)
        st.due.saved = True
    st.raised_by_us = True
    raise st.due


def _save(state: dict, step: int, kw: dict) -> None:
    from dask_ddp.checkpoint.sharded import api as sharded

    if not kw.get("sharded"):
        save_checkpoint(state, step=step, **kw)
        return
    sharded.wait_sharded()  # an async save in flight commits first (or raises here)
    if step not in {s.step for s in sharded.list_sharded()}:
        sharded.save_sharded(state, step, keep=kw.get("keep"))


def stopped(exc: Preempted) -> Stopped:
    """After the function raised ``exc``: wait until every rank has stopped (the save is committed) and
    return what the supervisor is told. Raises nothing."""
    st = _RANK
    done = time.time()
    committed = _barrier(st, exc.deadline) if st is not None else False
    if st is not None:
        st.forgeries.flush()
    phases = tuple((k, round(v - st.heard, 4)) for k, v in st.times.items()) if st is not None else ()
    note = (st.notice if st is not None else None) or Notice(exc.deadline, exc.cause)
    started = getattr(exc, "started", done)
    saved = exc.saved or (st is not None and not st.forced)  # raised by the code itself: it saved first
    return Stopped(note, step=exc.step, saved=bool(saved), committed=committed,
                   heard=st.heard if st is not None else done, save_took=done - started, commit_time=time.time(),
                   phases=phases)


def _barrier(st: _Rank, deadline: float) -> bool:
    """Every rank has stopped at the agreed step (rank 0's store closing means it saw them all)."""
    try:
        st.board.post("stopped", 1)
        st.times["stopped"] = time.time()
        while time.time() < deadline:
            if st.board.posted("stopped") is not None:  # every rank's own signed mark, not a count anyone can add to
                st.times["all_stopped"] = time.time()
                st.store.add(KEY + "left", 1)
                if st.rank == 0:  # it hosts the store: it stays until the others have seen the count
                    _wait_count(st.store, KEY + "left", st.world_size, min(deadline, time.time() + 5))
                return True
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - rank 0 left: only after every rank had arrived
        return True
    return False


def _wait_count(store, key: str, n: int, until: float) -> None:
    nap = 0.001
    while int(store.add(key, 0)) < n and time.time() < until:
        time.sleep(nap)  # from 1 ms up to 10 ms: the end of a job waits here for its ranks' notice watchers
        nap = min(2 * nap, 0.01)


def _reset_for_tests() -> Any:
    """Forget this process's notice state (for unit tests of the protocol)."""
    global _RANK, _SAVE
    _RANK, _SAVE = None, None

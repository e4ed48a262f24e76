"""``dask_pytorch_ddp.dispatch.run`` (0.2.2): a list of futures, one per worker, on dask-ddp's engine.

Runs in: the client; ``_settle`` (and 0.2.2's ``dispatch_with_ddp``, where code submits it) as a Dask task on a
worker, ``_with_local_rank`` in the rank process.

The job behind the futures is a normal :class:`dask_ddp.Job`. Each returned
future is a small task that depends on one rank's task: it returns the
rank's value when the rank succeeded, and otherwise waits for the job's
verdict and raises the job's root cause. So ``client.gather(futures)``
raises the failing rank's own exception, never the collective error that a
stopped rank saw afterwards (``gather`` raises the error of whichever failed
future it looks at first, in no fixed order). The verdict travels in a Dask
``Variable`` that the client deletes once the futures have read it.

Each future keeps its job alive (``future.job``) and a weak registry maps
future keys to jobs, so :meth:`DaskResultsHandler.process_results
<dask_ddp.compat.results.DaskResultsHandler.process_results>` finds the job
from the futures alone; a job is forgotten once its futures are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
import weakref
from typing import Any, Callable

import cloudpickle
from distributed import Client, Future, Variable, wait
from tblib import pickling_support

from dask_ddp.client import dispatch as job_dispatch
from dask_ddp.client.job import Job
from dask_ddp.rank.context import get_context
from dask_ddp.wire import pickling
from dask_ddp.wire.errors import RankFailedError

__all__ = ["run", "dispatch_with_ddp"]

logger = logging.getLogger("dask_ddp")

_JOBS: "weakref.WeakValueDictionary[str, Job]" = weakref.WeakValueDictionary()  # future key -> job
VERDICT_WAIT = 120.0  # seconds a failed rank's future waits for the job's verdict before raising its own error


class _JobFuture(Future):
    """A future of one rank's result that holds on to its job (pickles as a plain Future)."""

    def __init__(self, key, client, job: Job):
        super().__init__(key, client)
        self.job = job


def run(client: Client, pytorch_function: Callable, *args: Any, backend: str = "nccl", pass_local_rank: bool = False,
        **kwargs: Any) -> list:
    """Run ``pytorch_function(*args, **kwargs)`` on every worker as one DDP job; return the futures.

    The drop-in for ``dask_pytorch_ddp.dispatch.run``: one rank per worker,
    ranks ordered by host then worker, ``torch.distributed`` initialised
    before the function and destroyed after it.

    Parameters
    ----------
    client : distributed.Client
    pytorch_function : callable
        Defined anywhere, a notebook included (it is shipped by value).
    *args, **kwargs
        Passed to ``pytorch_function`` on every rank.
    backend : "nccl", "gloo" or "auto"
        ``"nccl"`` by default, as in 0.2.2; it needs a GPU on every worker. On
        CPU workers pass ``"gloo"``.
    pass_local_rank : bool
        Call ``pytorch_function(*args, local_rank=<index of the rank on its
        host>, **kwargs)``, as 0.2.2 did.

    Returns
    -------
    list of distributed.Future
        One per worker, in rank order, for ``distributed.wait`` and
        ``client.gather``. A future gives its rank's return value; when the
        job failed, every failed rank's future raises the job's root cause:
        the failing rank's own exception, with notes naming its rank and
        worker and what happened to the others.

    Raises
    ------
    TypeError
        ``pytorch_function`` is not callable.
    dask_ddp.SerializationError
        The function or an argument cannot be pickled (names which).
    dask_ddp.PlanError
        Unknown backend, or no workers.
    dask_ddp.ClientClosedError
        The client is not connected.

    Notes
    -----
    ``backend="nccl"`` on a worker without a GPU makes the futures raise
    :class:`dask_ddp.PlanError`, which says to use ``"gloo"``. When a worker
    leaves the cluster during the job, its rank's future is cancelled;
    ``future.job.result()`` then raises :class:`dask_ddp.WorkerLostError`.
    """
    if not callable(pytorch_function):
        raise TypeError(f"run(client, pytorch_function, ...) needs a callable, got "
                        f"{type(pytorch_function).__name__}: {pytorch_function!r}")
    name = f"{getattr(pytorch_function, '__name__', 'fn').strip('<>') or 'fn'}-{uuid.uuid4().hex[:8]}"
    verdict = _Verdict(f"dask-ddp-verdict-{name}")
    fn, fn_args = (_with_local_rank, (pytorch_function, *args)) if pass_local_rank else (pytorch_function, args)
    with _by_value(pytorch_function) if pass_local_rank else contextlib.nullcontext():
        spec = job_dispatch.make_spec(
            client, fn, fn_args, kwargs, workers=None, backend=backend, master_addr=None, name=name,
            callbacks=(verdict,), progress=False, total=None, stall_timeout=None, max_restarts=0,
            checkpoint_dir=None, timeout=None, checkpoint_options=None)
    job = Job(client, spec)._start()
    futures = []
    for rank, rank_future in enumerate(job.futures):
        plain = client.submit(_settle, rank_future, verdict.name, key=f"dask-ddp-compat-{name}-rank{rank}",
                              pure=False, retries=0)
        futures.append(_JobFuture(plain.key, client, job))
        _JOBS[plain.key] = job
    verdict.futures = [Future(f.key, client) for f in futures]
    verdict.ready.set()
    return futures


def dispatch_with_ddp(pytorch_function: Callable, master_addr: Any, master_port: Any, rank: Any, world_size: Any,
                      *args: Any, backend: str = "nccl", **kwargs: Any) -> Any:
    """0.2.2's runner of one rank: ``pytorch_function(*args, **kwargs)`` inside a process group of its own.

    As in 0.2.2, in the calling process (a Dask task runs it in its worker's
    thread): set ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE``,
    ``torch.distributed.init_process_group(backend)`` (``env://``: rank 0 binds
    ``master_port``), call the function, destroy the group. It is for code that
    submitted it to each worker itself::

        client.submit(dispatch_with_ddp, train, host, port, rank, n, backend="gloo", workers=[address])

    :func:`run` does not use it: run's ranks are dask-ddp's (a child process
    each, a port picked by the OS, failures that stop the other ranks), so
    prefer ``run``. Differences from 0.2.2: the four variables are put back as
    they were afterwards, and the group is destroyed only if it was made. The
    variables are the process's: run one call per worker process at a time.

    Returns
    -------
    object
        What ``pytorch_function`` returned.

    Raises
    ------
    RuntimeError
        ``torch.distributed`` is initialised in this process already (inside a
        function started by :func:`run`, whose group is ready: call the
        function itself).
    Exception
        Whatever ``init_process_group`` (a port in use, an unreachable rank 0)
        or ``pytorch_function`` raised.
    """
    import torch.distributed as dist  # seconds to import: not before it is used

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(f"dispatch_with_ddp: torch.distributed is already initialised in this process (rank "
                           f"{dist.get_rank()} of {dist.get_world_size()}; inside dask_ddp.compat.dispatch.run's "
                           f"function?): call the function itself, its process group is ready")
    env = {"MASTER_ADDR": master_addr, "MASTER_PORT": master_port, "RANK": rank, "WORLD_SIZE": world_size}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update({name: str(value) for name, value in env.items()})
    try:
        dist.init_process_group(backend=backend)
        try:
            return pytorch_function(*args, **kwargs)
        finally:
            dist.destroy_process_group()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def job_of(future) -> Job | None:
    """The :class:`dask_ddp.Job` behind a future returned by :func:`run`, or None for any other future."""
    return getattr(future, "job", None) or _JOBS.get(getattr(future, "key", None))


def _settle(outcome, verdict_name: str, wait: float = VERDICT_WAIT):
    """The task behind a returned future: the rank's value, or the job's root cause."""
    if outcome.status == "ok":
        return cloudpickle.loads(outcome.value)
    try:
        blob = Variable(verdict_name).get(timeout=wait)
    except TimeoutError:  # the client went away before deciding: this rank's own error is all we know
        blob = outcome.error
    try:
        error = cloudpickle.loads(blob)
    except Exception:  # noqa: BLE001 - e.g. the root error's class is importable on the client only
        error = cloudpickle.loads(outcome.error)
    raise error


class _Verdict:
    """Job callback: publishes the job's root error for the failed ranks' futures, then deletes it."""

    def __init__(self, name: str):
        self.name = name
        self.futures: list = []
        self.ready = threading.Event()  # set once run() has made the futures
        self.failed = False

    def on_failure(self, job, error: BaseException) -> None:
        pickling_support.install(error)  # the rank's traceback travels with it
        try:
            blob = cloudpickle.dumps(error)
        except Exception:  # noqa: BLE001 - it came unpickled from a rank, but be safe: keep its text
            blob = cloudpickle.dumps(RankFailedError(f"job {job.run_id} failed: {error!r}"))
        Variable(self.name, client=job.client).set(blob)
        self.failed = True
        threading.Thread(target=self._forget, args=(job.client,), name="dask-ddp-verdict", daemon=True).start()

    def on_finish(self, job) -> None:
        if not self.failed:  # every rank returned: nobody waits for a verdict
            self.futures = []

    def _forget(self, client) -> None:
        self.ready.wait(30)
        futures, self.futures = self.futures, []
        try:
            wait(futures, timeout=VERDICT_WAIT + 10)
            Variable(self.name, client=client).delete()
        except Exception:  # noqa: BLE001 - the client closed: the variable went with the scheduler or stays small
            logger.debug("dask-ddp could not delete the verdict variable %s", self.name, exc_info=True)


def _with_local_rank(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Runs in the rank: 0.2.2's ``pass_local_rank=True`` call convention."""
    return fn(*args, local_rank=get_context().local_rank, **kwargs)


@contextlib.contextmanager
def _by_value(fn: Callable):
    """Ship the module of ``fn`` by value while the call is pickled, as ``dispatch.run`` does for its ``fn``.

    Needed because with ``pass_local_rank`` the user's function is an argument
    of :func:`_with_local_rank`, whose own module (dask_ddp) ships by reference.
    """
    mod = pickling.local_module(fn)
    if mod is not None:
        cloudpickle.register_pickle_by_value(mod)
    try:
        yield
    finally:
        if mod is not None:
            cloudpickle.unregister_pickle_by_value(mod)

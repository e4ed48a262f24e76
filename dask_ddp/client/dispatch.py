"""``dask_ddp.dispatch.run``: start a DDP job on a Dask cluster, one rank per worker.

Runs in: the client (the notebook).

Everything is validated here, on the client, before anything ships: the
function and every argument must pickle (cloudpickle, so a function defined
in a notebook travels by value), the workers must exist, the backend must be
known. The result is a frozen :class:`~dask_ddp.wire.spec.LaunchSpec`; the
:class:`~dask_ddp.client.job.Job` and its controller own everything live.

For the layers above (``dask_ddp.sweeps``, ``dask_ddp.compat``), an internal API, not the user's:
:func:`start` (``run`` with two options that a user never sets: the job's results kept pickled, its
``warm-cuda``), :func:`make_spec` (``run``'s checks and the job's spec, nothing started),
:func:`check_function` and :func:`plan_ranks` (the ranks that a ``workers=`` selection gives now). What ships
and how is :mod:`dask_ddp.wire.pickling`'s (``dumps_call``, ``local_module``).
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import re
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Sequence

import dask

from dask_ddp import config  # noqa: F401 - loads ddp.yaml into dask.config
from dask_ddp.client import detach as detach_module
from dask_ddp.client.accelerate_config import accelerate_environment
from dask_ddp.client.callbacks import HOOKS
from dask_ddp.client.cluster import check_client, scheduler_workers
from dask_ddp.client.control import LocalControl
from dask_ddp.client.detach import attach
from dask_ddp.client.job import Job
from dask_ddp.client.live import RECOVERY
from dask_ddp.dashboard import install as install_dashboard
from dask_ddp.wire import pickling
from dask_ddp.wire import plan as planning
from dask_ddp.wire.errors import PlanError
from dask_ddp.wire.events import EventLimits
from dask_ddp.wire.spec import LaunchSpec
from dask_ddp.worker import plugin

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["run", "attach", "warm_up", "LaunchSpec"]  # the layers above use the functions named up top too

BACKENDS = ("auto", "nccl", "gloo")
MAX_NAME = 100


def _number(name: str, value, *, minimum: float = 0, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < minimum:
        raise PlanError(f"{name}={value!r}: expected a finite number >= {minimum}" + (" or None" if allow_none else ""))
    return value


def run(client: Client, fn: Callable, *args: Any, workers: Any = None, backend: str | None = None,
        master_addr: str | None = None, name: str | None = None, callbacks: Sequence = (),
        progress: bool = True, total: int | None = None, stall_timeout: float | None = None,
        max_restarts: int = 0, checkpoint_dir: str | None = None, checkpoint_options: dict | None = None,
        timeout: float | None = None, detach: bool = False, recovery: str = "restart",
        accelerate_config: str | os.PathLike | None = None, **kwargs: Any) -> Job:
    """Run ``fn(*args, **kwargs)`` once per worker as a rank of one DDP job; return a :class:`Job` at once.

    Inside ``fn`` the torch process group is initialised (it ends with the
    rank's process, once ``fn`` has returned or raised and its outcome is
    sent), torchrun's environment variables are set, and
    :func:`dask_ddp.get_context` gives rank, world size and device. Each rank
    runs in a child process of its Dask worker, so a hung rank can be killed
    without restarting the worker and ``DataLoader(num_workers>0)`` works.

    Parameters
    ----------
    client : distributed.Client
    fn : callable
        The training function; defined anywhere, a notebook included (it is
        shipped by value).
    *args, **kwargs
        Passed to ``fn`` on every rank. Keyword names of ``run`` itself (below)
        are taken by ``run``.
    workers : None, int, list of str, or (min, max)
        Every worker (default), the first ``n`` in rank order, worker
        addresses/names (a list), or elastic bounds: a tuple ``(min, max)``
        starts on as many workers as there are up to ``max`` (None: no limit)
        and, with ``max_restarts``, restarts after a loss on the workers left
        if at least ``min`` are there. Ranks are ordered by host, then worker
        name, then port.
    backend : "auto", "nccl" or "gloo"
        ``auto`` (default, ``ddp.backend``) picks nccl when every rank has a
        GPU of its own and gloo otherwise (ranks sharing a GPU train on it
        with gloo); ``gloo`` keeps the ranks on the CPU. How ranks get their
        GPUs: :mod:`dask_ddp.rank.devices`.
    master_addr : str
        Host of the rendezvous store; default rank 0's host as the scheduler sees it.
    name : str
        The job's name (default the function's); the run id is the name, made safe for keys and paths,
        then 8 random hex digits, so two jobs of one name never share anything.
    callbacks : sequence
        Plain callables receive every event (metric and log dicts); objects may
        define ``on_start(job)``, ``on_metrics(event)``, ``on_log(event)``,
        ``on_failure(job, error)``, ``on_restart(job, attempt)``, ``on_finish(job)``.
        They run in the job's watcher thread: ``job.cancel()`` there returns at
        once (early stopping), ``job.result()`` gives the outcome in
        ``on_failure``/``on_finish`` and raises RuntimeError before (it would
        wait forever). A callback that raises is logged and disabled.
    progress : bool
        Show a progress bar in ``wait``/``result``. ``total``: steps for the bar.
    stall_timeout : float
        Seconds a rank may go without progress, counted from its first (so slow
        starts never count); then the job fails with every rank's stack dump.
        Progress is a ``report()``, or a step the rank's telemetry counted (a
        DDP step, a live step, a batch drawn): a loop that never reports is
        watched too. Default ``ddp.stall-timeout`` (off).
    max_restarts : int
        Restart the whole group this many times after a failure: with the same
        number of workers (waiting up to ``ddp.restart-wait`` seconds for
        them), or within the elastic bounds of ``workers=(min, max)``.
    checkpoint_dir : str
        fsspec URL for :func:`dask_ddp.save_checkpoint` / ``load_checkpoint``; the job
        uses its own folder in it, ``<checkpoint_dir>/<run_id>`` (``job.checkpoint_dir``),
        which its restarts share and other jobs never touch.
    checkpoint_options : dict
        fsspec storage options for ``checkpoint_dir`` (endpoint, credentials).
    timeout : float
        Collective and store timeout in seconds (default ``ddp.timeout``).
    detach : bool
        False (default): the job lives as long as this client; when it closes, disconnects or its kernel
        dies, every rank is stopped. True: the job's controller runs in the scheduler's process and the
        job keeps running without this client; any client can :func:`attach` to it by name or run id
        (:mod:`dask_ddp.client.detach`). A detached job takes no ``callbacks``.
    accelerate_config : path, optional
        An ``accelerate config`` file (mixed precision, FSDP, dynamo, ...), applied to every rank as
        ``accelerate launch --config_file`` applies it: the variables its launcher would set that configure
        Accelerate (``ACCELERATE_*``, ``FSDP_*``), made by Accelerate's own code (needs Accelerate where ``run``
        is called; :mod:`dask_ddp.client.accelerate_config`). ``Accelerator()`` and Transformers' ``Trainer`` in
        ``fn`` read them; the ranks, world and rendezvous stay dask-ddp's.
    recovery : "restart" or "live"
        ``restart`` (default): every fault ends the attempt, and ``max_restarts`` restarts it.
        ``live``: when a rank's process dies or its worker is lost, the other ranks go on in their
        processes with a group re-formed without it, at the step they were at; the training loop runs
        under :func:`dask_ddp.live_steps` (:mod:`dask_ddp.rank.live`). The job's result is the values of the
        ranks that finished it. Rank 0's loss, a failure of the code, and fewer ranks left than
        ``workers=(min, max)``'s ``min`` still end the attempt.

    Raises
    ------
    TypeError
        ``fn`` is not callable, is a generator or async function; a callback is neither a callable nor
        an object with callback methods; ``checkpoint_dir`` is not a path or URL; ``client`` is asynchronous
        and called from its event loop (call ``run`` in a thread: ``asyncio.to_thread``).
    SerializationError
        ``fn`` or an argument cannot be pickled (names which).
    FileNotFoundError, ValueError, ImportError
        ``accelerate_config`` is not a file, not one Accelerate reads (or asks for DeepSpeed or a TPU), or
        Accelerate is not installed here.
    PlanError
        Bad ``workers=``, unknown backend or ``recovery``, bad numbers.
    ClientClosedError
        The client is not connected.
    """
    return start(client, fn, args, kwargs, workers=workers, backend=backend, master_addr=master_addr, name=name,
                 callbacks=callbacks, progress=progress, total=total, stall_timeout=stall_timeout,
                 max_restarts=max_restarts, checkpoint_dir=checkpoint_dir, checkpoint_options=checkpoint_options,
                 timeout=timeout, detach=detach, recovery=recovery, accelerate_config=accelerate_config)


def start(client: Client, fn: Callable, args: Sequence, kwargs: dict, *, pickled: bool = False,
          warm_cuda: bool | None = None, detach: bool = False, callbacks: Sequence = (), **options: Any) -> Job:
    """:func:`run` for the layers above: ``fn(*args, **kwargs)``, ``run``'s own keywords in ``options`` (their
    defaults where left out), and two that a user never sets.

    ``pickled=True``: the job keeps its ranks' return values and exceptions pickled (``job.result()`` gives the
    bytes, as a detached job's), for a caller in the scheduler's process, where unpickling one would run whatever
    its ``__reduce__`` names (a detached sweep's driver). ``warm_cuda``: ``ddp.warm-cuda`` for this job (None:
    the config's; a sweep's driver gives ``ddp.sweep.warm-cuda``).

    Raises
    ------
    TypeError, SerializationError, PlanError, ClientClosedError
        As :func:`run` (TypeError too for a keyword in ``options`` that ``run`` does not take).
    """
    if not isinstance(detach, bool):
        raise TypeError(f"detach={detach!r}: expected True or False")
    if detach and callbacks:
        raise TypeError("a detached job takes no callbacks (they would run in the scheduler's process): attach "
                        "to it and read job.stream() instead")
    spec = make_spec(client, fn, args, kwargs, callbacks=callbacks, warm_cuda=warm_cuda, **options)
    install_dashboard(client)  # the DDP page and /metrics gauges on the scheduler (once; never raises)
    if detach:
        return detach_module.launch(client, spec)
    return Job(client, spec, LocalControl(client, spec, raw_results=pickled))._start()


def warm_up(client: Client, workers: Any = None, timeout: float = 120) -> dict[str, bool]:
    """Start each worker's zygote (torch imported; it forks the ranks) now, so that the first job starts fast.

    A worker starts its zygote at its first job anyway and keeps it (``ddp.warm-spare``; with
    ``ddp.zygote: false``, one spare rank process instead); call this once after the cluster starts
    to make the first job fast too. Waits until they are ready (about the time of one ``import torch``).

    Parameters
    ----------
    workers : None, int or list of str
        As in :func:`run`: every worker (default), the first ``n``, or addresses/names.
    timeout : float
        Seconds to wait for them to be ready.

    Returns
    -------
    dict
        ``{worker address: True if its zygote (or spare) was ready in time}``.

    Raises
    ------
    ClientClosedError
        The client is not connected.
    TypeError
        An asynchronous client called from its event loop (call ``warm_up`` in a thread).
    PlanError
        Bad ``workers=``.
    """
    check_client(client)
    timeout = _number("timeout", timeout)
    plan = plan_ranks(client, workers)
    plugin.register(client)
    return client.run(plugin.warm_spare, timeout, workers=list(plan.addresses))


def plan_ranks(client, workers: Any, master_addr: str | None = None) -> planning.RankPlan:
    """Choose ``workers=`` (as :func:`run` takes it) among every worker the scheduler has now; give each a rank.

    Raises
    ------
    PlanError
        Bad ``workers=`` (names workers the scheduler does not have, more than there are, ...).
    """
    return planning.make_plan(planning.workers_from_scheduler_info({"workers": scheduler_workers(client)}), workers,
                              master_addr)


def check_function(fn) -> None:
    """Check that ``fn`` can be a rank's function: a plain callable, not a generator or async function.

    Raises
    ------
    TypeError
        ``fn`` is not callable, or is an async or generator function (the message says how to wrap it).
    """
    if not callable(fn):
        raise TypeError(f"run(client, fn, ...) needs a callable fn, got {type(fn).__name__}: {fn!r}")
    call = fn if inspect.isfunction(fn) or inspect.ismethod(fn) or not hasattr(fn, "__call__") else fn.__call__
    for target in (fn, call):
        if inspect.iscoroutinefunction(target) or inspect.isasyncgenfunction(target):
            raise TypeError(f"run(client, fn, ...): {getattr(fn, '__qualname__', fn)!r} is an async function; a rank "
                            "runs a plain function. Wrap it: def train(): return asyncio.run(main())")
        if inspect.isgeneratorfunction(target):
            raise TypeError(f"run(client, fn, ...): {getattr(fn, '__qualname__', fn)!r} is a generator function: its "
                            "body would never run. Return the result instead of yielding it (report progress "
                            "with dask_ddp.report)")


def _check_callbacks(callbacks) -> tuple:
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks= takes a list of callables or callback objects, got {type(callbacks).__name__}")
    for i, cb in enumerate(callbacks):
        if not (callable(cb) or any(callable(getattr(cb, h, None)) for h in HOOKS)):
            raise TypeError(f"callbacks[{i}] is {cb!r} ({type(cb).__name__}): a callback is a callable, or an object "
                            f"with one or more of the methods {', '.join(HOOKS)}")
    return tuple(callbacks)


def _check_checkpoint(checkpoint_dir, checkpoint_options) -> tuple[str | None, dict]:
    if checkpoint_dir is not None:
        if not isinstance(checkpoint_dir, (str, os.PathLike)):
            raise TypeError(f"checkpoint_dir={checkpoint_dir!r}: expected a path or fsspec URL (str), "
                            f"got {type(checkpoint_dir).__name__}")
        checkpoint_dir = os.fspath(checkpoint_dir)
        if not isinstance(checkpoint_dir, str) or not checkpoint_dir.strip():
            raise ValueError(f"checkpoint_dir={checkpoint_dir!r}: give a folder path or an fsspec URL "
                             "(s3://bucket/prefix, /shared/ckpt)")
    if checkpoint_options is not None and not isinstance(checkpoint_options, Mapping):
        raise TypeError(f"checkpoint_options= takes a dict of fsspec storage options, got "
                        f"{type(checkpoint_options).__name__}")
    return checkpoint_dir, dict(checkpoint_options or {})


def _run_id(name, fn_name: str) -> str:
    """A run id unique even when ``name`` repeats: the name (or the function's), made safe, then 8 random hex."""
    if name is not None and (not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME):
        raise PlanError(f"name={name!r}: expected a non-empty str of at most {MAX_NAME} characters")
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name if name is not None else fn_name).strip("-.")[:64] or "job"
    return f"{slug}-{uuid.uuid4().hex[:8]}"


def make_spec(client, fn, args, kwargs, *, workers=None, backend=None, master_addr=None, name=None, callbacks=(),
              progress=True, total=None, stall_timeout=None, max_restarts=0, checkpoint_dir=None, timeout=None,
              checkpoint_options=None, warm_cuda: bool | None = None, recovery: str = "restart",
              accelerate_config=None) -> LaunchSpec:
    """Everything :func:`run` checks, and the job's spec (``ddp.*`` read now), without starting anything; the
    keywords and their defaults are ``run``'s, ``warm_cuda`` is :func:`start`'s.

    Raises
    ------
    TypeError, SerializationError, PlanError, ClientClosedError
        As :func:`run`, with the same messages.
    """
    check_client(client)
    check_function(fn)
    fn_name = getattr(fn, "__name__", "fn").strip("<>") or "fn"
    run_id = _run_id(name, fn_name)
    callbacks = _check_callbacks(callbacks)
    checkpoint_dir, checkpoint_options = _check_checkpoint(checkpoint_dir, checkpoint_options)
    if master_addr is not None and (not isinstance(master_addr, str) or not master_addr.strip()):
        raise PlanError(f"master_addr={master_addr!r}: expected a host name or address (str), or None for rank 0's")
    cfg = dask.config.get("ddp")
    backend = cfg["backend"] if backend is None else backend
    if backend not in BACKENDS:
        raise PlanError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise PlanError(f"max_restarts={max_restarts!r}: expected an int >= 0")
    if recovery not in RECOVERY:
        raise PlanError(f"recovery={recovery!r}: expected one of {', '.join(map(repr, RECOVERY))}")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 1):
        raise PlanError(f"total={total!r}: expected a positive int or None")
    call = pickling.dumps_call(fn, args, kwargs)
    plan = plan_ranks(client, workers, master_addr)
    env = accelerate_environment(accelerate_config, len(plan.ranks)) if accelerate_config is not None else {}
    return LaunchSpec(
        call=call, fn_name=fn_name, run_id=run_id, first_plan=plan, workers=workers,
        backend=backend, master_addr=master_addr, name=name,
        timeout=_number("timeout", cfg["timeout"] if timeout is None else timeout, minimum=1),
        rendezvous_timeout=cfg["rendezvous-timeout"], spawn_timeout=cfg["spawn-timeout"],
        poll_interval=cfg["poll-interval"],
        flush_interval=_number("ddp.events.flush-interval", cfg["events"]["flush-interval"], minimum=0.001),
        max_batches_per_second=_number("ddp.events.max-batches-per-second", cfg["events"]["max-batches-per-second"],
                                       allow_none=True),
        events_per_host=_per_host(cfg["events"].get("per-host", "auto")), event_limits=_limits(cfg["events"]),
        restart_wait=_number("ddp.restart-wait", cfg["restart-wait"]),
        stall_timeout=_number("stall_timeout", cfg["stall-timeout"] if stall_timeout is None else stall_timeout,
                              minimum=0.1, allow_none=True),
        worker_timeout=_number("ddp.worker-timeout", cfg["worker-timeout"], minimum=0, allow_none=True),
        max_restarts=max_restarts, recovery=recovery, checkpoint_dir=checkpoint_dir, progress=bool(progress),
        total=total,
        echo_logs=cfg["echo-logs"], callbacks=callbacks, checkpoint_options=checkpoint_options,
        warm_cuda=bool(cfg.get("warm-cuda", False) if warm_cuda is None else warm_cuda), env=env,
        **_telemetry(cfg["telemetry"]))


def _limits(cfg: dict) -> EventLimits:
    """``ddp.events.max-*``: what one rank may send (integers >= 1, see :class:`~dask_ddp.wire.events.EventLimits`)."""
    names = {"batch_bytes": "max-batch-bytes", "interval_bytes": "max-bytes-per-interval",
             "report_bytes": "max-report-bytes", "report_keys": "max-report-keys", "key_length": "max-key-length"}
    return EventLimits(**{field: int(_number(f"ddp.events.{key}", cfg[key], minimum=1))
                          for field, key in names.items()})


def _per_host(value) -> bool | str:
    """``ddp.events.per-host``: auto, true or false (the strings too, as an environment variable gives them)."""
    text = str(value).strip().lower()
    if value is True or text in ("true", "yes", "1"):
        return True
    if value is False or text in ("false", "no", "0"):
        return False
    if text == "auto":
        return "auto"
    raise PlanError(f"ddp.events.per-host={value!r}: expected auto, true or false")


def _telemetry(cfg: dict) -> dict:
    """The spec's telemetry fields from ``ddp.telemetry`` (both None when it is off)."""
    if not cfg["enabled"]:
        return {"telemetry_interval": None, "straggler_window": None}
    return {"telemetry_interval": _number("ddp.telemetry.interval", cfg["interval"], minimum=0.1),
            "straggler_window": _number("ddp.telemetry.straggler-window", cfg["straggler-window"], minimum=0,
                                        allow_none=True)}

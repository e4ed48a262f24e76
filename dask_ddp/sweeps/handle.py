"""``dask_ddp.sweep``: many DDP trials on one Dask cluster, searched and early-stopped by Optuna.

Runs in: the client (the notebook). :func:`sweep` validates everything before anything ships and
returns a :class:`Sweep` at once; the sweep's driver thread (:mod:`.driver`) runs
the trials, each a :func:`dask_ddp.dispatch.run` job pinned to its own workers. Sweep states::

    RUNNING -> FINISHED    (every trial ended)
            -> FAILED      (max_failures trials failed, or the driver failed; running trials were cancelled)
            -> CANCELLED   (sweep.cancel(), or the Dask client closed)

With ``detach=True`` the driver runs in the scheduler's process instead and the sweep outlives the notebook;
:func:`attach_sweep` follows it from a new kernel
(:mod:`.detach`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import dask
import pandas as pd

from dask_ddp.client import dispatch
from dask_ddp.client.cluster import check_client
from dask_ddp.observe.mlflow_sink import MLflowSink
from dask_ddp.observe.progress import SweepProgress
from dask_ddp.sweeps import checks, search
from dask_ddp.sweeps import detach as sweep_detach
from dask_ddp.sweeps import inherit as sweep_resume
from dask_ddp.sweeps import names as sweep_names
from dask_ddp.sweeps import pickup as sweep_continue
from dask_ddp.sweeps.driver import Driver, SweepSpec
from dask_ddp.sweeps.trial import COLUMNS, TRIAL_ENDED, TRIAL_STATES
from dask_ddp.wire import pickling

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["sweep", "Sweep", "attach_sweep"]

MODES = ("min", "max")
SWEEP_ENDED = ("FINISHED", "FAILED", "CANCELLED")


def sweep(client: Client, train_fn: Callable, space: dict, *, n_trials: int, metric: str, ranks_per_trial: Any = 1,
          mode: str = "min", scheduler: Any = "asha", sampler: Any = None, max_concurrent: int | None = None,
          max_workers: int | None = None, workers: Sequence[str] | None = None, max_failures: int | None = 3,
          args: Sequence = (), kwargs: dict | None = None, run_options: dict | None = None,
          storage: Any = None, name: str | None = None, seed: int | None = None, progress: bool = True,
          detach: bool = False, exploit: bool = False, mlflow: Any = None,
          load_if_exists: bool = False) -> "Sweep":
    """Run ``n_trials`` trials of ``train_fn``, each a DDP job of its own, on ``client``'s cluster; return a
    :class:`Sweep` at once.

    Each trial gets parameters from Optuna's ``sampler`` over ``space``; they reach ``train_fn`` as keyword
    arguments (``train_fn(*args, **kwargs, **params)``), the same on every rank since they are the job's
    arguments. ``train_fn`` reports the metric with ``dask_ddp.report(**{metric: value})``; rank 0's reports
    count (average over ranks first, e.g. with :func:`dask_ddp.all_reduce_mean`, where they differ), at the
    report's ``step``. A trial's value is its last report. The ``scheduler`` (an Optuna pruner) decides at
    each report whether to stop the trial; a pruned trial's ranks all stop at one agreed report (the
    preemption protocol: :meth:`Job.stop <dask_ddp.client.job.Job.stop>`; what :func:`dask_ddp.on_preemption`
    registered is saved there), or, if they reach no report within ``ddp.sweep.prune-grace`` seconds, are
    killed together (no rank is left waiting in a collective); their processes exit and their memory, GPU
    memory included, is freed. It is recorded PRUNED at the step of the decision (``pruned_at``; its ranks
    stopped at ``stopped_step``), and what its ranks reported after that step does not count.

    A trial of ``k`` ranks starts only when ``k`` workers are free, on all ``k`` at once, on one host where
    one has room (best fit), else on as few hosts as possible; its workers are free again once all its ranks
    have stopped.

    Parameters
    ----------
    train_fn : callable
        What :func:`dask_ddp.dispatch.run` takes.
    space : dict
        ``{name: entry}``: an Optuna distribution, a list of choices, ``{"low": .., "high": .., "log": ..,
        "step": ..}`` (int when both bounds are ints), or a fixed value
        (see :func:`~.search.distributions`).
    n_trials : int
        How many trials to run.
    metric : str
        The key of ``report()`` that Optuna optimises; ``mode``: ``"min"`` or ``"max"``.
    ranks_per_trial : int, str or callable
        Ranks of every trial (int), the name of a parameter of ``space`` that holds it, or
        ``f(params) -> int``.
    scheduler : str or optuna pruner
        ``"asha"`` (SuccessiveHalvingPruner, default), ``"hyperband"``, ``"median"``, ``"none"``, or a pruner.
    sampler : str or optuna sampler
        ``"tpe"`` (default), ``"random"``, ``"grid"`` (lists only), ``"gp"`` (needs scipy), or a sampler.
    max_concurrent : int
        At most this many trials run at once (default: as many as fit).
    max_workers, workers
        At most ``max_workers`` workers busy with this sweep's trials at once, and only ``workers`` (addresses
        or names): the rest of the cluster stays free for other jobs.
    max_failures : int or None
        The sweep stops (FAILED, running trials cancelled) once this many trials have failed; None: never.
    args, kwargs
        Fixed arguments of every trial.
    run_options : dict
        More keywords for each trial's :func:`~dask_ddp.dispatch.run` (``backend``, ``stall_timeout``,
        ``timeout``, ``checkpoint_dir``, ...).
    storage : str or optuna storage
        Where the Optuna study lives (default in memory): e.g. ``"sqlite:///sweep.db"``. With ``detach=True`` a
        relative SQLite path is made absolute here, in this client's working folder, since the driver opens it in
        the scheduler's process: the file must be where both see it at that path (one machine, a shared disk).
    name : str
        The sweep's (and its study's) name; default the function's name and 8 random hex digits.
    seed : int
        The sampler's seed.
    progress : bool
        Show a progress bar over the trials in :meth:`Sweep.wait`.
    detach : bool
        Run the sweep's driver in the scheduler's process: the sweep outlives this client (a kernel restart),
        and :func:`dask_ddp.attach_sweep` follows it from any client by ``name``
        (:mod:`.detach`). Without it, a client that closes or dies stops every trial.
    exploit : bool
        PBT-style: every new trial starts from the checkpoint of the best ended trial so far, with the sampler's
        new parameters (needs ``run_options={"checkpoint_dir": ...}`` and a ``train_fn`` that takes
        ``resume_from``; see :mod:`.inherit` and :meth:`Sweep.resume`).
    mlflow : MLflowSink
        A :class:`dask_ddp.MLflowSink` as a template: the sweep gets a parent run in its tracking store and
        experiment, each trial a child run under it with its parameters and metrics
        (:mod:`.mlflow_runs`).
    load_if_exists : bool
        Continue the study ``name`` that ``storage`` holds (a sweep whose notebook died): its ended trials count
        against ``n_trials`` and show in ``results()``; those it left running are failed as interrupted and
        asked again, from their own checkpoints where ``train_fn`` takes ``resume_from``
        (:mod:`.pickup`). Not with ``detach=True`` (:func:`attach_sweep` follows a
        detached sweep).

    Raises
    ------
    ImportError
        Optuna is not installed.
    TypeError
        A bad ``space`` entry, ``train_fn`` not callable (or async, or a generator), bad argument types (names
        which).
    SerializationError
        ``train_fn`` or one of ``args``/``kwargs`` cannot be pickled to ship to the workers (names which).
    ValueError
        A space Optuna cannot parse, an unknown ``mode``/``sampler``/``scheduler``, a parameter name that
        clashes with ``kwargs`` or with ``dispatch.run``'s own keywords; a sweep named ``name`` runs on the
        cluster already (the DDP page, Prometheus and :func:`attach_sweep` know a sweep by its name).
    PlanError
        ``ranks_per_trial`` (an int) larger than the workers the sweep may use, or bad counts.
    ClientClosedError
        The client is not connected.
    optuna.exceptions.DuplicatedStudyError
        ``name`` names a study that ``storage`` holds already: give another name, or ``load_if_exists=True``
        to continue it.
    """
    optuna = search.optuna_module()
    check_client(client)
    dispatch.check_function(train_fn)
    searched, fixed = search.distributions(space)
    kwargs = dict(kwargs or {})
    pickling.dumps_call(train_fn, tuple(args), kwargs)  # the parameters are checked with each trial
    run_options = dict(run_options or {})
    checks.check_names(searched, fixed, kwargs, run_options)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use 'min' or 'max'")
    if not isinstance(metric, str) or not metric:
        raise TypeError(f"metric={metric!r}: give the name of a key that train_fn reports")
    n_trials = checks.count("n_trials", n_trials)
    max_concurrent = checks.count("max_concurrent", max_concurrent, allow_none=True)
    max_workers = checks.count("max_workers", max_workers, allow_none=True)
    max_failures = checks.count("max_failures", max_failures, allow_none=True)
    ranks = checks.ranks_rule(ranks_per_trial, searched, fixed)
    workers = checks.check_workers(client, workers, max_workers, ranks_per_trial)
    resume_arg = sweep_resume.takes_resume(train_fn)
    if mlflow is not None and not isinstance(mlflow, MLflowSink):
        raise TypeError(f"mlflow={mlflow!r}: give a dask_ddp.MLflowSink (its tracking store and experiment)")
    if resume_arg and "resume_from" in {**searched, **fixed, **kwargs}:
        raise ValueError("resume_from is the sweep's argument (the checkpoint folder a trial starts from): keep it "
                         "out of space and kwargs")
    if load_if_exists and (storage is None or detach or not name):
        raise ValueError("load_if_exists=True continues a study kept in a storage: give storage= (e.g. "
                         "'sqlite:///sweep.db') and the sweep's name=, without detach=True (attach_sweep follows a "
                         "detached sweep)")
    if exploit and not (resume_arg and run_options.get("checkpoint_dir")):
        raise ValueError("exploit=True starts trials from other trials' checkpoints: pass run_options="
                         "{'checkpoint_dir': url} and give train_fn a resume_from=None parameter")
    name = name or f"{getattr(train_fn, '__name__', 'sweep').strip('<>')}-{uuid.uuid4().hex[:8]}"
    storage = sweep_detach.absolute_storage(storage) if detach else storage  # the scheduler's folder is another
    study_kw = {"storage": storage, "study_name": name, "direction": "minimize" if mode == "min" else "maximize",
                "sampler": search.make_sampler(sampler, searched, seed), "pruner": search.make_pruner(scheduler)}
    spec = SweepSpec(name=name, fn=train_fn, args=tuple(args), kwargs=kwargs, fixed=fixed, ranks=ranks,
                     metric=metric, minimize=mode == "min", n_trials=n_trials, max_concurrent=max_concurrent,
                     max_workers=max_workers, workers=workers, max_failures=max_failures, run_options=run_options,
                     progress=bool(progress), resume_arg=resume_arg, exploit=bool(exploit), mlflow=mlflow,
                     warm_cuda=bool(dask.config.get("ddp.sweep.warm-cuda", False)))
    if detach:
        if storage is not None:
            optuna.create_study(**study_kw)  # refuses a name the storage holds already, here
        return Sweep(client, spec, sweep_detach.launch(client, spec, searched, study_kw))._start()
    sweep_names.claim(client, name)  # one running sweep of a name on a cluster; released at the sweep's end
    try:
        driver = Driver(client, spec, optuna.create_study(load_if_exists=load_if_exists, **study_kw), searched)
        driver.view.claimed = True
        if load_if_exists:
            sweep_continue.adopt(driver)
        return Sweep(client, spec, driver)._start()
    except BaseException:
        sweep_names.release(client, name)
        raise


def attach_sweep(client: Client, name: str, *, progress: bool | None = None) -> "Sweep":
    """Follow a detached sweep (``sweep(..., detach=True)``) by its name, from any client of its cluster (a
    new kernel): ``results()`` shows every trial it has asked, ``wait()`` follows it, ``cancel()`` stops it,
    ``resume()`` continues a trial while it runs (:mod:`.detach`).

    ``progress`` defaults to the sweep's own setting.

    Raises
    ------
    SweepNotFound
        The scheduler knows no detached sweep of that name (it restarted, the sweep ended more than
        ``ddp.detached.keep`` sweeps ago, or the sweep was not detached: a sweep started without
        ``detach=True`` ends with its notebook).
    ClientClosedError
        The client is not connected.
    """
    spec, driver = sweep_detach.find(client, name, progress)
    return Sweep(client, spec, driver)._start()


class Sweep:
    """A running sweep, returned by :func:`dask_ddp.sweep`.

    Attributes
    ----------
    name : str
        The sweep's name (its Optuna study's too).
    study : optuna.Study
        The study: every trial's parameters, intermediate values and end (read it; the sweep tells it).
    state : str
        RUNNING, FINISHED, FAILED or CANCELLED (see :mod:`.handle`); ``cause`` says why it ended.
    """

    def __init__(self, client: Client, spec: SweepSpec, driver: Any) -> None:
        self.client, self.spec, self._driver = client, spec, driver
        self.name = spec.name

    def _start(self) -> "Sweep":
        self._driver.start()
        return self

    @property
    def study(self) -> Any:
        return self._driver.study

    @property
    def detached(self) -> bool:
        """Whether the sweep's driver runs in the scheduler's process (``detach=True``, or :func:`attach_sweep`)."""
        return bool(getattr(self._driver, "remote", False))

    @property
    def state(self) -> str:
        return self._driver.state

    @property
    def cause(self) -> str:
        return self._driver.cause

    def done(self) -> bool:
        """True once the sweep has ended and none of its trials runs a rank."""
        return self.state in SWEEP_ENDED

    def wait(self, timeout: float | None = None, *, progress: bool | None = None) -> bool:
        """Block until the sweep ends or ``timeout`` seconds pass, with a progress bar over the trials (default:
        the sweep's ``progress=``); True if it ended. Never raises for failed trials (read :meth:`results`).

        Raises
        ------
        KeyboardInterrupt
            Ctrl-C while waiting: the sweep is cancelled first (its trials stop), a note on the exception says so.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        bar = SweepProgress(self) if (self.spec.progress if progress is None else progress) else None
        try:
            while not self.done():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                with self._driver.cond:
                    self._driver.cond.wait(0.2 if left is None else min(0.2, left))
                if bar:
                    bar.update()
        except KeyboardInterrupt as exc:
            if self.detached:
                exc.add_note(f"[dask-ddp] detached sweep {self.name} keeps running; "
                             f"dask_ddp.attach_sweep(client, {self.name!r}).cancel() stops it")
                raise
            self._driver.stop("CANCELLED", "interrupted (Ctrl-C) while waiting")
            exc.add_note(f"[dask-ddp] sweep {self.name} was cancelled: its trials stop within seconds")
            raise
        finally:
            if bar:
                bar.close()
        return self.done()

    def cancel(self, timeout: float = 60) -> bool:
        """Stop the sweep: queued trials are dropped, running ones cancelled (every rank stopped); waits up to
        ``timeout`` seconds for them; True once the sweep has ended (CANCELLED, unless it had ended before)."""
        if not self.done():
            self._driver.stop("CANCELLED", "sweep.cancel() was called")
        return self.wait(timeout, progress=False)

    def resume(self, trial: int, *, ranks: int | None = None, params: dict | None = None) -> None:
        """Run a new trial that continues ended trial ``trial`` from its last checkpoint (a pruned trial resumed,
        a good one promoted), with its parameters updated by ``params`` (PBT-style), on ``ranks`` ranks (default
        the same); it runs next, and does not count against ``n_trials``; a FINISHED sweep runs again for it.
        ``train_fn`` gets the folder as ``resume_from`` (see :mod:`.inherit`); the new
        trial's ``resumed_from`` column names ``trial``.

        Raises
        ------
        ValueError
            No such ended trial; no ``checkpoint_dir`` in ``run_options``; unknown ``params``; the sweep was
            cancelled or failed (or, detached, has ended).
        TypeError
            ``train_fn`` takes no ``resume_from``; bad ``ranks`` or ``params``.
        """
        with self._driver.cond:
            sweep_resume.check(self.spec, self._driver.trials, trial, ranks, params)
        if self.state in ("CANCELLED", "FAILED") or (self.detached and self.done()):
            raise ValueError(f"sweep {self.name} is {self.state}: start a new sweep (sweep.results() has the "
                             "checkpoint folders; pass one to train_fn yourself)")
        self._driver.resume(trial, ranks, params)

    def results(self) -> pd.DataFrame:
        """One row per trial asked so far, by trial number: ``trial``, ``state``, ``params_<name>`` for each
        parameter, ``value`` (what Optuna was told), ``last`` and ``best`` report of the metric, ``steps``
        (reports that counted), ``last_step``, ``pruned_at``, ``stopped_step`` (where every rank of a pruned trial
        stopped), ``ranks``, ``workers`` (comma-separated
        addresses), ``run_id`` (the trial's job), ``queued``/``started``/``first_report``/``stopped``/``ended``
        (UTC timestamps: asked, its job started, rank 0's first report of the metric, the pruner's decision,
        every rank stopped), ``duration`` (seconds, started to ended) and ``error`` (with its traceback).

        A trial's whole trace of the metric (rank 0's, up to a prune) is Optuna's:
        ``sweep.study.trials[n].intermediate_values`` (``{step: value}``); its job's other reports are not kept."""
        with self._driver.cond:
            rows = [r.row() for r in sorted(self._driver.trials.values(), key=lambda r: r.number)]
        df = pd.DataFrame(rows, columns=None if rows else list(COLUMNS))
        for col in ("queued", "started", "first_report", "stopped", "ended"):
            if col in df:
                df[col] = pd.to_datetime(df[col], unit="s", utc=True)
        return df

    @property
    def best(self) -> dict:
        """The best COMPLETE trial so far: ``{"trial", "value", "params", "run_id"}``.

        Raises
        ------
        ValueError
            No trial has completed yet (names how many ended otherwise).
        """
        with self._driver.cond:
            done = [r for r in self._driver.trials.values() if r.state == "COMPLETE"]
            ended = sum(r.state in TRIAL_ENDED for r in self._driver.trials.values())
        if not done:
            raise ValueError(f"sweep {self.name}: no trial has completed yet ({ended} ended pruned, failed or "
                             "cancelled): read sweep.results() for why, or wait()")
        pick = min if self.spec.minimize else max
        top = pick(done, key=lambda r: float("nan") if r.value is None else r.value)  # COMPLETE: never None
        return {"trial": top.number, "value": top.value, "params": dict(top.params), "run_id": top.run_id}

    def counts(self) -> dict[str, int]:
        """How many trials are in each state (QUEUED, RUNNING, COMPLETE, PRUNED, FAILED, CANCELLED)."""
        with self._driver.cond:
            states = [r.state for r in self._driver.trials.values()]
        return {s: states.count(s) for s in TRIAL_STATES}

    def __repr__(self) -> str:
        shown = " ".join(f"{s.lower()}={n}" for s, n in self.counts().items() if n)
        return f"<dask_ddp.Sweep {self.name} {self.state} {shown} of {self.spec.n_trials}>"

    def _repr_html_(self) -> str:
        """The sweep in a notebook: its state, trial counts and the results table (re-run the cell to refresh)."""
        head = f"<b>dask-ddp sweep {self.name}</b>: {self.state} &middot; " + ", ".join(
            f"{n} {s.lower()}" for s, n in self.counts().items() if n) + f" of {self.spec.n_trials}"
        return head + self.results().drop(columns=["error"], errors="ignore").to_html(index=False, max_rows=50)

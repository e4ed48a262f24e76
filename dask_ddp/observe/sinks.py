"""Ready callbacks that write a job's metrics somewhere, and the plot behind :meth:`Job.plot`.

Runs in: the client, in the job's watcher thread.

Pass them to ``dask_ddp.dispatch.run(..., callbacks=[...])``::

    sinks = [JSONLinesSink("s3://bucket/runs/a.jsonl"), CSVSink("metrics.csv"),
             TensorBoardSink("tb/run-a")]
    job = dask_ddp.dispatch.run(client, train, callbacks=sinks)

They run on the client, in the job's watcher thread: ``on_metrics(event)``
for every report of every rank, ``on_finish(job)`` once at the end. A row is
the event without its ``kind``: ``rank``, ``attempt``, ``step``, ``time``,
then the reported keys. Files open lazily at the first event, so a sink never
creates an empty file for a job that reported nothing. One sink instance
belongs to one job: used again after ``on_finish``, it starts its file anew.

If a sink fails (a bad URL, a full disk), the job logs the error, disables
that sink and goes on: the training outcome never depends on a sink.
"""

from __future__ import annotations

import csv
import io
import json
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from dask_ddp import storage

if TYPE_CHECKING:
    import pandas as pd

    from dask_ddp.wire.spec import LaunchSpec

__all__ = ["JSONLinesSink", "CSVSink", "TensorBoardSink", "plot_metrics"]

LEAD = ("rank", "attempt", "step", "time")
_NOT_PLOTTED = frozenset(LEAD) | {"epoch", "kind", "elapsed"}


class JobShape(Protocol):
    """What a sink may read of the job it is handed (:class:`dask_ddp.client.job.Job` has all of it).

    A shape, not the class: the client wing imports the sinks, so the sinks may not import the client wing back
    (``tests/test_imports.py`` and ``tests/test_wings.py`` count type-only imports too).
    """

    @property
    def name(self) -> str:
        """The job's name (its ``name=``, else the training function's)."""

    @property
    def run_id(self) -> str:
        """The job's id: its name made safe plus 8 random hex."""

    @property
    def state(self) -> str:
        """PENDING, RUNNING, RESTARTING, FINISHED, FAILED or CANCELLED."""

    @property
    def spec(self) -> LaunchSpec:
        """What the job was launched with (frozen)."""


def _row(event: dict) -> dict:
    return {k: v for k, v in event.items() if k != "kind"}


def _open(url: str, storage_options: dict | None, who: str):
    """Open ``url`` for writing bytes with fsspec (parent directories made on local disks).

    Missing or refused credentials and missing buckets raise as :func:`dask_ddp.storage.call` says;
    other backend errors keep their builtin type and get the URL in their message.
    """
    def open_():
        fs, path = storage.resolve(url, storage_options)
        if "file" in fs.protocol:
            fs.makedirs(fs._parent(path), exist_ok=True)
        return fs.open(path, "wb")

    try:
        return storage.call(open_, url, doing=f"{who} opened it for writing", storage_options=storage_options)
    except (PermissionError, FileNotFoundError):
        raise
    except OSError as exc:
        raise type(exc)(f"{who} could not open {storage.redact(url, storage_options)!r} for writing: "
                        f"{storage.redact(exc, storage_options)}") from None


class _FileSink:
    """A file at an fsspec URL, written by :meth:`_write`, flushed every ``flush_interval`` seconds.

    On object stores (s3://, gs://) an object appears only when the file is
    closed, i.e. at ``on_finish``; local files grow as the job runs.
    """

    def __init__(self, url: str, storage_options: dict | None = None, *, flush_interval: float = 1.0) -> None:
        if not isinstance(url, str) or not url:
            raise TypeError(f"{type(self).__name__}(url=...) takes a path or fsspec URL string, got {url!r}")
        self.url, self.storage_options, self.flush_interval = url, dict(storage_options or {}), flush_interval
        self._file = None
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()

    def _ensure_open(self):
        if self._file is None:
            self._file = _open(self.url, self.storage_options, type(self).__name__)
        return self._file

    def _io(self, fn):
        """``fn()``, a write, flush or close: on object stores this is when the backend is reached."""
        return storage.call(fn, self.url, doing=f"{type(self).__name__} wrote it",
                            storage_options=self.storage_options)

    def _due(self) -> bool:
        return time.monotonic() - self._last_flush >= self.flush_interval

    def _flush_file(self) -> None:
        if self._file is not None:
            self._io(self._file.flush)
        self._last_flush = time.monotonic()

    def _close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            self._io(f.close)

    def on_finish(self, job: JobShape | None = None) -> None:
        """Write what is buffered and close the file (on object stores: upload it).

        Raises
        ------
        PermissionError
            Missing or refused credentials; FileNotFoundError: no such bucket (the URL is in the
            message, never a secret; the same text as a checkpoint's).
        OSError
            When the backend refuses the write otherwise (the URL is in the message).
        """
        with self._lock:
            self._finish()

    def _finish(self) -> None:
        self._close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({storage.redact(self.url, self.storage_options)!r})"


class JSONLinesSink(_FileSink):
    """Write every metric event as one JSON object per line to a path or fsspec URL.

    Parameters
    ----------
    url : str
        Local path or fsspec URL (``memory://``, ``s3://bucket/key.jsonl``, ...).
    storage_options : dict, optional
        fsspec options for the URL's filesystem (s3: ``key``, ``secret``, ``client_kwargs``).
    flush_interval : float
        Seconds between flushes while the job runs (default 1). Local files
        grow as the job runs; on object stores the object appears at the end.

    Examples
    --------
    >>> sink = JSONLinesSink("memory://doc/metrics.jsonl")
    >>> sink.on_metrics({"kind": "metric", "rank": 0, "attempt": 0, "step": 0, "time": 1.0, "loss": 0.5})
    >>> sink.on_finish(None)
    >>> import fsspec
    >>> fsspec.filesystem("memory").cat("/doc/metrics.jsonl")
    b'{"rank": 0, "attempt": 0, "step": 0, "time": 1.0, "loss": 0.5}\\n'
    """

    def on_metrics(self, event: dict) -> None:
        """Append ``event`` (without its ``kind``) as a JSON line.

        Raises
        ------
        OSError
            When the file cannot be opened or written (the URL is in the message).
        """
        line = (json.dumps(_row(event)) + "\n").encode()
        with self._lock:
            f = self._ensure_open()
            self._io(lambda: f.write(line))
            if self._due():
                self._flush_file()


class CSVSink(_FileSink):
    """Write every metric event as a CSV row to a path or fsspec URL, with a header.

    Columns are ``rank, attempt, step, time``, then each reported key in the
    order it first appeared; a row leaves the keys it did not report empty.
    When a key appears for the first time after rows were written (say
    ``val_loss`` once per epoch), the file is rewritten from the start with the
    wider header at the next flush. That is why the sink keeps every row in
    memory (as ``job.metrics`` does): a CSV file cannot grow a column in place.

    Parameters
    ----------
    url : str
        Local path or fsspec URL (``memory://``, ``s3://bucket/key.csv``, ...).
    storage_options : dict, optional
        fsspec options for the URL's filesystem.
    flush_interval : float
        Seconds between flushes while the job runs (default 1).
    """

    def __init__(self, url: str, storage_options: dict | None = None, *, flush_interval: float = 1.0) -> None:
        super().__init__(url, storage_options, flush_interval=flush_interval)
        self.columns: list[str] = list(LEAD)
        self._rows: list[dict] = []
        self._written = 0
        self._rewrite = True

    def on_metrics(self, event: dict) -> None:
        """Keep the row; write new rows (or the whole file, after a new column) when a flush is due.

        Raises
        ------
        OSError
            When the file cannot be opened or written (the URL is in the message).
        """
        row = _row(event)
        with self._lock:
            new = [k for k in row if k not in self.columns]
            if new:
                self.columns.extend(new)
                self._rewrite = self._rewrite or self._written > 0
            self._rows.append(row)
            if self._due():
                self._flush()

    def _flush(self) -> None:
        if self._rewrite:
            self._close()
            self._written, self._rewrite = 0, False
            f, header = self._ensure_open(), True
        else:
            f, header = self._ensure_open(), False
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self.columns, lineterminator="\n")
        if header:
            writer.writeheader()
        writer.writerows(self._rows[self._written:])
        self._written = len(self._rows)
        self._io(lambda: f.write(text.getvalue().encode()))
        self._flush_file()

    def _finish(self) -> None:
        if self._rows:
            self._flush()
        self._close()
        # used again, the sink starts its file anew
        self.columns, self._rows, self._written, self._rewrite = list(LEAD), [], 0, True


class TensorBoardSink:
    """Write every reported number as a TensorBoard scalar ``<key>/rank<r>`` at the event's step.

    Uses ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard``
    package), opened at the first event. Walltime is the time the rank
    reported. After a restart, the new attempt's steps are written to the
    same tags (TensorBoard shows both).

    Parameters
    ----------
    logdir : str
        The SummaryWriter's ``log_dir`` (a local directory, made if missing).
    flush_secs : float
        How often the writer flushes to disk while the job runs (default 5).

    Raises
    ------
    ImportError
        At the first event when ``tensorboard`` is not installed (the job logs it and goes on).
    """

    def __init__(self, logdir: str, *, flush_secs: float = 5) -> None:
        self.logdir, self.flush_secs = str(logdir), flush_secs
        self._writer: Any = None  # a SummaryWriter once the first metrics come
        self._lock = threading.Lock()

    def on_metrics(self, event: dict) -> None:
        """Add one scalar per reported key of ``event``."""
        with self._lock:
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter

                # a deep queue: the default (10) makes every add_scalar wait for the disk, and this runs on
                # the job's watcher thread
                self._writer = SummaryWriter(log_dir=self.logdir, flush_secs=self.flush_secs, max_queue=100_000)
            rank, step, walltime = event.get("rank", 0), event.get("step"), event.get("time")
            for key, value in event.items():
                if key not in LEAD and key != "kind":
                    self._writer.add_scalar(f"{key}/rank{rank}", float(value), global_step=step, walltime=walltime)

    def on_finish(self, job: JobShape | None = None) -> None:
        """Flush and close the event file."""
        with self._lock:
            writer, self._writer = self._writer, None
            if writer is not None:
                writer.close()

    def __repr__(self) -> str:
        return f"TensorBoardSink({self.logdir!r})"


def plot_metrics(df: pd.DataFrame, y: str | list[str] | None = None, x: str = "step", ax: Any = None) -> Any:
    """Plot metrics with matplotlib: one line per rank (and attempt, after restarts) per metric.

    Parameters
    ----------
    df : pandas.DataFrame
        Rows like :attr:`Job.metrics` (``rank``, ``attempt``, ``step``, ``time``, then metrics).
    y : str or list of str, optional
        The metrics to plot; default every numeric column but ``rank``,
        ``attempt``, ``step``, ``time`` and ``epoch``.
    x : str
        The column on the x axis (``step`` by default, or ``time``, ``epoch``).
    ax : matplotlib Axes, optional
        Draw every metric into this Axes. Without it, a new figure gets one
        Axes per metric, stacked, sharing the x axis.

    Returns
    -------
    matplotlib.axes.Axes or numpy.ndarray of Axes
        The Axes when one is drawn into, else the array of the new figure's Axes.

    Raises
    ------
    ValueError
        When there is nothing to plot (no metrics yet) or ``x``/``y`` names a
        column the frame does not have (the message lists the columns).
    ImportError
        When matplotlib is not installed.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    ys = _metric_columns(df, y, x)
    if ax is None:
        _, axes = plt.subplots(len(ys), 1, sharex=True, squeeze=False, figsize=(7, 2.6 * len(ys)))
        axes = axes[:, 0]
    else:
        axes = np.array([ax] * len(ys))
    groups = ["rank", "attempt"] if df["attempt"].nunique() > 1 else ["rank"]
    shared = ax is not None and len(ys) > 1  # several metrics in one Axes: name the metric in each label
    for metric, target in zip(ys, axes):
        for keys, part in df.groupby(groups, sort=True):
            keys = keys if isinstance(keys, tuple) else (keys,)
            series = part[[x, metric]].dropna()  # a key reported every epoch only: connect its points
            if not series.empty:
                label = f"rank {keys[0]}" + (f" (attempt {keys[1] + 1})" if len(keys) > 1 else "")
                target.plot(series[x], series[metric], label=f"{metric} {label}" if shared else label)
        if not shared:
            target.set_ylabel(metric)
        target.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel(x)
    return ax if ax is not None else axes if len(axes) > 1 else axes[0]


def _metric_columns(df, y, x) -> list[str]:
    if df is None or len(df) == 0:
        raise ValueError("nothing to plot: no metrics were reported yet (call dask_ddp.report(...) in the ranks)")
    if x not in df.columns:
        raise ValueError(f"plot(x={x!r}): no such column; the metrics have {', '.join(map(str, df.columns))}")
    if y is None:
        ys = [c for c in df.columns if c not in _NOT_PLOTTED and c != x and _numeric(df[c])]
        if not ys:
            raise ValueError("nothing to plot: no numeric metric besides " + ", ".join(sorted(_NOT_PLOTTED - {"kind"})))
        return ys
    ys = [y] if isinstance(y, str) else list(y)
    missing = [c for c in ys if c not in df.columns]
    if missing or not ys:
        raise ValueError(f"plot(y={y!r}): no column {', '.join(map(repr, missing)) or '(empty list)'}; the "
                         f"metrics have {', '.join(map(str, df.columns))}")
    return ys


def _numeric(column: Any) -> bool:
    from pandas.api.types import is_bool_dtype, is_numeric_dtype

    return is_numeric_dtype(column) and not is_bool_dtype(column)

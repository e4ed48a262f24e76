"""``dask_pytorch_ddp.results.DaskResultsHandler`` (0.2.2): small files from the ranks to the client.

Runs in: the client (``process_results``) and the rank process (``submit_result``).

0.2.2 used Dask's Pub/Sub, removed from distributed in 2025.4. Here a
result travels like a report: the rank appends an event of kind
``"result"`` to its buffer, the job's event topic carries it, and
:meth:`DaskResultsHandler.process_results` reads it from the job's event
stream (:meth:`dask_ddp.Job.stream`) and writes the file. So no result is
lost when ``process_results`` starts after the ranks did, and results keep
their order per rank.
"""

from __future__ import annotations

import base64
import logging
import os
import posixpath
import time
import uuid
from typing import Iterable

from dask_ddp.rank import reporting
from dask_ddp.rank.context import get_context
from dask_ddp.wire.errors import NotInRankError

__all__ = ["DaskResultsHandler", "MAX_RESULT_BYTES"]

logger = logging.getLogger("dask_ddp")

#: The largest result (after UTF-8 encoding of a str) that travels through the scheduler's events.
MAX_RESULT_BYTES = 64 * 1024


class DaskResultsHandler:
    """Collect small results (metrics as JSON, plots, summaries) from the ranks into files on the client.

    Parameters
    ----------
    pub_sub_key : str, optional
        Tells this handler's results apart from others' in the same job;
        default a random hex string. The handler pickles as this key, so the
        training function can use one made in the notebook.

    Examples
    --------
    In the notebook::

        rh = DaskResultsHandler("run-1")
        def train():
            ...
            rh.submit_result(f"worker/{rank}/step-{step}.json", json.dumps({"loss": loss}))
        futures = dispatch.run(client, train, backend="gloo")
        rh.process_results("training-results/", futures)
    """

    def __init__(self, pub_sub_key: str | None = None) -> None:
        if pub_sub_key is not None and not isinstance(pub_sub_key, str):
            raise TypeError(f"DaskResultsHandler(pub_sub_key=...) takes a str, got {type(pub_sub_key).__name__}")
        self.pub_sub_key = pub_sub_key if pub_sub_key is not None else uuid.uuid4().hex

    def __repr__(self) -> str:
        return f"DaskResultsHandler({self.pub_sub_key!r})"

    def submit_result(self, path: str, data: str | bytes) -> None:
        """Send ``data`` from this rank; :meth:`process_results` writes it to ``<prefix>/<path>``.

        Call it inside the function passed to :func:`dask_ddp.compat.dispatch.run`.
        It only appends to the rank's event buffer: it does not wait for the client.

        Parameters
        ----------
        path : str
            A relative path with ``/`` separators, without ``..``.
        data : str or bytes
            At most :data:`MAX_RESULT_BYTES` (64 KiB); a str is written as UTF-8.

        Raises
        ------
        ValueError
            When ``data`` is larger than 64 KiB (write checkpoints and other
            large files with :func:`dask_ddp.save_checkpoint` or fsspec to
            shared storage instead), or ``path`` is absolute, empty or has ``..``.
        TypeError
            When ``data`` is not str or bytes, or ``path`` is not a str.
        dask_ddp.NotInRankError
            Outside a dask-ddp rank.
        """
        _check_path(path)
        payload = _encode(path, data)
        buf = reporting.current_buffer()
        if buf is None:
            get_context()  # raises NotInRankError with the standard message outside a rank
            raise NotInRankError("submit_result() has no channel to the client in this process (a DataLoader "
                                 "worker?): call it from the rank's main process")
        buf.add(dict(payload, kind="result", rank=buf.rank, attempt=buf.attempt, time=time.time(),
                     key=self.pub_sub_key, path=path))

    def process_results(self, prefix: str, futures: Iterable, raise_errors: bool = True) -> None:
        """Write every result of this handler to ``<prefix>/<path>`` as it arrives, until the job ends.

        Parameters
        ----------
        prefix : str
            A local directory; it and the results' sub-directories are created.
        futures : list of distributed.Future
            What :func:`dask_ddp.compat.dispatch.run` returned.
        raise_errors : bool
            When a rank failed, raise its error (default) after writing every
            result that arrived; with False, log it and return.

        Raises
        ------
        Exception
            With ``raise_errors=True``: the failed rank's own exception (see
            :meth:`dask_ddp.Job.result`).
        ValueError
            When ``futures`` did not come from :func:`dask_ddp.compat.dispatch.run`.
        OSError
            When a file cannot be written under ``prefix``.
        """
        # not at the top: the ranks unpickle this module (a handler travels in the training function), and
        # compat.dispatch brings the client's side with it (distributed's client, pandas)
        from dask_ddp.compat.dispatch import job_of

        futures = list(futures)
        jobs: list = []
        for fut in futures:
            job = job_of(fut)
            if job is None:
                raise ValueError(f"process_results(): {fut!r} is not a future returned by "
                                 "dask_ddp.compat.dispatch.run(...); pass the list that run() returned")
            if all(job is not j for j in jobs):
                jobs.append(job)
        for job in jobs:
            self._process_job(prefix, job, raise_errors)

    def _process_job(self, prefix: str, job, raise_errors: bool) -> None:
        for event in job.stream():
            if event.get("kind") == "result" and event.get("key") == self.pub_sub_key:
                _write(prefix, event)
        try:
            job.result(progress=False)
        except Exception:
            if raise_errors:
                raise
            logger.exception("dask-ddp job %s failed; process_results(raise_errors=False) goes on", job.run_id)


def _check_path(path) -> None:
    if not isinstance(path, str):
        raise TypeError(f"submit_result(path=...) takes a str, got {type(path).__name__}")
    parts = path.replace("\\", "/").split("/")
    if not path or posixpath.isabs(path.replace("\\", "/")) or os.path.isabs(path) or ".." in parts \
            or parts[-1] in ("", "."):
        raise ValueError(f"submit_result(path={path!r}): expected a relative path without '..', "
                         "e.g. 'worker/0/metrics.json'; it is written under process_results' prefix")


def _encode(path: str, data) -> dict:
    if isinstance(data, str):
        raw, payload = data.encode("utf-8"), {"data": data, "encoding": "utf-8"}
    elif isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
        payload = {"data": base64.b64encode(raw).decode("ascii"), "encoding": "base64"}
    else:
        raise TypeError(f"submit_result({path!r}, data): data must be str or bytes, got {type(data).__name__}; "
                        "serialise it first (json.dumps, pickle.dumps)")
    if len(raw) > MAX_RESULT_BYTES:
        raise ValueError(f"submit_result({path!r}, ...): {_size(len(raw))} is over the {_size(MAX_RESULT_BYTES)} "
                         "limit of a result (results travel through the Dask scheduler's events). Write large "
                         "things such as checkpoints with dask_ddp.save_checkpoint(...) or with fsspec to shared "
                         "storage (e.g. s3://), and submit their path instead")
    return payload


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB" if n >= 2**10 else f"{n} bytes"


def _write(prefix: str, event: dict) -> None:
    _check_path(event["path"])
    data = event["data"]
    raw = base64.b64decode(data) if event.get("encoding") == "base64" else data.encode("utf-8")
    target = os.path.join(prefix, *event["path"].replace("\\", "/").split("/"))
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    with open(target, "wb") as f:
        f.write(raw)

"""``MLflowSink``: a job's parameters and every reported metric of every rank in one MLflow run.

Runs in: the client, in the job's watcher thread (a callback, like the sinks of :mod:`dask_ddp.observe.sinks`).

Needs MLflow's tracking client (``pip install 'dask-ddp[mlflow]'``, which brings ``mlflow-skinny``; the full
``mlflow`` package has the same client). Pass it to ``run``::

    job = dask_ddp.dispatch.run(client, train, 10, lr=0.1,
                                callbacks=[dask_ddp.MLflowSink("http://mlflow:5000", experiment="digits")])

One MLflow run per job: made at ``on_start``, tagged with the job's run id, kept across restarts (each
restart sets the tag ``dask_ddp.attempts``), ended at ``on_finish`` with the job's outcome (FINISHED,
FAILED, or KILLED for a cancelled job). Parameters are logged once: the training function's arguments
(``arg0``, ``arg1``, ... and keyword names), the job's ``world_size``, ``backend``, ``max_restarts`` and
``name``, and any ``params=`` given. Every reported number becomes the metric ``<key>/rank<r>`` at the
report's step and time (TensorBoardSink's names); metrics are sent in batches of up to 1,000 every
``flush_interval`` seconds and at the end. A failing tracking server is logged by the job, which disables
the sink and trains on.

No credential reaches the tracking server, by the rules the logs follow (:func:`dask_ddp.storage.redact`)
and a few more (:func:`mask_text`): a parameter or tag whose name looks secret (``key``, ``secret``, ``token``,
``password``, ...) is logged as ``***``, so is such an entry of a dict (``storage_options={"key": ...,
"secret": ...}``, at any depth, in lists too) or a field of a dataclass, ``argparse.Namespace``,
``SimpleNamespace`` or named tuple, each of those values wherever else it appears, and the userinfo of URLs
(``s3://KEY:SECRET@bucket/x`` becomes ``s3://***@bucket/x``). In any text: the value of a secret-looking
``NAME=value`` (``AWS_SECRET_ACCESS_KEY=...``, ``--api-key ...``, ``"token": "..."``) and of such a URL query
parameter (presigned URLs' ``X-Amz-Signature``, ``X-Amz-Credential``, ``X-Amz-Security-Token``,
``Signature``, ``sig``), ``Bearer`` tokens, private-key blocks, and tokens that say what they are by their
form (GitHub ``ghp_...``, Hugging Face ``hf_...``, ``sk-...`` API keys, AWS access key ids ``AKIA...``,
JWTs, Slack, GitLab, Google API keys). The run's name, tags and metric names go through the same masking.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import threading
import time
import types
from typing import TYPE_CHECKING, Any, Mapping

import cloudpickle

from dask_ddp.observe.sinks import LEAD
from dask_ddp.storage import masked, redact

if TYPE_CHECKING:
    from dask_ddp.observe.sinks import JobShape

__all__ = ["MLflowSink", "mask_text", "shown"]

MAX_BATCH = 1000  # metrics per log_batch call: MLflow's limit
MAX_PARAM = 500  # characters of a parameter's value: the smallest limit of MLflow's stores


def _cut(text: str, limit: int | None) -> str:
    return text if limit is None or len(text) <= limit else text[:limit - 3] + "..."


#: words of a name that say its value is a secret (``AWS_SECRET_ACCESS_KEY``, ``apiKey``, ``X-Amz-Signature``);
#: a whole word, so ``tokenizer`` or ``max_tokens`` are not
SECRET_WORDS = frozenset({"key", "apikey", "accesskey", "secret", "token", "password", "passwd", "pwd", "passphrase",
                          "credential", "credentials", "auth", "authorization", "signature", "sig", "cookie"})
_ASSIGNED = re.compile(  # NAME=value, NAME: value, "NAME": "value", --NAME value; a URL's query parameters too
    r"""(?P<head>(?P<q>["']?)(?P<name>[A-Za-z_][\w.-]*)(?P=q)[ \t]*(?:=|:(?!//))[ \t]*"""
    r"""|--(?P<flag>[A-Za-z][\w.-]*)[ \t]+)(?P<value>"[^"]*"|'[^']*'|[^\s&,;'"()\[\]{}<>]+)""")
_TOKENS = re.compile("|".join((
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----",
    r"(?<=\bBearer )[A-Za-z0-9._~+/=-]+", r"(?<=\bbearer )[A-Za-z0-9._~+/=-]+", r"(?<=\bBasic )[A-Za-z0-9+/=]{8,}",
    r"\b(?:gh[pousr]|github_pat)_[A-Za-z0-9_]{20,}", r"\bhf_[A-Za-z0-9]{20,}",
    r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_-]{16,}", r"\b[rsp]k_(?:live|test)_[A-Za-z0-9]{16,}",
    r"\b(?:AKIA|ASIA|AIDA|AROA|AGPA|ANPA)[A-Z0-9]{16}\b", r"\beyJ[\w-]{5,}\.eyJ[\w-]{5,}\.[\w-]*",
    r"\bxox[abposr]-[A-Za-z0-9-]{10,}", r"\bglpat-[A-Za-z0-9_-]{20,}", r"\bAIza[0-9A-Za-z_-]{35}\b",
    r"\bnpm_[A-Za-z0-9]{36}\b")))


def _secret_name(name: str) -> bool:
    words = re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)
    return any(w.lower() in SECRET_WORDS for w in words) or name.lower() in SECRET_WORDS


def _masked_value(m: re.Match) -> str:
    if not _secret_name(m["name"] or m["flag"]):
        return m[0]
    value = m["value"]
    return m["head"] + (value[0] + "***" + value[0] if value[:1] in "\"'" and len(value) > 1 else "***")


def mask_text(text: str, secrets: Mapping | None = None) -> str:
    """``text`` as MLflow may show it: redacted by :func:`~dask_ddp.storage.redact` (URL userinfo; each secret
    value of ``secrets``), then the value of each secret-looking ``NAME=value`` (or ``NAME: value``, ``--NAME value``,
    a URL query parameter such as ``X-Amz-Signature``) and each token known by its form (``ghp_...``, ``hf_...``,
    ``sk-...``, ``AKIA...``, JWTs, ``Bearer ...``, ``Basic ...``, private-key blocks) given as ``***``. Raises
    nothing."""
    return _ASSIGNED.sub(_masked_value, _TOKENS.sub("***", redact(text, secrets)))


def _fields(value: Any) -> Mapping | None:
    """A config object's fields by name (a dataclass, ``argparse.Namespace``, ``SimpleNamespace``, a named
    tuple), else None: their reprs show every field, so their secret-looking names are masked as a dict's."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
    if isinstance(value, (argparse.Namespace, types.SimpleNamespace)):
        return dict(vars(value))
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return dict(value._asdict())
    return None


def _mappings(value: Any, found: list, depth: int = 0) -> list:
    """Every dict in ``value`` (itself, in lists, tuples, sets, config objects' fields, nested): where secrets
    are named."""
    if depth > 8:
        return found
    if (fields := _fields(value)) is not None:
        value = fields
    if isinstance(value, Mapping):
        found.append(value)
        inner: Any = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        inner = value
    else:
        return found
    for v in inner:
        _mappings(v, found, depth + 1)
    return found


def shown(values: Mapping, limit: int | None = MAX_PARAM) -> dict[str, str]:
    """``values`` (parameters or tags) as text for MLflow, masked as the logs are.

    Secret-looking names give ``***`` (:func:`~dask_ddp.storage.masked`); every value of a secret-looking
    name in any dict or config object (dataclass, ``Namespace``) within them, and the userinfo of URLs, are
    masked wherever they appear, and so are secret-looking ``NAME=value`` texts and known tokens
    (:func:`mask_text`); then each text is cut to ``limit`` characters (never before: a secret cut in two would
    no longer be found).
    """
    secrets = {str(i): m for i, m in enumerate(_mappings(dict(values), []))}  # where redact finds secret values
    return {mask_text(str(k))[:250]: _cut(mask_text(v if isinstance(v, str) else repr(v), secrets), limit)
            for k, v in masked(values).items()}


@functools.lru_cache(maxsize=1024)
def _metric_name(key: str, rank: int) -> str:
    return mask_text(f"{key}/rank{rank}")


def _job_values(job) -> dict[str, Any]:
    """The parameters of ``job`` as given, unmasked (:func:`shown` masks them): the function's arguments and
    the job's settings."""
    spec = job.spec
    _, args, kwargs = cloudpickle.loads(spec.call)
    params = {f"arg{i}": a for i, a in enumerate(args)} | dict(kwargs)
    return params | {"world_size": spec.first_plan.world_size, "backend": spec.backend,
                     "max_restarts": spec.max_restarts, "name": spec.name or spec.fn_name}


class MLflowSink:
    """Log a job to MLflow: its parameters once, every reported metric per rank and step, one run per job.

    Parameters
    ----------
    tracking_uri : str, optional
        The tracking server or store (``http://host:5000``, ``sqlite:///mlflow.db``, a folder); default
        MLflow's own (``MLFLOW_TRACKING_URI``, else ``./mlruns``).
    experiment : str
        The experiment's name, made when missing (default ``"dask-ddp"``).
    run_name : str, optional
        The MLflow run's name (default the job's name).
    params : dict, optional
        More parameters to log with the job's own.
    tags : dict, optional
        Tags for the run (``dask_ddp.run_id`` is always set).
    flush_interval : float
        Seconds between metric batches while the job runs (default 1).

    Raises
    ------
    ImportError
        At ``on_start`` when MLflow is not installed (the job logs it, disables the sink and goes on).
    """

    def __init__(self, tracking_uri: str | None = None, *, experiment: str = "dask-ddp", run_name: str | None = None,
                 params: dict | None = None, tags: dict | None = None, flush_interval: float = 1.0) -> None:
        if not isinstance(experiment, str) or not experiment:
            raise TypeError(f"MLflowSink(experiment=...) takes a non-empty name, got {experiment!r}")
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.params, self.tags = dict(params or {}), {str(k): str(v) for k, v in (tags or {}).items()}
        self.flush_interval = flush_interval
        self.run_id: str | None = None  # the MLflow run of the current job
        self.last_run_id: str | None = None  # the MLflow run of the latest job, once it has ended
        self._client: Any = None  # an MlflowClient from on_start
        self._pending: list = []
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()

    # ---- callbacks -----------------------------------------------------------------------------------------
    def on_start(self, job: JobShape) -> None:
        """Make the job's MLflow run and log its parameters.

        Raises
        ------
        ImportError
            MLflow is not installed.
        mlflow.exceptions.MlflowException
            The tracking store refused (the job logs it and disables the sink).
        """
        from mlflow import MlflowClient

        with self._lock:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
            found = self._client.get_experiment_by_name(self.experiment)
            experiment_id = found.experiment_id if found else self._client.create_experiment(self.experiment)
            name = self.run_name or getattr(job, "name", None)
            tags = shown(self.tags, limit=None) | ({"dask_ddp.run_id": job.run_id} if job is not None else {})
            self.run_id = self._client.create_run(experiment_id, tags=tags,
                                                  run_name=None if name is None else mask_text(name)).info.run_id
            self._log_params(shown((_job_values(job) if job is not None else {}) | self.params))

    def on_metrics(self, event: dict) -> None:
        """Queue one metric per reported number of ``event`` (``<key>/rank<r>``); send them when a flush is due."""
        from mlflow.entities import Metric

        rank, step = event.get("rank", 0), int(event.get("step") or 0)
        stamp = int(1000 * float(event.get("time") or time.time()))
        with self._lock:
            for key, value in event.items():
                if key in LEAD or key == "kind" or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                self._pending.append(Metric(_metric_name(key, rank), float(value), stamp, step))
            if time.monotonic() - self._last_flush >= self.flush_interval:
                self._flush()

    def on_restart(self, job: JobShape, attempt: int) -> None:
        """The same MLflow run goes on; the tag ``dask_ddp.attempts`` counts the attempts."""
        with self._lock:
            self._flush()
            if self.run_id is not None:
                self._client.set_tag(self.run_id, "dask_ddp.attempts", str(attempt + 1))

    def on_finish(self, job: JobShape) -> None:
        """Send what is queued and end the run with the job's outcome; the sink is then ready for another job."""
        with self._lock:
            try:
                self._flush()
                if self.run_id is not None:
                    state = getattr(job, "state", "FINISHED")
                    status = {"FINISHED": "FINISHED", "CANCELLED": "KILLED"}.get(state, "FAILED")
                    self._client.set_terminated(self.run_id, status=status)
            finally:
                self.last_run_id, self.run_id, self._pending = self.run_id, None, []

    # ---- sending -------------------------------------------------------------------------------------------
    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self._client.log_batch(self.run_id, params=items[i:i + 100])

    def _flush(self) -> None:
        self._last_flush = time.monotonic()
        pending, self._pending = self._pending, []
        if self.run_id is None:
            return
        for i in range(0, len(pending), MAX_BATCH):
            self._client.log_batch(self.run_id, metrics=pending[i:i + MAX_BATCH])

    def __repr__(self) -> str:
        uri = None if self.tracking_uri is None else mask_text(self.tracking_uri)
        return f"MLflowSink({uri!r}, experiment={self.experiment!r})"

"""What is transient, and how it is retried: the one rule under checkpoints, streaming and ``S3ImageFolder``.

Runs in: the rank process and its DataLoader workers (and one process exporting or inspecting a checkpoint).

An error is *transient* when a later attempt of the same request may succeed: the store asked to slow down or
failed on its side (an S3 error code of :data:`TRANSIENT_CODES` anywhere in the error's chain), or the network
failed (a connection refused, reset or timed out: :func:`network`). An error a user must act on is never
transient (:data:`PERMANENT`: a missing object, refused credentials, a folder where a file was expected).
A transient error is retried after :func:`backoff`: exponential from 0.2 s, doubling, at most 10 s, with jitter
(x0.5-1.5) so that many ranks or DataLoader workers throttled together do not come back together.
:func:`retrying` runs a callable with that rule and that backoff; each caller chooses how many attempts.
"""

from __future__ import annotations

import functools
import importlib
import random
import time
from typing import Any, Callable

from dask_ddp import storage

__all__ = ["TRANSIENT_CODES", "PERMANENT", "transient", "throttled", "network", "backoff", "retrying"]

#: S3 error codes (and HTTP statuses) that mean "the store is busy or failed on its side: ask again later"
TRANSIENT_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                             "ServiceUnavailable", "TooManyRequests", "RequestTimeout", "InternalError",
                             "429", "500", "503"})
#: errors a user acts on: never retried, whatever their chain holds
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
#: the network failures of the backends, by name (when their module is not installed, nothing of theirs is raised)
_NETWORK = [("botocore.exceptions", "ConnectionError"), ("botocore.exceptions", "HTTPClientError"),
            ("aiohttp", "ClientError")]


def throttled(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it chains) is the store asking to slow down or failing on its side: an
    error code of :data:`TRANSIENT_CODES` (botocore's ``ClientError``, or a ``code`` attribute). Raises nothing."""
    return any(storage.error_code(e) in TRANSIENT_CODES for e in storage.error_chain(exc))


def network(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it chains) is a network failure: ``ConnectionError``, ``TimeoutError``,
    botocore's ``ConnectionError``/``HTTPClientError`` (endpoint unreachable, read or connect timeout), aiohttp's
    ``ClientError`` (connector error, server disconnected). Raises nothing."""
    return any(isinstance(e, (ConnectionError, TimeoutError, *_network_types())) for e in storage.error_chain(exc))


def transient(exc: BaseException, *, any_os_error: bool = False) -> bool:
    """Whether a later attempt of what raised ``exc`` may succeed: :func:`throttled` or :func:`network`, never
    one of :data:`PERMANENT`. ``any_os_error``: any other ``OSError`` too (an idempotent read, where an
    unexplained I/O error is worth another GET: ``S3ImageFolder``). Raises nothing."""
    if isinstance(exc, PERMANENT) or storage.translate(exc, "") is not None:
        return False
    return throttled(exc) or network(exc) or (any_os_error and isinstance(exc, OSError))


def backoff(attempt: int, *, base: float = 0.2, cap: float = 10.0) -> float:
    """Seconds to wait after failed attempt ``attempt`` (0 for the first): ``min(cap, base * 2**attempt)``
    times a random factor in [0.5, 1.5). Raises nothing."""
    return min(cap, base * 2 ** max(0, attempt)) * random.uniform(0.5, 1.5)


def retrying(fn: Callable[[], Any], *, tries: int, rule: Callable[[BaseException], bool] = transient,
             on_retry: Callable[[int, float, BaseException], None] | None = None,
             sleep: Callable[[float], Any] | None = None) -> Any:
    """``fn()``, called again after an error that ``rule`` calls transient, ``tries`` calls at most, waiting
    :func:`backoff` between them (``sleep``, ``time.sleep`` by default); ``on_retry(attempt, delay, error)``
    runs before each wait (to log it).

    Raises
    ------
    ValueError
        ``tries`` is below 1.
    Exception
        What the last call raised: an error that is not transient at once, a transient one after ``tries`` calls.
    """
    if tries < 1:
        raise ValueError(f"retrying takes tries >= 1 (calls in all), got {tries}")
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if attempt >= tries - 1 or not rule(exc):
                raise
            delay = backoff(attempt)
            if on_retry is not None:
                on_retry(attempt, delay, exc)
            (sleep or time.sleep)(delay)
            attempt += 1


@functools.cache
def _network_types() -> tuple[type[BaseException], ...]:
    found = []
    for module, name in _NETWORK:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)

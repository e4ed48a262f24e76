"""The one rule for what is transient and how it is retried (dask_ddp.storage.transient), and its three users.

Real botocore ``ClientError``s (as s3fs raises them: translated to an ``OSError`` chaining the original), real
builtin, botocore, aiohttp and fsspec network errors; the retry against a fake callable that fails N times,
with a fake clock (no test here sleeps).
"""

from __future__ import annotations

import socket

import aiohttp
import botocore.exceptions as be
import fsspec.exceptions
import pytest
from s3fs.errors import translate_boto_error

from dask_ddp.checkpoint.sharded import writer as dcp_storage
from dask_ddp.data import image_folder
from dask_ddp.data.streaming import fetch as stream_fetch
from dask_ddp.storage import transient


def client_error(code: str, status: int = 503) -> be.ClientError:
    return be.ClientError({"Error": {"Code": code, "Message": f"the store said {code}"},
                           "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


def as_s3fs(code: str, status: int = 503) -> BaseException:
    """What s3fs raises for a ClientError: a builtin (OSError, PermissionError, ...) with the original as cause."""
    return translate_boto_error(client_error(code, status))


@pytest.mark.parametrize("code", ["SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                                  "ServiceUnavailable", "TooManyRequests", "RequestTimeout", "InternalError",
                                  "429", "500", "503"])
def test_the_stores_codes_for_ask_again_later_are_transient_raw_and_as_s3fs_raises_them(code):
    for exc in (client_error(code), as_s3fs(code)):
        assert transient.throttled(exc) and transient.transient(exc), (code, exc)
    assert not transient.network(client_error(code))  # (s3fs raises RequestTimeout as a TimeoutError: both)


@pytest.mark.parametrize("code", ["AccessDenied", "InvalidAccessKeyId", "NoSuchKey", "NoSuchBucket",
                                  "InvalidArgument", "InvalidRange", "EntityTooLarge"])
def test_other_codes_are_not_transient_even_where_any_os_error_counts(code):
    for exc in (client_error(code, 400), as_s3fs(code, 400)):
        assert not transient.throttled(exc) and not transient.transient(exc), (code, exc)
    if code in ("AccessDenied", "InvalidAccessKeyId", "NoSuchKey", "NoSuchBucket"):  # a user acts on these
        assert not transient.transient(as_s3fs(code, 403), any_os_error=True)


def _read_timeout():
    return be.ReadTimeoutError(endpoint_url="http://127.0.0.1:9/b/k")


@pytest.mark.parametrize("make", [
    lambda: TimeoutError("timed out"), lambda: socket.timeout("timed out"), lambda: ConnectionResetError(104, "reset"),
    lambda: ConnectionRefusedError(111, "refused"), lambda: BrokenPipeError(32, "broken pipe"),
    lambda: be.EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), _read_timeout,
    lambda: be.ConnectTimeoutError(endpoint_url="http://127.0.0.1:9"),
    lambda: aiohttp.ServerDisconnectedError(), lambda: aiohttp.ClientPayloadError("cut"),
    lambda: fsspec.exceptions.FSTimeoutError(),
], ids=["timeout", "socket.timeout", "reset", "refused", "pipe", "endpoint", "read-timeout", "connect-timeout",
        "disconnected", "payload", "fsspec-timeout"])
def test_network_failures_are_transient_themselves_and_chained(make):
    exc = make()
    assert transient.network(exc) and transient.transient(exc) and not transient.throttled(exc)
    try:  # as a backend wraps it: an OSError whose cause is the network error
        raise OSError(5, "I/O error") from make()
    except OSError as wrapped:
        assert transient.transient(wrapped)


def test_a_plain_os_error_counts_only_where_the_caller_says_so_and_permanent_ones_never():
    plain = OSError(5, "Input/output error")
    assert not transient.transient(plain) and transient.transient(plain, any_os_error=True)
    for exc in (FileNotFoundError(2, "gone"), PermissionError(13, "denied"), IsADirectoryError(21, "dir"),
                NotADirectoryError(20, "file")):
        assert not transient.transient(exc, any_os_error=True), exc
    try:  # a missing object is permanent even when its chain shows a timeout
        raise FileNotFoundError("s3://b/k") from TimeoutError()
    except FileNotFoundError as exc:
        assert not transient.transient(exc)
    assert not transient.transient(ValueError("bad")) and not transient.transient(KeyError("x"))
    assert not transient.transient(fsspec.exceptions.BlocksizeMismatchError("blocks"), any_os_error=True)


def test_backoff_doubles_from_a_fifth_of_a_second_with_jitter_and_a_cap():
    for attempt in range(12):
        mid = min(10.0, 0.2 * 2 ** attempt)
        delays = [transient.backoff(attempt) for _ in range(200)]
        assert all(0.5 * mid <= d < 1.5 * mid for d in delays), (attempt, min(delays), max(delays))
        assert max(delays) - min(delays) > 0.2 * mid  # jittered: throttled ranks do not come back together
    assert transient.backoff(30) < 15.0


class Flaky:
    """A callable that raises ``error()`` its first ``fails`` calls, then returns ``"ok"``."""

    def __init__(self, fails: int, error=lambda: OSError("x")):
        self.fails, self.error, self.calls = fails, error, 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.fails:
            raise self.error()
        return "ok"


@pytest.mark.parametrize("fails", [0, 1, 3, 5])
def test_retrying_carries_a_callable_through_n_transient_failures_with_growing_waits(fails):
    fn, waits, seen = Flaky(fails, lambda: as_s3fs("SlowDown")), [], []
    assert transient.retrying(fn, tries=6, sleep=waits.append,
                              on_retry=lambda attempt, delay, err: seen.append((attempt, delay, type(err)))) == "ok"
    assert fn.calls == fails + 1 and len(waits) == fails
    assert [a for a, _, _ in seen] == list(range(fails)) and [d for _, d, _ in seen] == waits
    for attempt, wait in enumerate(waits):
        assert 0.1 * 2 ** attempt <= wait < 0.3 * 2 ** attempt


def test_retrying_gives_up_after_tries_calls_with_the_last_error_and_at_once_on_a_permanent_one():
    fn, waits = Flaky(10, lambda: ConnectionResetError(104, "reset")), []
    with pytest.raises(ConnectionResetError):
        transient.retrying(fn, tries=3, sleep=waits.append)
    assert fn.calls == 3 and len(waits) == 2
    fn, waits = Flaky(10, lambda: as_s3fs("NoSuchKey", 404)), []
    with pytest.raises(FileNotFoundError):
        transient.retrying(fn, tries=6, sleep=waits.append)
    assert fn.calls == 1 and waits == []
    fn = Flaky(1)  # a plain OSError: retried only under a rule that says so
    with pytest.raises(OSError):
        transient.retrying(fn, tries=3, sleep=waits.append)
    assert fn.calls == 1
    fn = Flaky(1)
    assert transient.retrying(fn, tries=3, sleep=waits.append,
                              rule=lambda e: transient.transient(e, any_os_error=True)) == "ok" and fn.calls == 2
    with pytest.raises(ValueError, match="tries >= 1"):
        transient.retrying(fn, tries=0)


def test_the_three_users_share_the_rule(monkeypatch):
    monkeypatch.setattr(transient.time, "sleep", lambda s: None)
    assert stream_fetch.TRANSIENT_CODES is transient.TRANSIENT_CODES
    # checkpoints: 6 calls, and a network error is now retried as the stream and the images retried it
    fn = Flaky(2, lambda: ConnectionResetError(104, "reset"))
    assert dcp_storage.with_retries(fn) == "ok" and fn.calls == 3
    fn = Flaky(10, lambda: as_s3fs("TooManyRequests", 429))
    with pytest.raises(OSError):
        dcp_storage.with_retries(fn)
    assert fn.calls == 6 and dcp_storage.throttled(as_s3fs("SlowDown"))
    # images: any OSError that is not permanent (a GET is idempotent), and the codes and network errors
    assert image_folder.S3ImageFolder._transient(OSError("x"))
    assert image_folder.S3ImageFolder._transient(client_error("SlowDown"))  # not an OSError: now retried too
    assert not image_folder.S3ImageFolder._transient(as_s3fs("AccessDenied", 403))

"""dask_ddp.storage: URL resolution, error mapping and redaction, alone and as checkpoints and sinks use it.

The end-to-end cases write to moto's S3 server on 127.0.0.1 (conftest's ``s3``
fixture) with the credentials missing, partial or refused: with auth enforced
(moto's ``reset-auth``) the server checks them as AWS would.
"""

from __future__ import annotations

import json
import os
import re
import traceback
import urllib.request

import pytest
from botocore.exceptions import ClientError, NoCredentialsError

from dask_ddp import checkpoint as ck
from dask_ddp import storage
from dask_ddp.observe.sinks import CSVSink, JSONLinesSink

KEY, SECRET = "AKIAPLANTEDKEY123", "planted-secret-xyz"


# -- units ----------------------------------------------------------------------------------------


def test_resolve_checks_types_and_reads_s3_userinfo_as_credentials(tmp_path):
    fs, path = storage.resolve(tmp_path / "x")
    assert "file" in fs.protocol and path == str(tmp_path / "x")
    with pytest.raises(TypeError, match="path or fsspec URL.*int"):
        storage.resolve(123)
    with pytest.raises(TypeError, match="storage_options takes a dict.*str"):
        storage.resolve("memory://x", "key=1")
    fs, path = storage.resolve(f"s3://{KEY}:{SECRET}@bucket/a/b", {"skip_instance_cache": True})
    assert path == "bucket/a/b" and fs.storage_options["key"] == KEY and fs.storage_options["secret"] == SECRET
    fs, _ = storage.resolve(f"s3://{KEY}:{SECRET}@bucket/a", {"key": "given", "skip_instance_cache": True})
    assert fs.storage_options["key"] == "given"  # explicit options win


def test_redact_removes_userinfo_and_secret_option_values_anywhere():
    assert storage.redact(f"s3://{KEY}:{SECRET}@bucket/x") == "s3://***@bucket/x"
    assert storage.redact(f"bad bucket '{KEY}:{SECRET}@bucket' in s3://{KEY}:{SECRET}@bucket") == \
        "bad bucket '***:***@bucket' in s3://***@bucket"
    opts = {"key": KEY, "client_kwargs": {"endpoint_url": "http://h:1", "aws_secret_access_key": SECRET},
            "token": "tok/with+chars", "anon": False}
    text = f"x {KEY} y {SECRET} z tok%2Fwith%2Bchars w http://h:1"
    assert storage.redact(text, opts) == "x *** y *** z *** w http://h:1"
    assert storage.redact("/local/path@2 and s3://bucket/x@2") == "/local/path@2 and s3://bucket/x@2"


def test_masked_hides_secret_looking_values_and_keeps_the_rest():
    opts = {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": "http://127.0.0.1:5555",
                                                            "region_name": "eu-west-1"}}
    assert storage.masked(opts) == {"key": "***", "secret": "***", "client_kwargs": {
        "endpoint_url": "http://127.0.0.1:5555", "region_name": "eu-west-1"}}
    assert repr(storage.masked({"session_token": "t" * 10, "password": "p" * 8})) == \
        "{'session_token': '***', 'password': '***'}"
    assert opts["key"] == KEY  # a copy


def _client_error(code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": f"server says {code}"}}, "PutObject")


@pytest.mark.parametrize("error, kind, code", [
    (NoCredentialsError(), PermissionError, "NoCredentialsError"),
    (_client_error("AccessDenied"), PermissionError, "AccessDenied"),
    (_client_error("InvalidAccessKeyId"), PermissionError, "InvalidAccessKeyId"),
    (_client_error("NoSuchBucket"), FileNotFoundError, "NoSuchBucket"),
    (FileNotFoundError(2, "No such file"), FileNotFoundError, "FileNotFoundError"),
])
def test_call_maps_backend_errors_to_builtins_naming_the_url_not_chained(error, kind, code):
    def fail():
        raise error

    url = f"s3://{KEY}:{SECRET}@bucket/x"
    with pytest.raises(kind) as info:
        storage.call(fail, url, doing="writing it", storage_options={"secret": SECRET})
    text = str(info.value)
    assert "s3://***@bucket/x" in text and f"while writing it ({code}" in text
    assert info.value.__cause__ is None and info.value.__context__ is None and info.value.__suppress_context__
    _assert_no_secret(info.value)


def test_call_passes_other_errors_through_and_redacts_those_that_show_a_secret():
    original = ValueError("plain")

    def fail(exc):
        def raise_():
            raise exc
        return raise_

    with pytest.raises(ValueError) as info:
        storage.call(fail(original), "s3://bucket/x")
    assert info.value is original
    with pytest.raises(ValueError, match=r"Invalid bucket name '\*\*\*:\*\*\*@bucket'") as info:
        storage.call(fail(ValueError(f"Invalid bucket name '{KEY}:{SECRET}@bucket'")), f"s3://{KEY}:{SECRET}@b")
    _assert_no_secret(info.value)
    assert storage.translate(ValueError("x"), "s3://b") is None


# -- end to end: checkpoints and sinks on a real S3 endpoint ---------------------------------------


def _assert_no_secret(exc: BaseException) -> None:
    texts = [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
    for chained in (exc.__cause__, exc.__context__):
        if chained is not None:
            texts += [str(chained), repr(chained), "".join(traceback.format_exception(chained))]
    for text in texts:
        assert KEY not in text and SECRET not in text, text


@pytest.fixture
def no_env_credentials(monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def enforce_auth(s3):
    """moto checks credentials as AWS does (its server-mode switch), for this test only."""
    def reset_auth(count: str) -> str:
        req = urllib.request.Request(f"{s3['endpoint']}/moto-api/reset-auth", data=count.encode(), method="POST",
                                     headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(req) as resp:
            return str(json.loads(resp.read())["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"])

    previous = reset_auth("0")
    yield
    reset_auth(previous)


def _checkpoint(url, opts):
    ck.save_checkpoint({"a": 1}, 1, directory=url, storage_options=opts)


def _sink(kind):
    def write(url, opts):
        sink = kind(f"{url}/metrics.{kind.__name__}", opts, flush_interval=0)
        sink.on_metrics({"kind": "metric", "rank": 0, "attempt": 0, "step": 0, "time": 1.0, "loss": 0.5})
        sink.on_finish(None)
    return write


WRITERS = {"checkpoint": _checkpoint, "jsonl": _sink(JSONLinesSink), "csv": _sink(CSVSink)}
# (credentials in the URL's userinfo, in storage_options, the code expected, whether moto checks them)
CASES = {"none": ("", {}, "NoCredentialsError", False),
         "partial": (f"{KEY}@", {"key": KEY}, "PartialCredentialsError", False),
         "refused-in-options": ("", {"key": KEY, "secret": SECRET}, "InvalidAccessKeyId", True),
         "refused-in-url": (f"{KEY}:{SECRET}@", {}, "InvalidAccessKeyId", True),
         "refused-in-both": (f"{KEY}:{SECRET}@", {"key": KEY, "secret": SECRET}, "InvalidAccessKeyId", True)}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("writer", WRITERS)
def test_credential_errors_read_the_same_everywhere_and_never_show_a_secret(s3, no_env_credentials, request,
                                                                           writer, case):
    userinfo, creds, code, checked = CASES[case]
    if checked:
        request.getfixturevalue("enforce_auth")
    url = f"s3://{userinfo}{s3['bucket']}/run"
    opts = {"client_kwargs": {"endpoint_url": s3["endpoint"]}, "skip_instance_cache": True, **creds}
    with pytest.raises(PermissionError) as info:
        WRITERS[writer](url, opts)
    shown = re.escape(f"s3://{'***@' if userinfo else ''}{s3['bucket']}/run/")
    assert re.fullmatch(rf"access to {shown}\S+ was denied while [\w ]+ \({code}: [^()]*\): pass key= and secret= "
                        r"in storage_options or the environment \(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; "
                        r"anon=True for a public bucket\), and check the endpoint and the bucket's policy "
                        r"\(local: permissions\)", str(info.value)), str(info.value)
    _assert_no_secret(info.value)


@pytest.mark.parametrize("writer", WRITERS)
def test_a_missing_bucket_is_file_not_found_naming_the_url(s3, writer):
    url = f"s3://no-such-bucket-{s3['bucket']}/run"
    with pytest.raises(FileNotFoundError, match=rf"{re.escape(url)}/\S+ does not exist while .*\(NoSuchBucket"):
        WRITERS[writer](url, {**s3["storage_options"], "skip_instance_cache": True})


def test_one_door_every_s3_filesystem_of_a_process_shares_its_botocore_session(s3):
    """resolve (checkpoints, sinks, export) and open_fs (images, streaming) open S3 with one session per
    process; a session or profile the options name is kept, and a filesystem still pickles without it."""
    import pickle

    from dask_ddp.storage import open_fs

    url, opts = f"s3://{s3['bucket']}/door", {**s3["storage_options"], "skip_instance_cache": True}
    resolved, path = storage.resolve(url, opts)
    fresh, root = storage.open_fs(url + "/", s3["storage_options"])
    assert resolved is not fresh and root == path == f"{s3['bucket']}/door"
    assert resolved.session is not None and resolved.session is fresh.session is open_fs(url, opts)[0].session
    resolved.pipe_file(f"{path}/x", b"1")
    assert fresh.cat_file(f"{root}/x") == b"1" and pickle.loads(pickle.dumps(resolved)).cat_file(f"{path}/x") == b"1"
    import aiobotocore.session

    mine = aiobotocore.session.AioSession()
    assert storage.resolve(url, {**opts, "session": mine})[0].session is mine


def test_read_whole_is_one_get_where_s3fs_would_send_a_head_and_ranged_gets(s3, tmp_path):
    """The sharded and whole checkpoints, the tar index scan and the image reads take a whole object in one GET:
    s3fs alone turns an object bigger than its block size into a HEAD and concurrent ranged GETs (0.46x of
    one GET per object on moto, issue 44)."""
    opts = {**s3["storage_options"], "skip_instance_cache": True, "default_block_size": 1 << 20}
    fs, path = storage.resolve(f"s3://{s3['bucket']}/whole", opts)
    data = os.urandom(3 << 20)
    fs.pipe_file(f"{path}/big", data)
    calls: list[str] = []
    fs.s3.meta.events.register("before-call.s3", lambda model, **kw: calls.append(model.name))
    assert storage.one_get(fs.__class__) == {"max_concurrency": 1}
    assert storage.read_whole(fs, f"{path}/big") == data
    assert calls == ["GetObject"]
    calls.clear()
    assert fs.cat_file(f"{path}/big") == data  # what it saves: s3fs's own split of the same read
    assert calls.count("HeadObject") == 1 and calls.count("GetObject") == 3, calls
    (tmp_path / "small").write_bytes(b"abc")
    lfs, lpath = storage.resolve(tmp_path / "small")
    assert storage.one_get(lfs.__class__) == {} and storage.read_whole(lfs, lpath) == b"abc"


def _drop_inherited(holder: list, out) -> None:
    """In a forked child: let go of the parent's S3 filesystem (the last reference) and say how long that took."""
    import gc
    import time

    started = time.perf_counter()
    holder.clear()
    gc.collect()  # a filesystem sits in reference cycles: the collector frees it, whenever it runs
    out.put(time.perf_counter() - started)


def test_a_forked_child_never_waits_to_close_its_parents_s3_filesystem(s3):
    """s3fs closes a collected filesystem through its event loop: in a forked child (a DataLoader worker) that
    loop's thread does not exist, and fsspec's sync waits a whole second before giving up, once per filesystem.
    Such garbage stalled a worker's first batch by 1.2-2.5 s in one epoch in four. A forked child freezes what
    it inherits (``gc.freeze``), so none of it is collected there."""
    import multiprocessing as mp

    fs, root = storage.open_fs(f"s3://{s3['bucket']}", s3["storage_options"])
    fs.pipe_file(f"{root}/x", b"1")  # the session starts: s3fs registers its finalizer
    holder, ctx = [fs], mp.get_context("fork")
    del fs
    out = ctx.Queue()
    child = ctx.Process(target=_drop_inherited, args=(holder, out))
    child.start()
    took = out.get(timeout=60)
    child.join(30)
    assert took < 0.5, f"the child waited {took:.2f} s to drop its parent's filesystem"

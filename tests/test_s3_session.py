"""The S3 filesystems ``open_fs`` opens share a botocore session per process, and a forked DataLoader worker
inherits the service models its parent parsed (moto's server on 127.0.0.1; a real fork)."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import pytest

from dask_ddp.storage import open_fs


def _child(url: str, opts: dict, parent_session_id: int, out) -> None:
    """In a forked child: count botocore's JSON file loads while a fresh filesystem reads an object."""
    import botocore.loaders

    loads = []
    real = botocore.loaders.JSONFileLoader.load_file

    def counting(self, file_path):
        loads.append(file_path)
        return real(self, file_path)

    botocore.loaders.JSONFileLoader.load_file = counting
    try:
        fs, root = open_fs(url, opts)
        data = fs.cat_file(f"{root}/obj", max_concurrency=1)
        out.put((data, [str(p).rsplit("/", 2)[-1] for p in loads], id(fs.session) != parent_session_id))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((None, repr(e), None))


def test_one_session_per_process_and_the_options_stay_picklable(s3):
    url, opts = f"s3://{s3['bucket']}", s3["storage_options"]
    fs1, root = open_fs(url, opts)
    fs2, _ = open_fs(url, opts)
    fs1.pipe_file(f"{root}/obj", b"hello")
    assert fs1 is not fs2 and fs1.session is fs2.session  # two filesystems, one session
    assert fs2.cat_file(f"{root}/obj") == b"hello"
    copy = pickle.loads(pickle.dumps(fs1))  # the session is not in the options: a pickled fs rebuilds its own
    assert copy.cat_file(f"{root}/obj") == b"hello"


def test_a_session_the_options_name_is_kept(s3):
    import aiobotocore.session

    mine = aiobotocore.session.AioSession()
    fs, root = open_fs(f"s3://{s3['bucket']}", {**s3["storage_options"], "session": mine})
    assert fs.session is mine
    fs.pipe_file(f"{root}/x", b"1")
    assert fs.cat_file(f"{root}/x") == b"1"


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="needs fork (DataLoader workers on Linux)")
def test_a_forked_child_parses_no_service_model_its_parent_parsed(s3):
    url, opts = f"s3://{s3['bucket']}", s3["storage_options"]
    fs, root = open_fs(url, opts)
    fs.pipe_file(f"{root}/obj", b"payload")
    assert fs.cat_file(f"{root}/obj") == b"payload"  # the parent's loader now holds S3's models
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child, args=(url, opts, id(fs.session), out))
    child.start()
    try:
        data, loads, own_session = out.get(timeout=60)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert data == b"payload", loads
    assert own_session  # a session of its own (asyncio locks do not cross a fork) ...
    assert loads == []  # ... with the parent's parsed models: no JSON parsed again

"""S3ImageFolder against torchvision's ImageFolder, over a local tree, memory:// and a real (moto) S3 endpoint.

S3 requests are counted by a WSGI middleware in front of moto's own app (same
in-process backends as conftest's server), so LIST/HEAD/GET counts are what the
server really saw, from this process and from DataLoader worker processes.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import socket
import threading
import time
import urllib.request
import uuid

import boto3
import fsspec
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms import ToTensor

from dask_ddp.data import FolderIndex, ImageDecodeError, S3ImageFolder, index_folder


def _image(seed: int, fmt: str, size=(9, 7)) -> bytes:
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


# Classes, nested folders, mixed-case extensions, glob characters, non-images, files under the root.
# "cat/sub" < "cat/sub-2" < "cat/sub/deeper" is os.walk's order, not the order of sorted relative paths.
TREE = {
    "top.png": _image(0, "PNG"),
    "README.txt": b"ignored: directly under the root",
    "bird/z.jpg": _image(1, "JPEG"),
    "cat/1.png": _image(2, "PNG"),
    "cat/2.JPG": _image(3, "JPEG"),
    "cat/notes.txt": b"not an image",
    "cat/sub/3.jpeg": _image(4, "JPEG"),
    "cat/sub-2/5.png": _image(5, "PNG"),
    "cat/sub/deeper/4.Png": _image(6, "PNG"),
    "dog/a[1].png": _image(7, "PNG"),
    "dog/b.bmp": _image(8, "BMP"),
    "dog/w*x?.png": _image(9, "PNG"),
    "dog/with space.jpeg": _image(10, "JPEG"),
}
N_IMAGES = 10


def _put_s3(s3, files: dict, prefix: str = "data") -> str:
    client = boto3.client("s3", endpoint_url=s3["endpoint"], region_name="us-east-1")
    for rel, blob in files.items():
        client.put_object(Bucket=s3["bucket"], Key=f"{prefix}/{rel}", Body=blob)
    return f"s3://{s3['bucket']}/{prefix}"


def _write_local(root, files: dict) -> str:
    for rel, blob in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(blob)
    return str(root)


class _CountingS3:
    """moto's S3 app behind a middleware that logs requests and can inject 500s and delays."""

    def __init__(self, app):
        self.app, self.log, self.fail, self.delay = app, [], {}, 0.0
        self.inflight = self.max_inflight = 0
        self.lock = threading.Lock()

    def __call__(self, environ, start_response):
        path = environ["PATH_INFO"]
        self.log.append((environ["REQUEST_METHOD"], path, environ.get("QUERY_STRING", "")))
        with self.lock:
            if self.fail.get(path, 0) > 0:
                self.fail[path] -= 1
                start_response("500 Internal Server Error", [("Content-Type", "application/xml")])
                return [b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"]
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            time.sleep(self.delay)
            return self.app(environ, start_response)
        finally:
            with self.lock:
                self.inflight -= 1

    def reset(self):
        self.log.clear()
        self.max_inflight = 0

    def lists(self, bucket):
        return [r for r in self.log if r[0] == "GET" and r[1].rstrip("/") == f"/{bucket}"]

    def object_requests(self, bucket, method):
        return [r[1] for r in self.log if r[0] == method and r[1].startswith(f"/{bucket}/")]


@pytest.fixture(scope="module")
def counting_server():
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    recorder = _CountingS3(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, recorder, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield recorder, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


@pytest.fixture
def counted(s3, counting_server):
    """(recorder, url, storage_options): the test tree in a fresh bucket, reached through the counting server."""
    recorder, endpoint = counting_server
    url = _put_s3(s3, TREE)
    opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing",
            "config_kwargs": {"retries": {"total_max_attempts": 1}}}
    recorder.reset()
    recorder.fail.clear()
    yield recorder, url, opts
    recorder.delay = 0.0


@pytest.fixture
def local_tree(tmp_path):
    return _write_local(tmp_path / "tree", TREE)


@pytest.fixture(params=["path", "file", "memory", "s3"])
def tree(request, local_tree):
    """(url, storage_options) of the same tree on each backend."""
    if request.param == "path":
        return local_tree, None
    if request.param == "file":
        return "file://" + local_tree, None
    if request.param == "memory":
        url = f"memory://tree-{uuid.uuid4().hex[:8]}"
        mem = fsspec.filesystem("memory")
        for rel, blob in TREE.items():
            mem.pipe(f"{url}/{rel}", blob)
        request.addfinalizer(lambda: mem.rm(url, recursive=True))
        return url, None
    s3 = request.getfixturevalue("s3")
    return _put_s3(s3, TREE), s3["storage_options"]


def _wire_path(url: str) -> str:
    """The HTTP path of an s3:// URL as the (path-style) server sees it."""
    return "/" + url.removeprefix("s3://")


def _rel(samples, root):
    return [os.path.relpath(path, root) for path, _ in samples]


def _items(dataset):
    return [dataset[i] for i in range(len(dataset))]


def _same_items(got, want):
    assert len(got) == len(want)
    for (x, y), (x2, y2) in zip(got, want):
        assert y == y2
        assert torch.equal(x, x2)


# -- contract vs torchvision --------------------------------------------------------------------


def test_same_as_torchvision_imagefolder(tree, local_tree):
    url, opts = tree
    ours = S3ImageFolder(url, transform=ToTensor(), storage_options=opts)
    tv = ImageFolder(local_tree, transform=ToTensor())
    assert ours.classes == tv.classes == ["bird", "cat", "dog"]
    assert ours.class_to_idx == tv.class_to_idx
    assert [ours.relpath(i) for i in range(len(ours))] == _rel(tv.samples, local_tree)
    assert len(ours) == N_IMAGES
    assert ours.targets == tv.targets
    assert ours.imgs is ours.samples
    assert ours.extensions == IMG_EXTENSIONS
    assert all(path.startswith(url.rstrip("/") + "/") for path, _ in ours.samples)
    _same_items(_items(ours), _items(tv))


def test_plain_local_path_gives_imagefolders_exact_samples(local_tree):
    assert S3ImageFolder(local_tree + "/").samples == ImageFolder(local_tree).samples


def test_symlinked_class_folders_are_followed_on_local_disk(local_tree, tmp_path):
    import shutil

    root = tmp_path / "with-links"
    shutil.copytree(local_tree, root)
    os.symlink(os.path.join(local_tree, "dog"), root / "zebra")  # a class that is a link, as os.walk follows
    os.symlink(os.path.join(local_tree, "cat"), root / "bird" / "more")  # a linked folder inside a class
    ours, tv = S3ImageFolder(str(root), transform=ToTensor()), ImageFolder(str(root), transform=ToTensor())
    assert ours.classes == tv.classes == ["bird", "cat", "dog", "zebra"]
    assert ours.samples == tv.samples and ours.targets == tv.targets
    _same_items(_items(ours), _items(tv))


def test_is_valid_file_gets_the_url_and_replaces_extensions(s3, local_tree):
    url = _put_s3(s3, TREE)
    seen = []

    def lower_png_jpg(path):
        seen.append(path)
        return path.endswith((".png", ".jpg"))

    ours = S3ImageFolder(url, is_valid_file=lower_png_jpg, storage_options=s3["storage_options"])
    tv = ImageFolder(local_tree, is_valid_file=lambda p: p.endswith((".png", ".jpg")))
    assert len(ours) == 5
    assert [ours.relpath(i) for i in range(len(ours))] == _rel(tv.samples, local_tree)
    assert ours.extensions is None
    assert f"{url}/cat/notes.txt" in seen and f"{url}/top.png" not in seen


def test_user_loader_receives_a_named_binary_file(tree):
    url, opts = tree
    got = S3ImageFolder(url, loader=lambda f: (f.name, len(f.read())), storage_options=opts)
    name, size = got[0][0]
    assert name == got.samples[0][0] and size == len(TREE["bird/z.jpg"])


@pytest.mark.parametrize("name", ["pil_loader", "default_loader"])
def test_torchvisions_path_loaders_work_too(s3, local_tree, name):
    from torchvision.datasets import folder

    loader = getattr(folder, name)
    url = _put_s3(s3, TREE)
    ours = S3ImageFolder(url, transform=ToTensor(), loader=loader, storage_options=s3["storage_options"])
    _same_items(_items(ours), _items(ImageFolder(local_tree, transform=ToTensor(), loader=loader)))


def test_empty_class_raises_unless_allow_empty(s3, tmp_path):
    files = {**TREE, "empty/readme.txt": b"no image here"}
    url = _put_s3(s3, files)
    with pytest.raises(FileNotFoundError, match=r"classes empty in s3://.*Supported extensions"):
        S3ImageFolder(url, storage_options=s3["storage_options"])
    ours = S3ImageFolder(url, storage_options=s3["storage_options"], allow_empty=True)
    tv = ImageFolder(_write_local(tmp_path, files), allow_empty=True)
    assert ours.classes == tv.classes == ["bird", "cat", "dog", "empty"]
    assert ours.targets == tv.targets


# -- errors -------------------------------------------------------------------------------------


def test_missing_bucket_and_prefix(s3):
    opts = s3["storage_options"]
    missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/data"
    with pytest.raises(FileNotFoundError, match=missing):
        S3ImageFolder(missing, storage_options=opts)
    _put_s3(s3, TREE)
    with pytest.raises(FileNotFoundError, match=f"s3://{s3['bucket']}/nope"):
        S3ImageFolder(f"s3://{s3['bucket']}/nope", storage_options=opts)
    with pytest.raises(FileNotFoundError, match="/nope"):
        S3ImageFolder("memory://nope-" + uuid.uuid4().hex)


def test_no_class_folder(s3, tmp_path):
    url = _put_s3(s3, {"a.png": TREE["top.png"], "b.txt": b"x"})
    with pytest.raises(FileNotFoundError, match=f"Couldn't find any class folder in {url}"):
        S3ImageFolder(url, storage_options=s3["storage_options"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="Couldn't find any class folder"):
        S3ImageFolder(tmp_path / "empty")
    with pytest.raises(NotADirectoryError, match="top.png"):
        S3ImageFolder(f"{_put_s3(s3, TREE, 'other')}/top.png", storage_options=s3["storage_options"])


def test_bad_credentials_are_a_permission_error_without_the_secret(s3):
    url = _put_s3(s3, TREE)
    secret = "SECRET-" + uuid.uuid4().hex
    opts = {**s3["storage_options"], "key": "AKIAWRONGKEY", "secret": secret}

    def auth(count):  # moto's server-mode switch: enforce IAM auth after `count` requests
        req = urllib.request.Request(f"{s3['endpoint']}/moto-api/reset-auth", data=count.encode(), method="POST",
                                     headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(req) as resp:
            return json.loads(resp.read())["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"]

    previous = auth("0")
    try:
        with pytest.raises(PermissionError, match=f"access to {url} was denied") as info:
            S3ImageFolder(url, storage_options=opts)
    finally:
        auth(previous)
    assert secret not in str(info.value) and secret not in repr(info.value)


def test_undecodable_object_names_its_url_in_process_and_in_a_worker(s3):
    url = _put_s3(s3, {**TREE, "cat/broken.png": b"this is not a png"})
    ds = S3ImageFolder(url, transform=ToTensor(), storage_options=s3["storage_options"])
    bad = [path for path, _ in ds.samples].index(f"{url}/cat/broken.png")
    with pytest.raises(ImageDecodeError, match=r"cannot load s3://.*/cat/broken\.png as an image"):
        ds[bad]
    loader = DataLoader(ds, batch_size=4, num_workers=1)
    with pytest.raises(ImageDecodeError, match=r"/cat/broken\.png"):
        list(loader)


@pytest.mark.slow
def test_transient_errors_are_retried(counted, caplog):
    recorder, url, opts = counted
    ds = S3ImageFolder(url, transform=ToTensor(), storage_options=opts, retries=2)
    want = ds[3][0]
    key = _wire_path(ds.samples[3][0])
    recorder.fail[key] = 2
    recorder.reset()
    assert torch.equal(ds[3][0], want)
    retries = [r.getMessage() for r in caplog.records if r.name.startswith("dask_ddp.data")]
    assert len(retries) == 2 and "cat/sub/3.jpeg" in retries[0] and "attempt 2 of 3" in retries[0]
    assert recorder.object_requests(url.split("/")[2], "GET").count(key) == 3


def test_persistent_errors_name_the_key(counted):
    recorder, url, opts = counted
    ds = S3ImageFolder(url, storage_options=opts, retries=1)
    key = _wire_path(ds.samples[1][0])
    recorder.fail[key] = 100
    recorder.reset()
    with pytest.raises(OSError, match=r"could not read s3://.*/cat/1\.png after 2 attempts: OSError"):
        ds.__getitems__([0, 1])
    assert recorder.object_requests(url.split("/")[2], "GET").count(key) == 2


def test_unreachable_endpoint_names_the_key(counted):
    _, url, opts = counted
    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    ds = S3ImageFolder(url, storage_options=opts)
    offline = S3ImageFolder(url, index=ds.index, retries=1,
                            storage_options={**opts, "client_kwargs": {"endpoint_url": dead}})
    with pytest.raises(OSError, match=r"could not read s3://.*/bird/z\.jpg after 2 attempts"):
        offline[0]


def test_object_deleted_after_listing(s3):
    url = _put_s3(s3, TREE)
    ds = S3ImageFolder(url, storage_options=s3["storage_options"])
    boto3.client("s3", endpoint_url=s3["endpoint"], region_name="us-east-1").delete_object(
        Bucket=s3["bucket"], Key="data/bird/z.jpg")
    with pytest.raises(FileNotFoundError, match=r"s3://.*/bird/z\.jpg does not exist"):
        ds[0]


# -- pickling, listing once, processes ----------------------------------------------------------


def test_pickle_ships_index_not_clients_and_hides_credentials(s3):
    url = _put_s3(s3, TREE)
    secret = "SECRET-" + uuid.uuid4().hex  # moto does not check it unless auth is enforced
    opts = {**s3["storage_options"], "secret": secret}
    ds = S3ImageFolder(url, transform=ToTensor(), storage_options=opts)
    ds[0]  # opens this process's filesystem
    blob = pickle.dumps(ds)
    for forbidden in (b"S3FileSystem", b"aiobotocore", b"ClientSession"):
        assert forbidden not in blob
    back = pickle.loads(blob)
    for text in (repr(ds), repr(back), repr(back.storage_options), str(vars(back))):
        assert secret not in text
    assert back.samples == ds.samples and back.index == ds.index
    _same_items(_items(back), _items(ds))


def test_pickle_and_workers_never_list_again(counted):
    recorder, url, opts = counted
    bucket = url.split("/")[2]
    ds = S3ImageFolder(url, transform=ToTensor(), storage_options=opts)
    assert len(recorder.lists(bucket)) == 1
    recorder.reset()
    back = pickle.loads(pickle.dumps(ds))
    batches = list(DataLoader(back, batch_size=3, num_workers=2))
    assert sum(len(y) for _, y in batches) == N_IMAGES
    assert recorder.lists(bucket) == []
    assert recorder.object_requests(bucket, "HEAD") == []  # no HEAD before GET
    gets = recorder.object_requests(bucket, "GET")
    assert sorted(gets) == sorted(_wire_path(p) for p, _ in ds.samples)


def test_index_is_reusable_without_listing(counted):
    recorder, url, opts = counted
    index = index_folder(url, opts)
    assert isinstance(index, FolderIndex) and len(recorder.lists(url.split("/")[2])) == 1
    recorder.reset()
    a = S3ImageFolder(url, index=index, storage_options=opts)
    b = S3ImageFolder(url + "/", index=a.index, storage_options=opts, is_valid_file=lambda p: "/cat/" in p,
                      allow_empty=True)
    assert recorder.log == []
    assert len(a) == N_IMAGES and b.classes == a.classes and set(b.targets) == {1}
    with pytest.raises(ValueError, match="index was built for"):
        S3ImageFolder(url + "/other", index=index, storage_options=opts)
    with pytest.raises(ValueError, match="retries must be 0 or more"):
        S3ImageFolder(url, index=index, retries=-1)


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow),
                                     pytest.param("forkserver", marks=pytest.mark.slow)])
def test_dataloader_workers_in_every_start_method(s3, context):
    url = _put_s3(s3, TREE)
    ds = S3ImageFolder(url, transform=ToTensor(), storage_options=s3["storage_options"])
    want = _items(ds)  # the parent's filesystem exists before the workers start
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context)
    got = [(x, int(y)) for xs, ys in loader for x, y in zip(xs, ys)]
    _same_items(got, want)


# -- speed features -----------------------------------------------------------------------------


def test_getitems_fetches_a_batch_concurrently(counted):
    recorder, url, opts = counted
    ds = S3ImageFolder(url, transform=ToTensor(), storage_options=opts)
    want = _items(ds)
    recorder.reset()
    recorder.delay = 0.3
    start = time.perf_counter()
    got = ds.__getitems__(list(range(N_IMAGES)))
    elapsed = time.perf_counter() - start
    _same_items(got, want)
    assert recorder.max_inflight >= 5, recorder.max_inflight
    assert elapsed < N_IMAGES * 0.3 / 2, elapsed  # one at a time would take 3 s
    keys = recorder.object_requests(url.split("/")[2], "GET")
    assert len(keys) == N_IMAGES and any("a[1].png" in k for k in keys) and any("w*x?.png" in k for k in keys)


def test_cache_serves_later_epochs_from_disk(counted, tmp_path):
    recorder, url, opts = counted
    bucket = url.split("/")[2]
    ds = S3ImageFolder(url, transform=ToTensor(), storage_options=opts, cache=tmp_path / "cache")
    recorder.reset()
    first = ds.__getitems__(list(range(N_IMAGES)))
    assert len(recorder.object_requests(bucket, "GET")) == N_IMAGES
    cached = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "cache") for f in fs]
    assert len(cached) == N_IMAGES and not any(f.endswith(".tmp") for f in cached)
    assert sorted(os.path.getsize(f) for f in cached) == sorted(len(TREE[ds.relpath(i)]) for i in range(N_IMAGES))
    recorder.reset()
    again = pickle.loads(pickle.dumps(ds))
    _same_items(list(DataLoader(again, batch_size=None, num_workers=2)), first)
    assert recorder.log == []


@pytest.mark.slow
def test_cache_that_cannot_be_written_warns_once_and_samples_still_load(counted, tmp_path, caplog):
    recorder, url, opts = counted
    bucket = url.split("/")[2]
    (tmp_path / "afile").write_text("a file where the cache's parent folder should be")  # fails for root too
    cache = tmp_path / "afile" / "cache"
    want = _items(S3ImageFolder(url, transform=ToTensor(), storage_options=opts))
    ds = S3ImageFolder(url, transform=ToTensor(), storage_options=opts, cache=cache)
    caplog.set_level(logging.WARNING, logger="dask_ddp.data.blob_cache")
    recorder.reset()
    _same_items(ds.__getitems__(list(range(N_IMAGES))) + _items(ds), want + want)
    warned = [r.getMessage() for r in caplog.records if r.name == "dask_ddp.data.blob_cache"]
    assert len(warned) == 1, warned
    assert str(cache) in warned[0] and "NotADirectoryError" in warned[0] and "caching is off" in warned[0]
    assert len(recorder.object_requests(bucket, "GET")) == 2 * N_IMAGES  # off: every read goes to the store
    again = pickle.loads(pickle.dumps(ds))  # off for the dataset, DataLoader workers' copies included
    _same_items(list(DataLoader(again, batch_size=None, num_workers=1)), want)
    assert len([r for r in caplog.records if r.name == "dask_ddp.data.blob_cache"]) == 1


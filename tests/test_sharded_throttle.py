"""Sharded checkpoints through a throttling S3: real 503 SlowDown answers over HTTP, not an injected exception.

moto does not throttle, so the test puts a small HTTP proxy on 127.0.0.1 in front of moto's server: it forwards
every request and answers a share of them (every ``EVERY``-th, PUTs and GETs alike, from the first) with S3's
``503 SlowDown`` error instead. The client's own retries (s3fs's and botocore's) are turned off, so dask-ddp's
retries with backoff are what must carry a save and a load of a sharded step through it, bitwise (the throttled
requests are counted), and a store that throttles everything must fail with the rank and the key named rather than
hang. (With the client's retries on, one s3fs call against a store that throttles everything gives up after
~42 s and 25 requests; dask-ddp retries that 6 times: about 4 minutes before the error.)
"""

from __future__ import annotations

import http.client
import http.server
import threading
import urllib.parse

import pytest
import torch

import dask_ddp
from dask_ddp.checkpoint.sharded.writer import ShardError

EVERY = 3
SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message><RequestId>t</RequestId></Error>")


class Throttler(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream: str, every: int):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.every, self.count, self.throttled, self.lock = every, 0, 0, threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)

    def turn(self) -> bool:
        with self.lock:
            self.count += 1
            hit = self.every > 0 and self.count % self.every == 1 % self.every
            self.throttled += hit
            return hit


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _any(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        if self.server.turn():
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(SLOWDOWN)))
            self.end_headers()
            self.wfile.write(SLOWDOWN if self.command != "HEAD" else b"")
            return
        up = http.client.HTTPConnection(self.server.upstream.hostname, self.server.upstream.port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("expect", "connection")}
        up.request(self.command, self.path, body=body, headers=headers)
        reply = up.getresponse()
        data = reply.read()
        self.send_response(reply.status, reply.reason)
        for key, value in reply.getheaders():
            if key.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                self.send_header(key, value)
        # a HEAD's length is the object's, as the store said
        self.send_header("Content-Length", reply.getheader("Content-Length", "0") if self.command == "HEAD"
                         else str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        up.close()

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any


@pytest.fixture
def throttler(s3, monkeypatch):
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs's own retries (a class setting: no option)
    servers = []

    def start(every):
        server = Throttler(s3["endpoint"], every)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        host, port = server.server_address
        opts = {**s3["storage_options"], "client_kwargs": {"endpoint_url": f"http://{host}:{port}"},
                "config_kwargs": {"retries": {"total_max_attempts": 1}}}
        return server, opts

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])


def test_save_and_load_through_a_store_that_throttles_every_third_request(s3, throttler):
    server, opts = throttler(EVERY)
    url = f"s3://{s3['bucket']}/ckpt"
    saved = model()
    dask_ddp.save_sharded({"model": saved}, 7, directory=url, storage_options=opts)
    fresh = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    assert dask_ddp.load_sharded({"model": fresh}, directory=url, storage_options=opts) == 7
    for key, value in saved.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    print(f"\n{server.throttled} of {server.count} requests answered 503 SlowDown; save and load retried them")
    assert server.throttled >= 5 and server.count > server.throttled


def test_a_store_that_throttles_everything_fails_naming_the_key(s3, throttler):
    server, opts = throttler(1)
    url = f"s3://{s3['bucket']}/ckpt"
    with pytest.raises((ShardError, OSError, PermissionError)) as info:
        dask_ddp.save_sharded({"model": model()}, 1, directory=url, storage_options=opts)
    assert s3["bucket"] in str(info.value) and "rank 0" in str(info.value), str(info.value)
    print(f"\nevery request throttled ({server.count}): {type(info.value).__name__}: {str(info.value)[:300]}")

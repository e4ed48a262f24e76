"""No secret travels: a key and a secret planted in every option that can carry one, searched for in every channel.

Options: ``checkpoint_options`` (key, secret), the userinfo of ``checkpoint_dir`` (``s3://KEY:SECRET@bucket``),
a sink's ``storage_options``, and a storage call inside the rank that fails with them. Channels: reprs of
the job, its spec and the rank's context (printed and logged by the rank), the job's logs, events, metrics
and history, its error (text, repr, traceback, notes, chained causes), the checkpoint files and markers,
the sink's file, the scheduler's event topics during and after the job, and the workers' and scheduler's logs.
A real S3 endpoint (moto's server on 127.0.0.1) takes any credentials, so the planted ones work.
"""

from __future__ import annotations

import logging
import time
import traceback

import fsspec
import pytest
from _cluster import run, wait_until

import dask_ddp

KEY, SECRET = "AKIAPLANTEDKEY7777", "planted-secret-9999"


def _train(bad_url: str):
    ctx = dask_ddp.get_context()
    print("context:", ctx, repr(ctx), flush=True)
    logging.getLogger("train").warning("context %r", ctx)
    dask_ddp.report(loss=1.0)
    dask_ddp.save_checkpoint({"w": [1.0, 2.0]}, step=1)
    time.sleep(1.5)  # the test reads the scheduler's topics meanwhile
    dask_ddp.save_checkpoint({"w": 1}, step=2, directory=bad_url)  # no such bucket: the job fails with this error


def _texts(exc: BaseException) -> list[str]:
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out += [str(exc), repr(exc), "".join(traceback.format_exception(exc)), *getattr(exc, "__notes__", [])]
        exc = exc.__cause__ or exc.__context__
    return out


def _topics(dask_scheduler=None) -> str:
    return repr({name: list(topic.events) for name, topic in dask_scheduler._broker._topics.items()})


@pytest.mark.slow
def test_planted_credentials_appear_in_no_channel(client, s3):
    endpoint, bucket = s3["endpoint"], s3["bucket"]
    options = {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint}}
    sink = dask_ddp.JSONLinesSink(f"s3://{bucket}/metrics.jsonl", storage_options=dict(options))
    job = run(client, _train, f"s3://{KEY}:{SECRET}@no-such-bucket-{bucket}/x", name="secrets",
              checkpoint_dir=f"s3://{KEY}:{SECRET}@{bucket}/ckpt", checkpoint_options=dict(options), callbacks=[sink])
    wait_until(lambda: not job.metrics.empty, 60, what="the first report")
    during = client.run_on_scheduler(_topics)
    with pytest.raises(Exception) as failed:
        job.result(timeout=120)

    fs = fsspec.filesystem("s3", **s3["storage_options"])
    stored = {path: fs.cat(path) for path in fs.find(bucket)}
    assert any("ckpt" in p for p in stored) and any(p.endswith("metrics.jsonl") for p in stored), list(stored)
    channels = {
        "repr(job)": repr(job), "repr(job.spec)": repr(job.spec), "str(job.spec)": str(job.spec),
        "repr(sink)": repr(sink), "job.logs": "\n".join(job.logs), "job.events": repr(job.events),
        "job.metrics": job.metrics.to_string(), "job.history": repr(job.history),
        "the error": "\n".join(_texts(failed.value)),
        "stored files": repr(stored),
        "scheduler topics, during": during, "scheduler topics, after": client.run_on_scheduler(_topics),
        "worker logs": repr(client.get_worker_logs()), "scheduler logs": repr(client.get_scheduler_logs()),
    }
    assert "context: Context(" in channels["job.logs"]  # the rank did print its context
    assert "no-such-bucket" in channels["the error"]  # the failing URL is named, without its credentials
    leaks = {name: [s for s in (KEY, SECRET) if s in text] for name, text in channels.items()}
    where = {name: [text[max(0, text.find(s) - 200):text.find(s) + 50] for s in found]
             for name, found in leaks.items() if found for text in [channels[name]]}
    assert not any(leaks.values()), where


def test_credentials_in_an_image_folder_url_stay_out_of_its_root_samples_and_errors(s3):
    """``S3ImageFolder("s3://KEY:SECRET@bucket/x")`` reads with those credentials, but its root, samples, repr
    and errors show ``s3://bucket/x``: samples are printed, logged and pickled to DataLoader workers."""
    import io

    from PIL import Image

    endpoint, bucket = s3["endpoint"], s3["bucket"]
    fs = fsspec.filesystem("s3", **s3["storage_options"])
    for path in ("imgs/a/1.png", "imgs/b/2.png"):
        buf = io.BytesIO()
        Image.new("RGB", (4, 4), (10, 20, 30)).save(buf, format="PNG")
        fs.pipe(f"{bucket}/{path}", buf.getvalue())
    data = dask_ddp.S3ImageFolder(f"s3://{KEY}:{SECRET}@{bucket}/imgs",
                                  storage_options={"client_kwargs": {"endpoint_url": endpoint}})
    assert data.root == f"s3://{bucket}/imgs"
    assert [s for s, _ in data.samples] == [f"s3://{bucket}/imgs/a/1.png", f"s3://{bucket}/imgs/b/2.png"]
    assert data[0][0].size == (4, 4) and data.storage_options["key"] == KEY  # the credentials are used
    fs.rm(f"{bucket}/imgs/b/2.png")
    with pytest.raises(FileNotFoundError) as missing:
        data[1]
    texts = [data.root, repr(data), str(data), repr(data.samples), repr(data.storage_options), *_texts(missing.value)]
    assert not [t for t in texts if KEY in t or SECRET in t], texts

"""dask-pytorch-ddp 0.2.2's API (``dispatch.run`` futures, ``DaskResultsHandler``) on a real LocalCluster.

The first test is the README's example of dask-pytorch-ddp, changed only
where a CPU-only machine needs it: ``from dask_ddp.compat import dispatch,
results`` and ``from dask_ddp.compat.data import S3ImageFolder`` instead of
``dask_pytorch_ddp``'s, a tiny CNN for resnet18, small images (on the test's
S3 server, which the workers find through ``AWS_ENDPOINT_URL_S3``), the CPU
for ``torch.device(0)`` and ``backend="gloo"``.
"""

from __future__ import annotations

import datetime
import inspect
import io
import json
import multiprocessing as mp
import os
import pickle
import traceback
import uuid
from pathlib import Path

import boto3
import pytest
import torch
import torch.distributed as dist
from _cluster import leftover_processes, local_client, wait_until
from dask.distributed import wait
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import SubsetRandomSampler
from torchvision import transforms

import dask_ddp
from dask_ddp.compat import dispatch, results
from dask_ddp.compat.data import S3ImageFolder
from dask_ddp.compat.results import DaskResultsHandler


@pytest.fixture(scope="module")
def client(s3_server):
    env = {"AWS_ENDPOINT_URL_S3": s3_server}  # how boto3 and s3fs find a non-AWS endpoint without code changes
    with local_client(2, env=env) as c:
        yield c


@pytest.fixture(scope="module")
def image_bucket(s3_server):
    """64 small PNGs in 4 classes at s3://<bucket>/images/<class>/, as the README's bucket would hold them."""
    from PIL import Image

    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    bucket = "compat-images"
    s3.create_bucket(Bucket=bucket)
    gen = torch.Generator().manual_seed(0)
    for i in range(64):
        buf = io.BytesIO()
        Image.fromarray(torch.randint(0, 256, (20, 20, 3), generator=gen, dtype=torch.uint8).numpy()).save(buf, "PNG")
        s3.put_object(Bucket=bucket, Key=f"images/class{i % 4}/img{i:02d}.png", Body=buf.getvalue())
    return bucket


# ---- the README example, on CPU --------------------------------------------------------------------------

transform = transforms.Compose([transforms.Resize(18), transforms.CenterCrop(16), transforms.ToTensor()])
key = "compat-test-key"
rh = results.DaskResultsHandler(key)


def tiny_cnn():  # stands in for models.resnet18(pretrained=False)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4))


def run_transfer_learning(bucket, prefix, samplesize, n_epochs, batch_size, num_workers, train_sampler):
    worker_rank = int(dist.get_rank())
    device = torch.device("cpu")  # README: torch.device(0)
    net = tiny_cnn()
    model = net.to(device)
    model = DDP(model)  # README: DDP(model, device_ids=[0])

    criterion = nn.CrossEntropyLoss()  # README: .cuda()
    lr = 0.001
    optimizer = optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    whole_dataset = S3ImageFolder(bucket, prefix, transform=transform)

    train_loader = torch.utils.data.DataLoader(
        whole_dataset,
        sampler=train_sampler,
        batch_size=batch_size,
        num_workers=num_workers,
        multiprocessing_context=mp.get_context('fork')
    )

    count = 0
    for epoch in range(n_epochs):
        # Each epoch has a training and validation phase
        model.train()  # Set model to training mode
        for inputs, labels in train_loader:
            dt = datetime.datetime.now().isoformat()
            inputs = inputs.to(device)
            labels = labels.to(device)
            outputs = model(inputs)
            _, preds = torch.max(outputs, 1)
            loss = criterion(outputs, labels)

            # zero the parameter gradients
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            count += 1

            # statistics
            rh.submit_result(
                f"worker/{worker_rank}/data-{dt}.json",
                json.dumps({'loss': loss.item(), 'epoch': epoch, 'count': count, 'worker': worker_rank})
            )
            if (count % 4) == 0 and worker_rank == 0:  # README: every 100 batches
                rh.submit_result(f"checkpoint-{dt}.pkl", pickle.dumps(model.state_dict()))


@pytest.mark.slow
def test_readme_example_with_changed_imports(client, image_bucket, tmp_path):
    train_sampler = SubsetRandomSampler(list(range(48)))  # 48 samples, batches of 8: 6 per epoch
    futures = dispatch.run(client, run_transfer_learning, bucket=image_bucket, prefix="images", samplesize=48,
                           n_epochs=2, batch_size=8, num_workers=1, train_sampler=train_sampler, backend="gloo")
    assert len(futures) == 2
    rh.process_results(str(tmp_path), futures, raise_errors=False)
    done, not_done = wait(futures)
    assert len(done) == 2 and not not_done
    assert client.gather(futures) == [None, None]  # the function returns nothing

    for rank in (0, 1):
        files = sorted((tmp_path / "worker" / str(rank)).iterdir())
        stats = [json.loads(f.read_text()) for f in files]
        assert [s["count"] for s in stats] == list(range(1, 13)) and {s["worker"] for s in stats} == {rank}
    checkpoints = sorted(tmp_path.glob("checkpoint-*.pkl"))
    assert len(checkpoints) == 3
    state = pickle.loads(checkpoints[-1].read_bytes())
    assert "module.4.weight" in state and state["module.4.weight"].shape == (4, 4)
    assert leftover_processes(client) == []


# ---- the other promises of 0.2.2 ---------------------------------------------------------------------------

def local_rank_and_limits(tag, local_rank):
    out = {"tag": tag, "local_rank": local_rank, "world_size": dist.get_world_size()}
    handler = results.DaskResultsHandler("limits")
    try:
        handler.submit_result("checkpoint.pkl", pickle.dumps(torch.zeros(32_000)))  # ~128 KB
    except ValueError as exc:
        out["refused"] = str(exc)
    handler.submit_result("small.bin", b"\x00\xffok")
    return out


@pytest.mark.slow
def test_pass_local_rank_and_a_checkpoint_sized_result_is_refused(client, tmp_path):
    futures = dispatch.run(client, local_rank_and_limits, "t", backend="gloo", pass_local_rank=True)
    out = client.gather(futures)
    assert [o["local_rank"] for o in out] == [0, 1] and [o["tag"] for o in out] == ["t", "t"]
    assert all(o["world_size"] == 2 for o in out)
    msg = out[0]["refused"]
    assert "checkpoint.pkl" in msg and "64 KiB" in msg and "dask_ddp.save_checkpoint" in msg
    DaskResultsHandler("limits").process_results(str(tmp_path), futures)
    assert (tmp_path / "small.bin").read_bytes() == b"\x00\xffok"
    assert not (tmp_path / "checkpoint.pkl").exists()


def raises_on_rank_one(handler):
    handler.submit_result(f"before/{dist.get_rank()}.txt", "written before the error")
    if dist.get_rank() == 1:
        raise ValueError("bad batch on rank 1")
    dist.barrier()  # rank 0 waits for rank 1 and is stopped
    return "unreachable"


@pytest.mark.slow
def test_a_raising_rank_raises_through_gather_and_process_results(client, tmp_path):
    handler = DaskResultsHandler()
    futures = dispatch.run(client, raises_on_rank_one, handler, backend="gloo")
    wait(futures)  # never raises
    with pytest.raises(ValueError, match="bad batch on rank 1") as info:
        client.gather(futures)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised on rank 1" in notes and "other ranks: rank 0" in notes
    assert "raises_on_rank_one" in "".join(traceback.format_tb(info.value.__traceback__))
    for fut in futures:  # rank 0 was stopped in its barrier: its future raises the root cause too
        with pytest.raises(ValueError, match="bad batch on rank 1"):
            fut.result()
    with pytest.raises(ValueError, match="bad batch on rank 1"):
        handler.process_results(str(tmp_path / "a"), futures)
    handler.process_results(str(tmp_path / "b"), futures, raise_errors=False)  # logs, returns
    for prefix in ("a", "b"):
        assert sorted(p.name for p in (tmp_path / prefix / "before").iterdir()) == ["0.txt", "1.txt"]
    assert leftover_processes(client) == []
    wait_until(lambda: not _verdicts(client), 10, interval=0.1, must=False)
    assert _verdicts(client) == [], "the verdict variable must be deleted once the futures read it"


def _verdicts(client):
    def names(dask_scheduler):
        return [n for n in dask_scheduler.extensions["variables"].variables if n.startswith("dask-ddp-verdict-")]
    return client.run_on_scheduler(names)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour of the nccl default")
@pytest.mark.slow
def test_default_backend_is_nccl_and_says_to_use_gloo_on_cpu(client):
    futures = dispatch.run(client, lambda: 1)
    with pytest.raises(dask_ddp.PlanError, match="backend='gloo'"):
        client.gather(futures)


# ---- the rest of 0.2.2's public names -------------------------------------------------------------------------

def rank_sum(scale, *, offset=0):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return {"sum": t.item() * scale + offset, "rank": os.environ["RANK"], "world": dist.get_world_size(),
            "backend": dist.get_backend()}


def with_agent_store(*args, **kwargs):
    """``dispatch_with_ddp`` with every rank a client of the test's store (bound on port 0, read back), as
    under torchrun's agent: the old API needs a port known in advance, and a test must not guess a free one."""
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    try:
        return dispatch.dispatch_with_ddp(*args, **kwargs)
    finally:
        del os.environ["TORCHELASTIC_USE_AGENT_STORE"]


def ddp_environment():
    return {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k in os.environ}, \
        dist.is_available() and dist.is_initialized()


@pytest.mark.slow
def test_dispatch_with_ddp_with_the_old_signature(client):
    from dask_ddp.compat.dispatch import dispatch_with_ddp  # the import path 0.2.2's README used

    assert list(inspect.signature(dispatch_with_ddp).parameters) == [
        "pytorch_function", "master_addr", "master_port", "rank", "world_size", "args", "backend", "kwargs"]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    workers = sorted(client.scheduler_info()["workers"])
    futures = [client.submit(with_agent_store, rank_sum, "127.0.0.1", store.port, rank, len(workers), 10,
                             backend="gloo", offset=1, workers=[w], pure=False) for rank, w in enumerate(workers)]
    out = client.gather(futures)
    assert [o["rank"] for o in out] == ["0", "1"] and {o["sum"] for o in out} == {11.0}
    assert all(o["world"] == 2 and o["backend"] == "gloo" for o in out)
    # as 0.2.2, it ran in the worker's own thread; unlike 0.2.2, it leaves no variable nor group behind
    assert list(client.run(ddp_environment).values()) == [({}, False), ({}, False)]


def nested_dispatch_with_ddp():
    return dispatch.dispatch_with_ddp(lambda: 1, "127.0.0.1", 1, 0, 1, backend="gloo")


@pytest.mark.slow
def test_dispatch_with_ddp_inside_a_run_says_what_to_do(client):
    with pytest.raises(RuntimeError, match="already initialised.*call the function itself"):
        client.gather(dispatch.run(client, nested_dispatch_with_ddp, backend="gloo"))


def test_s3_image_folder_keeps_the_attributes_of_0_2_2(s3_server):
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    bucket = f"compat-attrs-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    for name in ("pets/dog/1.png", "pets/cat/2.png", "pets/cat/1.png", "pets/cat/notes.txt", "pets/index.csv"):
        s3.put_object(Bucket=bucket, Key=name, Body=b"x")
    options = {"client_kwargs": {"endpoint_url": s3_server}}
    ds = S3ImageFolder(bucket, "pets/", storage_options=options)
    assert ds.all_files == ["pets/cat/1.png", "pets/cat/2.png", "pets/dog/1.png"]  # keys, in sample order
    assert [url for url, _ in ds.samples] == [f"s3://{bucket}/{key}" for key in ds.all_files]
    assert (ds.s3_bucket, ds.s3_prefix, ds.anon) == (bucket, "pets", False)
    assert "all_files" not in ds.__getstate__()  # derived, not shipped to DataLoader workers and ranks
    again = pickle.loads(pickle.dumps(ds))
    assert (again.all_files, again.s3_bucket, again.s3_prefix, again.anon) == (ds.all_files, bucket, "pets", False)
    anon = S3ImageFolder(f"/{bucket}/", "/pets", anon=True, storage_options=options, index=ds.index)
    assert (anon.s3_bucket, anon.s3_prefix, anon.anon) == (bucket, "pets", True)


def test_no_dask_pytorch_ddp_package_of_ours():
    """Imports change to ``dask_ddp.compat``: a ``dask_pytorch_ddp`` of ours would shadow the real one."""
    root = Path(__file__).resolve().parents[1]
    assert not (root / "dask_pytorch_ddp").exists()
    assert "dask_pytorch_ddp" not in (root / "pyproject.toml").read_text()


# ---- without a cluster -------------------------------------------------------------------------------------

def test_handler_keys_and_pickling():
    a, b = DaskResultsHandler(), DaskResultsHandler()
    assert a.pub_sub_key != b.pub_sub_key and len(a.pub_sub_key) == 32
    assert pickle.loads(pickle.dumps(DaskResultsHandler("k"))).pub_sub_key == "k"
    with pytest.raises(TypeError, match="takes a str"):
        DaskResultsHandler(3)


@pytest.mark.parametrize("path, data, error, match", [
    ("ok.txt", "x" * (64 * 1024 + 1), ValueError, "over the 64 KiB limit.*save_checkpoint"),
    ("ok.bin", bytes(200_000), ValueError, "195 KiB is over"),
    ("/etc/passwd", "x", ValueError, "relative path"),
    ("../up.txt", "x", ValueError, "without '..'"),
    ("dir/", "x", ValueError, "relative path"),
    ("", "x", ValueError, "relative path"),
    (3, "x", TypeError, "path=...\\) takes a str"),
    ("ok.json", {"loss": 1}, TypeError, "str or bytes, got dict.*json.dumps"),
])
def test_submit_result_checks_its_input(path, data, error, match):
    with pytest.raises(error, match=match):
        DaskResultsHandler("k").submit_result(path, data)


def test_submit_result_outside_a_rank():
    with pytest.raises(dask_ddp.NotInRankError, match="outside a dask-ddp rank"):
        DaskResultsHandler("k").submit_result("a.txt", "x")


def test_process_results_needs_futures_from_compat_run(client, tmp_path):
    fut = client.submit(lambda: 1)
    with pytest.raises(ValueError, match="not a future returned by dask_ddp.compat.dispatch.run"):
        DaskResultsHandler("k").process_results(str(tmp_path), [fut])
    DaskResultsHandler("k").process_results(str(tmp_path), [])  # nothing to wait for


def test_run_checks_its_input_on_the_client(client):
    with pytest.raises(TypeError, match="needs a callable"):
        dispatch.run(client, "train")
    with pytest.raises(dask_ddp.PlanError, match="unknown backend 'mpi'"):
        dispatch.run(client, lambda: 1, backend="mpi")

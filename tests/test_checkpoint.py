"""Checkpoints on local disk and on a real S3 endpoint (moto's server on loopback)."""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
import textwrap
import time

import fsspec
import numpy as np
import pytest
import torch

from dask_ddp import checkpoint as ck
from dask_ddp.client.cluster import scheduler_workers
from dask_ddp.rank.context import Context, set_context
from dask_ddp.wire.errors import NotInRankError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Opaque:
    """An arbitrary picklable object that weights_only=True must refuse."""

    def __init__(self, value=1):
        self.value = value


class Exploding:
    """Serialisation fails half-way through torch.save."""

    def __reduce__(self):
        raise RuntimeError("boom while pickling")


@pytest.fixture(params=["local", "memory", "s3"])
def store(request, tmp_path):
    """(directory URL, storage_options) on local disk, in fsspec's memory, or on the moto S3 server."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), None
    if request.param == "memory":
        return f"memory://{tmp_path.name}/ckpt", {}
    s3 = request.getfixturevalue("s3")
    return f"s3://{s3['bucket']}/run", s3["storage_options"]


@pytest.fixture
def as_rank():
    """Pretend to be a rank of a job: sets the context, resets it afterwards."""

    def enter(rank, world_size=2, **kw):
        set_context(Context(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size,
                            node_rank=0, num_nodes=1, device=torch.device("cpu"), device_ids=None,
                            backend="gloo", run_id="test", **kw))

    yield enter
    set_context(None)


def names(directory, opts):
    fs, root = fsspec.core.url_to_fs(directory, **(opts or {}))
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) if fs.exists(root) else []


def test_round_trip_latest_and_step(store):
    directory, opts = store
    for step in (9, 10, 100, 1_000_000_000):  # the last needs more than the 9 padded digits
        url = ck.save_checkpoint({"step": step, "w": torch.full((3,), float(step))}, step,
                                 directory=directory, storage_options=opts)
        assert url == f"{directory}/step-{step:09d}.pt"
    found = ck.list_checkpoints(directory, storage_options=opts)
    assert [c.step for c in found] == [9, 10, 100, 1_000_000_000]
    assert ck.latest_checkpoint(directory, storage_options=opts) == found[-1].url
    latest = ck.load_checkpoint(directory, storage_options=opts)
    assert latest["step"] == 1_000_000_000 and torch.equal(latest["w"], torch.full((3,), 1e9))
    assert ck.load_checkpoint(directory, step=10, storage_options=opts)["step"] == 10
    with pytest.raises(FileNotFoundError, match=r"step 11 .*complete steps: \[9, 10, 100"):
        ck.load_checkpoint(directory, step=11, storage_options=opts)


def test_empty_directory_gives_none(store):
    directory, opts = store
    assert ck.load_checkpoint(directory, storage_options=opts) is None
    assert ck.latest_checkpoint(directory, storage_options=opts) is None
    assert ck.list_checkpoints(directory, storage_options=opts) == []


def test_keep_prunes_to_newest_complete(store):
    directory, opts = store
    fs, root = fsspec.core.url_to_fs(directory, **(opts or {}))
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/step-000000001.pt", b"leftover of a crashed write, no marker")
    for step in range(2, 7):
        ck.save_checkpoint({"step": step}, step, directory=directory, keep=2, storage_options=opts)
    assert names(directory, opts) == ["step-000000005.done", "step-000000005.pt",
                                      "step-000000006.done", "step-000000006.pt"]
    assert ck.load_checkpoint(directory, storage_options=opts) == {"step": 6}


def test_failed_serialisation_keeps_previous(store):
    directory, opts = store
    ck.save_checkpoint({"step": 1}, 1, directory=directory, storage_options=opts)
    before = names(directory, opts)
    with pytest.raises(RuntimeError, match="boom while pickling"):
        ck.save_checkpoint({"step": 2, "bad": Exploding()}, 2, directory=directory, storage_options=opts)
    assert names(directory, opts) == before  # no payload, no marker, no temporary file
    assert ck.load_checkpoint(directory, storage_options=opts) == {"step": 1}


def test_payload_without_marker_is_ignored(store):
    directory, opts = store
    ck.save_checkpoint({"step": 1}, 1, directory=directory, storage_options=opts)
    fs, root = fsspec.core.url_to_fs(directory, **(opts or {}))
    fs.pipe_file(f"{root}/step-000000002.pt", b"PK\x03\x04 half a zip")
    assert [c.step for c in ck.list_checkpoints(directory, storage_options=opts)] == [1]
    assert ck.load_checkpoint(directory, storage_options=opts) == {"step": 1}


# A process that dies by SIGKILL in the middle of save_checkpoint: locally when the
# payload's temporary file is complete but not yet renamed, on S3 after the payload's
# PUT and before the marker's.
KILLER = textwrap.dedent("""
    import json, os, signal, sys
    import torch
    from dask_ddp import checkpoint as ck
    directory, opts = sys.argv[1], json.loads(sys.argv[2])
    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    if not directory.startswith("s3://"):
        os.replace = die
    else:
        import s3fs
        real = s3fs.S3FileSystem._pipe_file
        async def pipe_file(self, path, data, **kw):
            if path.endswith(".done"):
                die()
            return await real(self, path, data, **kw)
        s3fs.S3FileSystem._pipe_file = pipe_file
    ck.save_checkpoint({"w": torch.ones(1000)}, 2, directory=directory, storage_options=opts)
""")


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)  # memory:// lives in one process
@pytest.mark.slow
def test_killed_mid_write_keeps_previous(store):
    directory, opts = store
    ck.save_checkpoint({"step": 1}, 1, directory=directory, storage_options=opts)
    proc = subprocess.run([sys.executable, "-c", KILLER, directory, json.dumps(opts)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    left = names(directory, opts)
    assert "step-000000002.done" not in left
    assert any("000000002" in n for n in left)  # the crash really was half-way
    assert ck.load_checkpoint(directory, storage_options=opts) == {"step": 1}
    ck.save_checkpoint({"step": 3}, 3, directory=directory, keep=1, storage_options=opts)
    assert names(directory, opts) == ["step-000000003.done", "step-000000003.pt"]  # leftovers pruned


def test_marker_without_payload_says_what_to_do(tmp_path):
    ck.save_checkpoint({"step": 1}, 1, directory=str(tmp_path))
    os.unlink(tmp_path / "step-000000001.pt")
    with pytest.raises(FileNotFoundError, match=r"step-000000001\.pt is missing .*delete the marker"):
        ck.load_checkpoint(str(tmp_path))


def test_weights_only_refuses_arbitrary_objects(tmp_path):
    url = ck.save_checkpoint({"obj": Opaque(7)}, 1, directory=str(tmp_path))
    with pytest.raises(ck.CheckpointError) as info:
        ck.load_checkpoint(str(tmp_path))
    message = str(info.value)
    assert "Opaque" in message and "weights_only=False" in message and url in message
    assert info.value.url == url and any("Opaque" in g for g in info.value.unsafe_globals)
    assert pickle.loads(pickle.dumps(info.value)).url == url
    assert ck.load_checkpoint(str(tmp_path), weights_only=False)["obj"].value == 7


def test_corrupt_checkpoint_names_url_and_remedy(store):
    directory, opts = store
    fs, root = fsspec.core.url_to_fs(directory, **(opts or {}))
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/step-000000004.pt", b"PK\x03\x04 truncated")
    fs.pipe_file(f"{root}/step-000000004.done", b"{}")
    with pytest.raises(ck.CheckpointError, match=r"step-000000004\.pt.*delete it and its \.done marker"):
        ck.load_checkpoint(directory, storage_options=opts)


def draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_state_restores_identical_draws(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    ck.save_checkpoint({"rng": ck.rng_state()}, 1, directory=str(tmp_path))
    expected = [draws() for _ in range(3)]
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    ck.set_rng_state(ck.load_checkpoint(str(tmp_path))["rng"])  # weights_only=True load
    assert [draws() for _ in range(3)] == expected
    with pytest.raises(TypeError, match="rng_state"):
        ck.set_rng_state({"torch": torch.get_rng_state()})


def make_run():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched


def train_step(model, optim, sched):
    x = torch.randn(16, 4) + float(np.random.rand()) + random.random()
    loss = model(x).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    sched.step()


def test_resume_matches_uninterrupted_training_bitwise(tmp_path):
    model, optim, sched = make_run()
    random.seed(5), np.random.seed(5)
    for step in range(1, 4):
        train_step(model, optim, sched)
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
             "epoch": 3, "rng": ck.rng_state()}
    ck.save_checkpoint(state, 3, directory=str(tmp_path))
    for step in range(4, 8):
        train_step(model, optim, sched)

    resumed, optim2, sched2 = make_run()
    torch.manual_seed(123)  # a fresh process would start elsewhere
    loaded = ck.load_checkpoint(str(tmp_path))
    resumed.load_state_dict(loaded["model"]), optim2.load_state_dict(loaded["optim"])
    sched2.load_state_dict(loaded["sched"]), ck.set_rng_state(loaded["rng"])
    assert loaded["epoch"] == 3
    for step in range(4, 8):
        train_step(resumed, optim2, sched2)
    for a, b in zip(model.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)
    assert optim2.param_groups[0]["lr"] == optim.param_groups[0]["lr"] == 0.1 * 0.5**3


def test_only_rank_zero_writes(tmp_path, as_rank):
    as_rank(1, checkpoint_dir=str(tmp_path))
    assert ck.save_checkpoint({"step": 1}, 1) is None
    assert os.listdir(tmp_path) == []
    as_rank(0, checkpoint_dir=str(tmp_path))
    assert ck.save_checkpoint({"step": 1}, 1) == f"{tmp_path}/test/step-000000001.pt"  # the job's own folder
    as_rank(1, checkpoint_dir=str(tmp_path))
    assert ck.load_checkpoint() == {"step": 1}  # every rank reads


def test_all_ranks_names_and_completeness(tmp_path, as_rank):
    directory = str(tmp_path)
    as_rank(1, checkpoint_dir=directory)
    url = ck.save_checkpoint({"rank": 1}, 5, all_ranks=True)
    assert url == f"{directory}/test/step-000000005.rank-00001-of-00002.pt"
    assert ck.load_checkpoint(all_ranks=True) is None  # rank 0 has not written step 5 yet
    as_rank(0, checkpoint_dir=directory)
    ck.save_checkpoint({"rank": 0}, 5, all_ranks=True)
    assert ck.load_checkpoint(all_ranks=True) == {"rank": 0}
    as_rank(1, checkpoint_dir=directory)
    assert ck.load_checkpoint(all_ranks=True) == {"rank": 1}
    assert ck.load_checkpoint() is None  # shared and per-rank checkpoints do not mix
    for step in (6, 7):
        for rank in (0, 1):
            as_rank(rank, checkpoint_dir=directory)
            ck.save_checkpoint({"rank": rank, "step": step}, step, all_ranks=True, keep=1)
    assert [c.step for c in ck.list_checkpoints(all_ranks=True)] == [7]
    # each rank prunes its own files; rank 0 wrote step 7 before it was complete, so keeps 6 too
    assert sorted(n.rsplit(".", 1)[0] for n in os.listdir(tmp_path / "test") if n.endswith(".done")) == [
        "step-000000006.rank-00000-of-00002", "step-000000007.rank-00000-of-00002",
        "step-000000007.rank-00001-of-00002"]


def test_context_supplies_directory_and_storage_options(s3, as_rank):
    directory = f"s3://{s3['bucket']}/job"
    as_rank(0, checkpoint_dir=directory, checkpoint_options=s3["storage_options"])
    assert ck.save_checkpoint({"a": 1}, 1) == f"{directory}/test/step-000000001.pt"
    assert ck.load_checkpoint() == {"a": 1}


def test_missing_directory_is_a_clear_error(as_rank):
    with pytest.raises(NotInRankError, match="directory="):
        ck.save_checkpoint({}, 1)
    as_rank(0)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        ck.load_checkpoint()


@pytest.mark.parametrize("step, keep, error", [(-1, None, ValueError), (True, None, TypeError),
                                               ("3", None, TypeError), (1, 0, ValueError)])
def test_bad_arguments(tmp_path, step, keep, error):
    with pytest.raises(error, match="step|keep"):
        ck.save_checkpoint({}, step, directory=str(tmp_path), keep=keep)
    with pytest.raises(TypeError, match="dict"):
        ck.save_checkpoint([1], 1, directory=str(tmp_path))


def test_missing_credentials_raise_permission_error(s3, monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    opts = {"client_kwargs": {"endpoint_url": s3["endpoint"]}, "skip_instance_cache": True}
    directory = f"s3://{s3['bucket']}/run"
    with pytest.raises(PermissionError, match=f"{directory}.*storage_options"):
        ck.save_checkpoint({"a": 1}, 1, directory=directory, storage_options=opts)
    with pytest.raises(PermissionError, match=directory):
        ck.load_checkpoint(directory, storage_options=opts)


def test_credentials_never_reach_returned_urls_or_markers(s3):
    key, secret = "AKIAPLANTEDKEY123", "planted-secret-xyz"  # moto takes any key unless auth is enforced
    opts = {"client_kwargs": {"endpoint_url": s3["endpoint"]}}
    url = ck.save_checkpoint({"a": 1}, 1, directory=f"s3://{key}:{secret}@{s3['bucket']}/run", storage_options=opts)
    assert url == f"s3://{s3['bucket']}/run/step-000000001.pt"  # usable with storage options, no userinfo
    ck.save_checkpoint({"a": 2}, 2, directory=f"s3://{s3['bucket']}/run",
                       storage_options={**opts, "key": key, "secret": secret})
    fs, root = fsspec.core.url_to_fs(f"s3://{s3['bucket']}/run", **s3["storage_options"])
    fs.invalidate_cache()
    markers = [fs.cat_file(p).decode() for p in fs.ls(root, detail=False) if p.endswith(".done")]
    assert len(markers) == 2
    for text in markers:
        assert key not in text and secret not in text and "endpoint" not in text
        assert set(json.loads(text)) == {"format", "step", "file", "bytes", "rank", "world_size", "run_id", "time"}
    assert ck.load_checkpoint(f"s3://{s3['bucket']}/run", storage_options=s3["storage_options"]) == {"a": 2}


def test_prune_never_deletes_the_checkpoint_just_written(tmp_path, as_rank):
    as_rank(0, checkpoint_dir=str(tmp_path))
    for step in (10, 11):  # e.g. left by an attempt that got further than this one
        ck.save_checkpoint({"step": step}, step)
    url = ck.save_checkpoint({"step": 5}, 5, keep=1)
    assert os.path.exists(url), os.listdir(os.path.dirname(url))
    assert ck.load_checkpoint(step=5) == {"step": 5}
    assert [c.step for c in ck.list_checkpoints()] == [5, 11]  # 10 went: older than the newest kept
    url = ck.save_checkpoint({"step": 12}, 12, keep=1)
    assert [c.step for c in ck.list_checkpoints()] == [12] and os.path.exists(url)


def save_beside_another_job(tag, steps, sync_dir):
    """A rank of one of two jobs that share a name and a checkpoint_dir: saves ``steps`` with keep=2."""
    import dask_ddp

    open(os.path.join(sync_dir, tag), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(sync_dir)) < 2:  # both jobs are running: their saves interleave
        if time.monotonic() > deadline:
            raise TimeoutError("the other job never started")
        time.sleep(0.02)
    saved = []
    for step in steps:
        url = dask_ddp.save_checkpoint({"tag": tag, "step": step}, step, keep=2)
        saved.append((url, os.path.exists(url)))
        time.sleep(0.05)
    return {"saved": saved, "steps": [c.step for c in ck.list_checkpoints()], "loaded": dask_ddp.load_checkpoint(),
            "run_id": dask_ddp.get_context().run_id}


def resume_from(directory):
    import dask_ddp

    return {"previous": dask_ddp.load_checkpoint(directory), "own": dask_ddp.load_checkpoint()}


def fail_once_after_saving():
    import dask_ddp

    ctx = dask_ddp.get_context()
    if ctx.restart_count == 0:
        dask_ddp.save_checkpoint({"saved_by_attempt": 0}, 1, keep=1)
        raise RuntimeError("planned failure of the first attempt")
    return {"loaded": dask_ddp.load_checkpoint(), "run_id": ctx.run_id}


@pytest.mark.slow
def test_a_restart_resumes_from_its_own_jobs_folder(client, tmp_path):
    from _cluster import run

    job = run(client, fail_once_after_saving, workers=1, max_restarts=1, checkpoint_dir=str(tmp_path))
    assert job.result(timeout=120)[0] == {"loaded": {"saved_by_attempt": 0}, "run_id": job.run_id}
    assert os.listdir(tmp_path) == [job.run_id]


@pytest.mark.slow
def test_two_jobs_sharing_name_and_checkpoint_dir_stay_apart(client, tmp_path):
    from _cluster import leftover_processes, run

    ckdir, sync = str(tmp_path / "ckpt"), tmp_path / "sync"
    sync.mkdir()
    first, second = sorted(scheduler_workers(client))
    steps = {"a": [1, 2, 3, 4, 5], "b": [3, 4, 5, 6, 7]}
    jobs = {tag: run(client, save_beside_another_job, tag, steps[tag], str(sync), workers=[where], name="same-name",
                     checkpoint_dir=ckdir) for tag, where in (("a", first), ("b", second))}
    results = {tag: job.result(timeout=120)[0] for tag, job in jobs.items()}
    for tag, got in results.items():
        assert all(existed for _, existed in got["saved"]), got["saved"]  # never a URL of a file it deleted
        assert got["loaded"] == {"tag": tag, "step": steps[tag][-1]}
        assert got["steps"] == steps[tag][-2:]  # keep=2 counted this job's steps only
        assert got["run_id"] == jobs[tag].run_id and got["run_id"].startswith("same-name-")
        assert all(url.startswith(f"{ckdir}/{got['run_id']}/") for url, _ in got["saved"])
    assert sorted(os.listdir(ckdir)) == sorted(job.run_id for job in jobs.values())
    # a previous job is resumed by its folder: job.checkpoint_dir (or f"{checkpoint_dir}/{run_id}")
    assert jobs["a"].checkpoint_dir == f"{ckdir}/{jobs['a'].run_id}"
    assert ck.load_checkpoint(jobs["a"].checkpoint_dir) == {"tag": "a", "step": 5}
    later = run(client, resume_from, jobs["b"].checkpoint_dir, workers=1, name="same-name", checkpoint_dir=ckdir)
    assert later.result(timeout=120)[0] == {"previous": {"tag": "b", "step": 7}, "own": None}
    assert leftover_processes(client) == []

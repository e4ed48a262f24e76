"""A sharded checkpoint is data, not code: planted pickles are refused on every load path, forged markers skipped.

Whoever can write a checkpoint folder (a shared bucket, a checkpoint handed over for ``dask-ddp export``) can
replace a non-tensor item and its CRC-32 (it lives in ``.metadata``, which they write too). Each test here plants
such an item in a real saved checkpoint: a ``torch.save`` pickle whose ``__reduce__`` creates a marker file when
it is unpickled, the item's offset, length and CRC-32 updated in ``.metadata``. Every load path must refuse it
with a ShardError naming the rank, the URL and the key, and the marker file must never appear: ``load_sharded``
in a 2-rank gloo group, an elastic reshard (saved at 2 ranks, loaded at 3), ``read_sharded`` and
``export_sharded`` in one process, and the ``dask-ddp export`` command. A forged or stale commit marker of a newer
step is skipped (with a warning) by an automatic resume, which loads the newest step that checks out.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch
import torch._dynamo  # noqa: F401 - imported once here, not in every forked rank (fully_shard needs it)
import torch.distributed.checkpoint.state_dict  # noqa: F401
import torch.distributed.fsdp  # noqa: F401

import dask_ddp
from dask_ddp.checkpoint import CheckpointError, export_sharded, list_sharded, read_sharded
from dask_ddp.checkpoint.sharded.writer import ShardError

sys.path.insert(0, os.path.dirname(__file__))
from sharded_ranks import run_ranks  # noqa: E402


class _Payload:
    """Unpickled, it opens (creates) ``path`` for writing: the stand-in for any code a pickle can run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _hostile(marker: str) -> bytes:
    torch.save(_Payload(marker), buffer := io.BytesIO())
    return buffer.getvalue()


def _folder(directory: str, step: int) -> str:
    (found,) = [s for s in list_sharded(directory) if s.step == step]
    return os.path.join(directory, "sharded", found.folder)


def plant(directory: str, step: int, key: str, raw: bytes) -> str:
    """Append ``raw`` to the shard file of item ``key`` of ``step`` and point ``.metadata`` at it (offset, length,
    CRC-32), as whoever can write the folder can; return the step's folder."""
    folder = _folder(directory, step)
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as f:
        metadata = torch.load(f, weights_only=False)  # our own file, written by the test's save
    (index,) = [i for i in metadata.storage_data if i.fqn == key]
    name, _, _, dtype, shape, _ = metadata.storage_data[index]
    assert dtype is None, f"{key} is a tensor item, not a pickled value"
    shard = os.path.join(folder, name)
    offset = os.path.getsize(shard)
    with open(shard, "ab") as f:
        f.write(raw)
    metadata.storage_data[index] = (name, offset, len(raw), dtype, shape, zlib.crc32(raw))
    _write_metadata(path, metadata)
    return folder


def _write_metadata(path: str, metadata) -> None:
    torch.save(metadata, buffer := io.BytesIO())  # torch.save takes no file named ".metadata" by path
    with open(path, "wb") as f:
        f.write(buffer.getvalue())


def attempt(fn) -> BaseException | None:
    """What ``fn()`` raised (None: nothing): the marker is checked first, whatever the call did."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - examined by the test
        return exc
    return None


def assert_refused(text: str, key: str, folder: str) -> None:
    assert f"item {key!r} holds objects that torch.load(weights_only=True) refuses to load: 'io.open'" in text, text
    assert "nothing in it ran" in text, text
    assert os.path.basename(folder) in text and "Load another step (step=...; dask-ddp export: --step N)" in text, text
    assert "rank 0" in text or "rank 1" in text or "rank 2" in text, text


# ---- load_sharded at 2 ranks, and an elastic reshard saved at 2 and loaded at 3 ---------------------------------

def _build(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 4))


def _save(rank, world, directory, kind):
    from torch.nn.parallel import DistributedDataParallel

    model = dask_ddp.shard_model(_build()) if kind == "fsdp" else DistributedDataParallel(_build())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    for step in (1, 2):
        dask_ddp.save_sharded({"model": model, "optim": opt, "epoch": 5}, step, directory=directory)


def _load(rank, world, directory, kind, step):
    from torch.nn.parallel import DistributedDataParallel

    model = dask_ddp.shard_model(_build(7)) if kind == "fsdp" else DistributedDataParallel(_build(7))
    state = {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=0.5), "epoch": 0}
    try:
        loaded = dask_ddp.load_sharded(state, directory=directory, step=step)
    except ShardError as exc:
        return "refused", str(exc)
    except Exception as exc:  # noqa: BLE001 - examined by the test (after the marker)
        return "failed", f"{type(exc).__name__}: {exc}"
    return "loaded", (loaded, repr(state["epoch"]), repr(state["optim"].param_groups[0]["lr"]))  # a file object
    # (what the planted pickle returns) would not travel back from the rank


def test_load_sharded_at_two_ranks_refuses_a_planted_optimizer_item_and_runs_nothing(tmp_path):
    directory, marker = str(tmp_path / "ckpt"), str(tmp_path / "ran")
    run_ranks(2, _save, directory, "ddp")
    folder = plant(directory, 2, "optim.param_groups.0.lr", _hostile(marker))
    got = run_ranks(2, _load, directory, "ddp", None)  # what a restart does: the newest step
    assert not os.path.exists(marker), "the planted pickle ran in a loading rank"
    assert [kind for kind, _ in got] == ["refused", "refused"], got
    for _, text in got:
        assert_refused(text, "optim.param_groups.0.lr", folder)
    assert run_ranks(2, _load, directory, "ddp", 1) == [("loaded", (1, "5", "0.01"))] * 2  # the clean step loads


def test_an_elastic_reshard_saved_at_two_loaded_at_three_refuses_a_planted_value(tmp_path):
    directory, marker = str(tmp_path / "ckpt"), str(tmp_path / "ran")
    run_ranks(2, _save, directory, "fsdp")
    folder = plant(directory, 2, "epoch", _hostile(marker))
    got = run_ranks(3, _load, directory, "fsdp", None)
    assert not os.path.exists(marker), "the planted pickle ran in a loading rank"
    assert [kind for kind, _ in got] == ["refused"] * 3, got
    for _, text in got:
        assert_refused(text, "epoch", folder)
    assert run_ranks(3, _load, directory, "fsdp", 1) == [("loaded", (1, "5", "0.01"))] * 3


# ---- one process: read_sharded, export_sharded, dask-ddp export ---------------------------------------------

@pytest.fixture
def planted(tmp_path):
    """A checkpoint whose newest step (2) has a planted ``epoch``; (directory, marker path, step folder)."""
    directory, marker = str(tmp_path / "ckpt"), str(tmp_path / "ran")
    model = _build()
    for step in (1, 2):
        dask_ddp.save_sharded({"model": model, "epoch": step}, step, directory=directory)
    return directory, marker, plant(directory, 2, "epoch", _hostile(marker))


def test_read_sharded_refuses_a_planted_value(planted):
    directory, marker, folder = planted
    err = attempt(lambda: read_sharded(directory))
    assert not os.path.exists(marker), "read_sharded ran the planted pickle"
    assert isinstance(err, ShardError), repr(err)
    assert_refused(str(err), "epoch", folder)
    text = str(err)
    assert text.startswith("rank 0: ") and ("'io.open'" in text or "'builtins.open'" in text), text
    assert read_sharded(directory, step=1)[1]["epoch"] == 1


def test_export_sharded_refuses_a_planted_value_and_writes_nothing(planted, tmp_path):
    directory, marker, folder = planted
    err = attempt(lambda: export_sharded(directory, str(tmp_path / "out.pt")))
    assert not os.path.exists(marker), "export_sharded ran the planted pickle"
    assert isinstance(err, ShardError), repr(err)
    assert_refused(str(err), "epoch", folder)
    assert not (tmp_path / "out.pt").exists()


def test_the_export_command_exits_1_naming_the_planted_item(planted, tmp_path):
    directory, marker, folder = planted
    out = subprocess.run([sys.executable, "-m", "dask_ddp.cli", "export", directory, str(tmp_path / "out.pt")],
                         capture_output=True, text=True, timeout=300)
    assert not os.path.exists(marker), "dask-ddp export ran the planted pickle"
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr[-3000:])
    assert "dask-ddp export: ShardError: rank 0: " in out.stderr, out.stderr[-3000:]
    assert_refused(out.stderr, "epoch", folder)
    assert not (tmp_path / "out.pt").exists()


# ---- the write side, and the reader's own guard ------------------------------------------------------------

def test_a_value_weights_only_cannot_read_back_is_refused_at_save_and_nothing_is_committed(tmp_path):
    with pytest.raises(TypeError) as err:
        dask_ddp.save_sharded({"model": _build(), "best": np.float64(0.25)}, 1, directory=str(tmp_path))
    text = str(err.value)
    assert "rank 0: the value at 'best'" in text and "weights_only=True" in text and ".item()" in text, text
    assert "add_safe_globals" in text and "Nothing of this step is committed" in text, text
    assert list_sharded(str(tmp_path)) == []
    assert dask_ddp.save_sharded({"model": _build(), "best": np.float64(1)}, 1, directory=str(tmp_path),
                                 async_save=True) is None  # float64: a float, staged
    with pytest.raises(TypeError, match="rank 0: the value at 'best'"):  # an async save: raised by the next call
        dask_ddp.wait_sharded()
    assert list_sharded(str(tmp_path)) == []
    dask_ddp.save_sharded({"model": _build(), "best": 0.25, "rng": dask_ddp.rng_state()}, 1, directory=str(tmp_path))
    assert read_sharded(str(tmp_path))[1]["best"] == 0.25


def test_the_reader_refuses_a_planner_that_would_unpickle_unsafely(tmp_path):
    """torch's own planner unpickles with weights_only=False: the reader hands values only to ours."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from dask_ddp.checkpoint import folder as checkpoint_folder
    from dask_ddp.checkpoint.sharded import folder as sharded_folder
    from dask_ddp.checkpoint.sharded import reader as dcp_reader
    from dask_ddp.checkpoint.sharded import state as sharded_state

    dask_ddp.save_sharded({"model": _build(), "epoch": 3}, 1, directory=str(tmp_path))
    where = checkpoint_folder.where(str(tmp_path), None)
    found = sharded_folder.committed(where)[1]
    reader = dcp_reader.ShardReader(where.fs, f"{sharded_folder.base(where)[0]}/{found.folder}", found.url,
                                    sharded_folder.read_metadata(where, found))
    with pytest.raises(TypeError, match="weights_only=False, which can run code") as err:
        sharded_state.run_dcp(lambda: _load_state_dict({}, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(),
                                                       no_dist=True), "reading", 1)
    assert "dask_ddp.checkpoint.sharded.values" in str(err.value)


# ---- finding 11: a forged or stale commit marker of a newer step ------------------------------------------

@pytest.fixture
def three_steps(tmp_path):
    directory = str(tmp_path / "ckpt")
    model = _build()
    for step in (1, 2, 3):
        dask_ddp.save_sharded({"model": model, "epoch": step}, step, directory=directory)
    return directory


def _resume(directory, step=None):
    state = {"model": _build(9), "epoch": -1}
    return dask_ddp.load_sharded(state, directory=directory, step=step), state["epoch"]


def _skips(caplog, step) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"sharded step {step} " in r.getMessage()
            and "is skipped" in r.getMessage()]


@pytest.fixture
def caplog_ddp(caplog):
    caplog.set_level(logging.WARNING, logger="dask_ddp.checkpoint.sharded.folder")
    return caplog


def test_a_forged_marker_of_a_newer_step_is_skipped_with_a_warning(three_steps, caplog_ddp):
    root = os.path.join(three_steps, "sharded")
    with open(os.path.join(root, "step-000000099-deadbeef.commit"), "w") as f:
        f.write("{}")
    assert _resume(three_steps) == (3, 3)
    (text,) = _skips(caplog_ddp, 99)
    assert "step-000000099-deadbeef" in text and "does not name its own step and folder" in text, text
    assert read_sharded(three_steps)[0] == 3 and len(_skips(caplog_ddp, 99)) == 2
    with pytest.raises(CheckpointError, match="does not name its own step and folder"):
        _resume(three_steps, step=99)  # asked for by number: an error, not a fallback


def test_a_folder_holding_only_a_forged_marker_resumes_from_nothing(tmp_path, caplog_ddp):
    os.makedirs(tmp_path / "sharded")
    (tmp_path / "sharded" / "step-000000007-deadbeef.commit").write_text('{"step": 7}')
    assert _resume(str(tmp_path)) == (None, -1)  # as a folder with no step: the job starts from the beginning
    assert len(_skips(caplog_ddp, 7)) == 1
    with pytest.raises(FileNotFoundError, match="none that checks out"):
        read_sharded(str(tmp_path))


def test_a_marker_copied_onto_a_newer_step_or_left_by_a_deleted_folder_is_skipped(three_steps, caplog_ddp):
    root = os.path.join(three_steps, "sharded")
    newest = os.path.basename(_folder(three_steps, 3))
    copy = "step-000000050-0badc0de"  # a real step's folder and marker copied under a newer number
    shutil.copytree(os.path.join(root, newest), os.path.join(root, copy))
    shutil.copy(os.path.join(root, f"{newest}.commit"), os.path.join(root, f"{copy}.commit"))
    shutil.rmtree(os.path.join(root, newest))  # step 3's folder deleted by hand: its marker is stale
    assert _resume(three_steps) == (2, 2)
    assert "does not name its own step" in _skips(caplog_ddp, 50)[0]
    assert ".metadata is missing" in _skips(caplog_ddp, 3)[0]
    with pytest.raises(CheckpointError, match="is missing although step 3 is committed"):
        _resume(three_steps, step=3)


def test_metadata_naming_a_file_outside_its_folder_is_skipped(three_steps, caplog_ddp):
    folder = _folder(three_steps, 3)
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as f:
        metadata = torch.load(f, weights_only=False)
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = ("../../../elsewhere", *metadata.storage_data[index][1:])
    _write_metadata(path, metadata)
    assert _resume(three_steps) == (2, 2)
    assert "not shards of the folder" in _skips(caplog_ddp, 3)[0]


def _forged_in_ranks(rank, world, directory):
    return _resume(directory)


def test_every_rank_of_a_job_falls_back_together(three_steps):
    with open(os.path.join(three_steps, "sharded", "step-000000099-deadbeef.commit"), "w") as f:
        json.dump({"step": 99, "folder": "step-000000099-deadbeef"}, f)  # a well-formed marker, no folder
    assert run_ranks(2, _forged_in_ranks, three_steps) == [(3, 3), (3, 3)]

"""Sharded checkpoints (save_sharded / load_sharded): round trips, errors, pruning, resharding, FSDP2 and export.

Multi-rank cases run real gloo process groups of forked processes (tests/sharded_ranks.py), each a few
seconds; one process group per world size.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch._dynamo  # noqa: F401 - imported once here, not in every forked rank (fully_shard needs it: ~2 s)
import torch.distributed.checkpoint.state_dict  # noqa: F401
import torch.distributed.fsdp  # noqa: F401

import dask_ddp  # noqa: E402
from dask_ddp.checkpoint import CheckpointError, export_sharded, list_sharded  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from sharded_ranks import run_ranks  # noqa: E402


def build(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(3)], torch.nn.Linear(6, 5))


def trained(model, steps=2, seed=1):
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 6, generator=gen)).square().mean().backward()
        opt.step()
    return opt


def full(model, opt):
    """The full (unsharded) model and optimizer state on CPU; collective for sharded models."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, [opt], options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def assert_same(a, b, path="state"):
    """Bitwise equality of nested dicts / lists / tensors / values, naming the first difference."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{path} differs"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


# ---- one process -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.filterwarnings("ignore:Detected call of")
def test_round_trip_in_one_process(tmp_path, where, request):
    if where == "s3":
        s3 = request.getfixturevalue("s3")
        directory, opts = f"s3://{s3['bucket']}/ckpt", s3["storage_options"]
    else:
        directory, opts = str(tmp_path), None
    model = build()
    opt = trained(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    sched.step()
    empty = {"model": build(5)}
    assert dask_ddp.load_sharded(empty, directory=directory, storage_options=opts) is None
    url = dask_ddp.save_sharded({"model": model, "optim": opt, "sched": sched, "epoch": 3, "tag": "a"}, 7,
                                directory=directory, storage_options=opts)
    assert url.endswith(list_sharded(directory, storage_options=opts)[0].folder)
    other = build(5)
    other_opt = trained(other, seed=9)
    other_sched = torch.optim.lr_scheduler.StepLR(other_opt, 1, gamma=0.5)
    state = {"model": other, "optim": other_opt, "sched": other_sched, "epoch": 0, "tag": ""}
    assert dask_ddp.load_sharded(state, directory=directory, storage_options=opts) == 7
    assert_same(full(model, opt), full(other, other_opt))
    assert (state["epoch"], state["tag"], other_sched.last_epoch) == (3, "a", 1)


class Wrapped:
    """A Stateful holding a model and its optimizer (as a user might for a second model)."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optim"])


def test_a_stateful_gets_what_was_saved_even_where_the_fresh_object_has_no_such_keys(tmp_path):
    """A fresh optimizer has no momentum buffers yet: they load all the same (DCP alone would skip them)."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    dask_ddp.save_sharded({"second": Wrapped(model, opt), "step": 4}, 4, directory=str(tmp_path))
    fresh = build(3)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    state = {"second": Wrapped(fresh, fresh_opt), "step": -1}
    assert dask_ddp.load_sharded(state, directory=str(tmp_path)) == 4 and state["step"] == 4
    assert_same(opt.state_dict(), fresh_opt.state_dict())
    assert_same(model.state_dict(), fresh.state_dict())


def test_bad_input_names_what_to_do(tmp_path, s3):
    model = build()
    opt = trained(model)
    dask_ddp.save_sharded({"model": model, "optim": opt}, 1, directory=str(tmp_path))
    with pytest.raises(FileExistsError, match="step 1 is committed already"):
        dask_ddp.save_sharded({"model": model, "optim": opt}, 1, directory=str(tmp_path))
    wider = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Linear(7, 6), torch.nn.Linear(6, 6),
                                torch.nn.Linear(6, 5), torch.nn.Linear(5, 5))
    with pytest.raises(CheckpointError) as err:
        dask_ddp.load_sharded({"model": wider}, directory=str(tmp_path))
    text = str(err.value)
    assert "missing from the checkpoint (2): model.4.bias, model.4.weight" in text
    assert "model.0.weight: checkpoint [6, 6], here [7, 6]" in text
    narrower = torch.nn.Sequential(torch.nn.Linear(6, 6))
    with pytest.raises(CheckpointError, match=r"in the checkpoint only \(6\): model.1.bias"):
        dask_ddp.load_sharded({"model": narrower}, directory=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"no committed sharded step 5 .*committed: \[1\]"):
        dask_ddp.load_sharded({"model": build()}, directory=str(tmp_path), step=5)
    with pytest.raises(ValueError, match="at most one optimizer"):
        dask_ddp.save_sharded({"model": model, "a": opt, "b": torch.optim.SGD(model.parameters(), lr=1)}, 2,
                              directory=str(tmp_path))
    with pytest.raises(TypeError, match="takes a dict"):
        dask_ddp.save_sharded([model], 2, directory=str(tmp_path))
    missing_bucket = f"s3://no-such-bucket-{os.getpid()}/ckpt"
    with pytest.raises((FileNotFoundError, PermissionError)) as err:
        dask_ddp.save_sharded({"model": model}, 2, directory=missing_bucket, storage_options=s3["storage_options"])
    assert "no-such-bucket" in str(err.value) and "testing" not in str(err.value)


def test_keep_prunes_old_steps_but_never_a_leased_one(tmp_path):
    from dask_ddp.checkpoint import folder as checkpoint_folder
    from dask_ddp.checkpoint.sharded import folder as sharded_folder

    model = build()
    dask_ddp.save_sharded({"model": model}, 1, directory=str(tmp_path))
    where = checkpoint_folder.where(str(tmp_path), None)
    with sharded_folder.lease(where, sharded_folder.committed(where)[1]):  # a reader holds step 1
        for step in (2, 3, 4):
            dask_ddp.save_sharded({"model": model}, step, directory=str(tmp_path), keep=2)
        assert [s.step for s in list_sharded(str(tmp_path))] == [1, 3, 4]
    dask_ddp.save_sharded({"model": model}, 5, directory=str(tmp_path), keep=2)
    assert [s.step for s in list_sharded(str(tmp_path))] == [4, 5]
    assert sorted(os.listdir(tmp_path / "sharded")) == sorted(
        [s.folder for s in list_sharded(str(tmp_path))] + [s.folder + ".commit" for s in list_sharded(str(tmp_path))])


# ---- several ranks ------------------------------------------------------------------------------------------

def _model(kind: str, seed: int = 0):
    from torch.nn.parallel import DistributedDataParallel

    model = build(seed)
    return dask_ddp.shard_model(model) if kind == "fsdp" else DistributedDataParallel(model)


def _save_both(rank, world, root):
    """Train an FSDP2 and a DDP model (different data per rank) and save each sharded; return their full states."""
    out = {}
    for kind in ("fsdp", "ddp"):
        model = _model(kind)
        opt = trained(model, seed=1 + rank)
        dask_ddp.save_sharded({"model": model, "optim": opt, "epoch": 4}, 10, directory=f"{root}/{kind}")
        out[kind] = full(model, opt)
    return out if rank == 0 else None


def _load_all(rank, world, root, export_to):
    """Load each saved kind into each model kind at this world size; return the full states (rank 0)."""
    out = {}
    for saved in ("fsdp", "ddp"):
        for kind in ("fsdp", "ddp"):
            model = _model(kind, seed=7)
            opt = trained(model, steps=1, seed=50 + rank)
            state = {"model": model, "optim": opt, "epoch": 0}
            step = dask_ddp.load_sharded(state, directory=f"{root}/{saved}")
            out[saved, kind] = (step, state["epoch"], full(model, opt))
    if rank == 0 and export_to:
        for saved in ("fsdp", "ddp"):
            export_sharded(f"{root}/{saved}", f"{export_to}/{saved}.pt")
            export_sharded(f"{root}/{saved}", f"{export_to}/{saved}.safetensors", format="safetensors")
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded4")
    return str(root), run_ranks(4, _save_both, str(root))[0]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
def test_reshard_matrix_saved_at_4_loads_bitwise(saved_at_4, world, tmp_path):
    """FSDP2 and DDP steps saved at 4 ranks load at 1, 2, 3, 4 and 6 ranks into FSDP2 and DDP models: model and
    optimizer state bitwise equal to the saved full state; exported files (at 3 ranks) equal it too."""
    root, reference = saved_at_4
    export_to = str(tmp_path) if world == 3 else None
    loaded = run_ranks(world, _load_all, root, export_to)[0]
    for (saved, kind), (step, epoch, state) in loaded.items():
        assert (step, epoch) == (10, 4), (saved, kind)
        assert_same(reference[saved], state, f"{saved}->{kind}@{world}")
    if export_to:
        from safetensors.torch import load_file

        for saved in ("fsdp", "ddp"):
            whole = torch.load(f"{export_to}/{saved}.pt", weights_only=True)
            assert_same(reference[saved][0], whole["model"], f"export of {saved}: model")
            assert_same(reference[saved][1], whole["optim"], f"export of {saved}: optimizer")
            assert whole["epoch"] == 4
            flat = load_file(f"{export_to}/{saved}.safetensors")
            for key, value in reference[saved][0].items():
                assert torch.equal(flat[f"model.{key}"], value), key


def _fsdp_vs_reference(rank, world, hsdp):
    """Train FSDP2 (or HSDP in groups of 2) on this rank's slice of each global batch; return the full params."""
    model = build()
    mesh = dask_ddp.device_mesh(hsdp=True, shard_size=2) if hsdp else None
    dask_ddp.shard_model(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        batch = torch.randn(12, 6, generator=gen)
        opt.zero_grad()
        model(batch.chunk(world)[rank]).square().mean().backward()
        opt.step()
    return full(model, opt)[0] if rank == 0 else full(model, opt) and None


@pytest.mark.parametrize("world,hsdp", [(2, False), (3, False), (4, True)])
def test_fsdp2_trains_to_the_parameters_of_one_process(world, hsdp):
    """FSDP2 on 2 and 3 CPU ranks (gloo), and HSDP on 4 (2 shard groups of 2), end at the parameters of one
    process training on the whole batches, within 1e-5 (float32 sums in another order)."""
    got = run_ranks(world, _fsdp_vs_reference, hsdp)[0]
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        batch = torch.randn(12, 6, generator=gen)
        opt.zero_grad()
        torch.stack([model(part).square().mean() for part in batch.chunk(world)]).mean().backward()
        opt.step()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=f"{key} after 4 steps")


def _sharded_on_rank_zero_only(rank, world, directory):
    mesh = dask_ddp.device_mesh()
    model = build()
    if rank == 0:
        dask_ddp.shard_model(model, mesh=mesh)
    try:
        dask_ddp.save_sharded({"model": model}, 1, directory=directory)
    except ValueError as exc:
        return str(exc)
    return "saved"


def test_a_state_sharded_on_some_ranks_only_is_refused_on_every_rank_naming_the_key(tmp_path):
    texts = run_ranks(2, _sharded_on_rank_zero_only, str(tmp_path))
    assert texts[0] == texts[1], texts
    assert "the ranks disagree on 'model.0.bias'" in texts[0] and "rank 0: sharded (DTensor) of shape [6]" in \
        texts[0] and "rank 1: plain tensor of shape [6]" in texts[0], texts[0]
    assert list_sharded(str(tmp_path)) == []


def test_the_export_verb_writes_one_file_and_names_what_is_wrong(tmp_path, capsys):
    from safetensors.torch import load_file

    from dask_ddp.cli import main

    model = build()
    dask_ddp.save_sharded({"model": model, "epoch": 2}, 3, directory=str(tmp_path / "ckpt"))
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors")]) == 0
    assert "step 3 of" in capsys.readouterr().out
    flat = load_file(str(tmp_path / "m.safetensors"))
    assert_same({f"model.{k}": v for k, v in model.state_dict().items()}, flat)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "m.pt"), "--step", "3"]) == 0
    assert torch.load(tmp_path / "m.pt", weights_only=True)["epoch"] == 2
    assert main(["export", str(tmp_path / "empty"), str(tmp_path / "x.pt")]) == 1
    assert "FileNotFoundError: no committed sharded step" in capsys.readouterr().err


def _fill(rank, world):
    t = torch.empty(20_000_000)
    t.fill_(float(rank))  # large enough for torch to split it over its intra-op threads
    return float(t[-1])


def test_forked_ranks_survive_an_openmp_team_in_the_test_process():
    """The test process ran a parallel op (as an earlier test in an xdist worker may): GNU OpenMP's team does not
    survive fork, and without ``set_num_threads(1)`` in ``run_ranks``'s children their first parallel op waits
    forever (seen as 3 sharded-chaos tests hanging in FSDP's ``new_zeros`` when tests were spread by test)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(20_000_000).fill_(2.0)  # the team now exists in this process
        assert run_ranks(2, _fill, timeout=60) == [0.0, 1.0]
    finally:
        torch.set_num_threads(before)

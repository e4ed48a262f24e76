"""The classic DDP idioms of ``examples/idiom_*.py`` (and the docs' idiom pages), each run as a real 2-rank job on
a LocalCluster with gloo, and each checked for what the idiom is for (not just that it ran)."""

from __future__ import annotations

import pytest
from test_examples import load_example


@pytest.mark.slow
def test_mixed_precision_on_cpu_forwards_in_bfloat16_and_keeps_float32_parameters(client):
    results = load_example("idiom_mixed_precision").main(["--steps", "40"], client=client)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["device"] == "cpu" and r["autocast_dtype"] == "torch.bfloat16", r
        assert r["param_dtype"] == r["grad_dtype"] == "torch.float32", r
        assert r["last_loss"] < 0.5 * r["first_loss"], r  # it learns
    assert results[0]["checksum"] == results[1]["checksum"]  # DDP kept the replicas equal


@pytest.mark.gpu
def test_mixed_precision_on_gpu_uses_float16_with_a_grad_scaler(client):
    results = load_example("idiom_mixed_precision").main(["--steps", "40"], client=client)
    for r in results:
        assert r["device"].startswith("cuda") and r["autocast_dtype"] == "torch.float16", r
        assert r["param_dtype"] == r["grad_dtype"] == "torch.float32", r
        assert r["last_loss"] < 0.5 * r["first_loss"], r


def test_gradient_accumulation_all_reduces_once_a_step_and_matches_one_big_batch(client):
    import torch

    example = load_example("idiom_gradient_accumulation")
    micro, steps = 4, 5
    results = example.main(["--micro-batches", str(micro), "--steps", str(steps)], client=client)
    assert [r["all_reduces"] for r in results] == [steps, steps], "no_sync(): one all-reduce per step"
    assert results[0]["params"] == results[1]["params"]
    # the same steps in one process, each on every rank's micro-batches at once
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [example.batches(rank, steps, micro) for rank in (0, 1)]
    for step in range(steps):
        x = torch.cat([x for rank in (0, 1) for x, _ in data[rank][step]])
        y = torch.cat([y for rank in (0, 1) for _, y in data[rank][step]])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    expected = [p.detach().flatten().tolist() for p in model.parameters()]
    for got, want in zip(results[0]["params"], expected):
        assert got == pytest.approx(want, abs=1e-5)


def test_rank_zero_first_downloads_once_and_the_others_reuse_it(client, tmp_path):
    results = load_example("idiom_rank_zero_first").main([str(tmp_path / "cache")], client=client)
    assert [(r["rank"], r["downloaded"], r["samples"]) for r in results] == [(0, True, 100), (1, False, 100)]


def test_seeding_gives_each_rank_its_own_stream_the_same_model_and_repeats(client):
    example = load_example("idiom_seeding")
    first = example.main(["--seed", "7"], client=client)
    again = example.main(["--seed", "7"], client=client)
    other = example.main(["--seed", "8"], client=client)
    assert first == again, "the same seed repeats every draw"
    assert [r["seed"] for r in first] == [7, 8]
    assert first[0]["initial"] == first[1]["initial"], "DDP gives every rank rank 0's parameters"
    for kind in ("torch", "numpy", "python"):
        assert first[0][kind] != first[1][kind], f"{kind}: each rank draws its own numbers"
        assert first[0][kind] != other[0][kind]


def test_all_reduce_mean_gives_every_rank_the_mean_of_the_ranks_values(client):
    results = load_example("idiom_all_reduce_mean").main(["--samples", "1000"], client=client)
    locals_ = [r["local"] for r in results]
    assert locals_[0] != locals_[1]
    for r in results:
        assert r["val_loss"] == pytest.approx(sum(locals_) / 2, rel=1e-12)
    whole = sum((i / 1000) ** 2 for i in range(1000)) / 1000
    assert results[0]["val_loss"] == pytest.approx(whole, rel=1e-12)  # equal shards: the whole set's mean

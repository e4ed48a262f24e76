"""``dask-ddp demo``, the README's first command: end to end as a subprocess, and its parts."""

from __future__ import annotations

import csv
import pathlib
import re

import pytest
from test_cli import run_cli


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_end_to_end(tmp_path):
    import dask_ddp

    out_dir = tmp_path / "out"
    out = run_cli("demo", "--out", out_dir, timeout=560)  # about a minute on an idle 2-core machine
    assert out.returncode == 0, out.stderr[-5000:]
    text = out.stdout
    assert re.search(r"embedded S3 server \(moto\) at http://127\.0\.0\.1:\d+", text)
    assert "uploaded 1797 digit images" in text
    assert "1437 train / 360 test images" in text
    for epoch in range(1, 6):
        assert re.search(rf"\[rank 0\] epoch {epoch}/5: loss \d+\.\d+, train accuracy", text)
    accuracy = float(re.search(r"test accuracy: (\d\.\d+) \((\d+)/360 test images\)", text).group(1))
    assert accuracy >= 0.9, text
    checkpoint = pathlib.Path(re.search(r"checkpoint: (\S+)", text).group(1))
    job_folder = checkpoint.parent  # the job's own folder: <checkpoint_dir>/<run_id>
    assert checkpoint.name == "step-000000005.pt" and checkpoint.exists()
    assert job_folder.parent == out_dir / "checkpoints" and job_folder.name.startswith("demo-")
    state = dask_ddp.load_checkpoint(str(job_folder))
    assert state["epoch"] == 5 and "0.weight" in state["model"]
    assert [c.step for c in dask_ddp.checkpoint.list_checkpoints(str(job_folder))] == [4, 5]  # keep=2
    with open(out_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert f"metrics: {out_dir / 'metrics.csv'} ({len(rows)} rows" in text
    assert len(rows) == 2 * 5 * 23  # 2 ranks x 5 epochs x ceil(719 / 32) steps
    assert {"rank", "step", "loss", "accuracy", "epoch"} <= set(rows[0])
    assert "Traceback" not in out.stderr
    print(f"demo: test accuracy {accuracy:.3f}, {out.seconds:.0f} s", text.splitlines()[-3])


@pytest.mark.slow
def test_demo_reads_given_data_and_uses_a_given_scheduler(s3, tmp_path):
    """``--data`` (an existing tree, a subset of the digits) and ``--scheduler``, through the Python entry point."""
    from _cluster import leftover_processes
    from dask.distributed import Client, LocalCluster

    from dask_ddp.cli import demo

    subset = {k: v for k, v in demo.digits_images().items() if int(k.rsplit("/", 1)[1][:4]) < 400}
    url = f"s3://{s3['bucket']}/digits"
    demo.upload(subset, url, s3["storage_options"])
    lines = []
    with LocalCluster(n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address="127.0.0.1:0") as c, \
            Client(c) as client:
        result = demo.run_demo(epochs=2, data=url, storage_options=s3["storage_options"],
                               scheduler=c.scheduler_address, out=str(tmp_path), echo=lines.append)
        assert leftover_processes(client) == []
    assert result["exit_code"] == 0
    assert f"using the images under {url}" in lines
    assert any("320 train / 80 test images" in line for line in lines)
    assert 0 <= result["test_accuracy"] <= 1
    checkpoint = pathlib.Path(result["checkpoint"])  # in the job's own folder: <checkpoint_dir>/<run_id>
    assert checkpoint.name == "step-000000002.pt" and checkpoint.parent.parent == tmp_path / "checkpoints"
    assert result["metrics"] == str(tmp_path / "metrics.csv")


def test_digits_images_split():
    from dask_ddp.cli.demo import digits_images

    files = digits_images()
    assert len(files) == 1797
    splits = {split: [k for k in files if k.startswith(split + "/")] for split in ("train", "test")}
    assert len(splits["test"]) == 360 and len(splits["train"]) == 1437
    for keys in splits.values():
        assert {k.split("/")[1] for k in keys} == {str(d) for d in range(10)}
    assert all(blob.startswith(b"\x89PNG") for blob in files.values())
    with pytest.raises(ValueError, match="test_every"):
        digits_images(1)


def test_model_shape():
    import torch

    from dask_ddp.cli.demo import build_model

    assert build_model()(torch.zeros(3, 1, 8, 8)).shape == (3, 10)

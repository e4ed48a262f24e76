"""Lightning's sharded (FSDP2) checkpoints through dask-ddp's DCP path: ``ModelParallelStrategy`` (``fully_shard``
in ``configure_model``) with ``DaskDDPCallback``, real Lightning on CPU (gloo), a real LocalCluster of 2 workers.

The trainer's checkpoints become dask-ddp sharded steps (each rank its own shards, a commit marker, keep-N) in
``lightning-sharded/`` of the job's folder, with no ``meta.pt`` that Lightning's own resume would read with
``weights_only=False``; a rank killed mid-run resumes from the newest step to the same parameters, bit for bit, as
the run without the fault.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from _cluster import run

pytest.importorskip("lightning")


def fsdp2_train(kill: str | None = None, epochs: int = 4):
    """4 epochs of 4 steps of a 2-layer model sharded by FSDP2, momentum SGD; rank 1 of the first attempt SIGKILLs
    itself in epoch 2 when ``kill`` names a marker that does not exist yet. Returns each rank's full parameters."""
    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from dask_ddp.integrations.lightning import DaskDDPCallback

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.save_hyperparameters({"width": 8})  # an AttributeDict in the checkpoint: carried as a plain dict
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))

        def configure_model(self):
            for layer in self.net:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, i):
            if kill and self.current_epoch == 2 and i == 1 and dist.get_rank() == 1 and not os.path.exists(kill):
                open(kill, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    torch.manual_seed(0)
    model = Model()
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(1)),
                                          torch.randn(16, 1, generator=torch.Generator().manual_seed(2)))
    trainer = L.Trainer(accelerator="cpu", strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                        max_epochs=epochs, log_every_n_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[DaskDDPCallback()])
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=2))
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return {"world": trainer.world_size, "params": torch.cat([p.detach().flatten() for p in full]),
            "step": trainer.global_step, "epoch": trainer.current_epoch}


def test_fsdp2_checkpoints_are_dask_ddp_sharded_steps_and_a_killed_rank_resumes_bitwise(client, tmp_path):
    clean = run(client, fsdp2_train, checkpoint_dir=str(tmp_path / "clean")).result(timeout=300)
    assert [c["world"] for c in clean] == [2, 2] and clean[0]["step"] == 16
    job = run(client, fsdp2_train, str(tmp_path / "killed"), max_restarts=1, checkpoint_dir=str(tmp_path / "ckpt"))
    started = time.monotonic()
    out = job.result(timeout=300)
    print(f"killed and resumed in {time.monotonic() - started:.1f} s")
    assert job.attempt.index == 1, job.history
    folder = tmp_path / "ckpt" / job.run_id
    assert not (folder / "lightning").exists() or not os.listdir(folder / "lightning"), "a Lightning file was written"
    from dask_ddp.checkpoint import list_sharded

    steps = [s.step for s in list_sharded(str(folder / "lightning-sharded"))]
    assert steps == [12, 16], steps  # an epoch's end each, the newest 2 (keep=2)
    for step in (folder / "lightning-sharded").rglob("*"):
        assert step.name != "meta.pt", "Lightning's own sharded save (torch.load with weights_only=False) was used"
    logs = "\n".join(job.logs)
    assert "resumed Lightning from sharded step 8" in logs, logs[-3000:]
    for a, b in zip(out, clean):
        assert a["step"] == b["step"] == 16
        assert torch.equal(a["params"], b["params"]), (a["params"] - b["params"]).abs().max()

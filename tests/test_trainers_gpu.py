"""Lightning, Transformers and Accelerate with their defaults on dask-cuda's ``LocalCUDACluster``: each rank's model
on its own worker's GPU, nccl, the trainer's world the job's.

Marked ``gpu``: skipped where no CUDA GPU is visible (CI, the CPU machines); they run on a lent GPU machine. What
they check on CPU is held by ``tests/test_trainers.py`` (the environment each rank gets) and ``tests/test_devices.py``
(``cuda:LOCAL_RANK`` is the worker's own GPU under dask-cuda, with the device lists faked).
"""

from __future__ import annotations

import os

import pytest
from dask.distributed import Client

from dask_ddp import dispatch

pytest.importorskip("transformers")
pytest.importorskip("lightning")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_client():
    dask_cuda = pytest.importorskip("dask_cuda")
    with dask_cuda.LocalCUDACluster(dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


def _where(module) -> dict:
    """The rank's own GPU (its UUID, from dask-ddp's placement), where the trainer put the model, and the backend."""
    import torch
    import torch.distributed as dist

    import dask_ddp

    ctx = dask_ddp.get_context()
    param = next(module.parameters())
    return {"own": str(torch.cuda.get_device_properties(ctx.device).uuid),
            "model": str(torch.cuda.get_device_properties(param.device).uuid) if param.is_cuda else "cpu",
            "backend": dist.get_backend(), "worker_gpu": os.environ.get("CUDA_VISIBLE_DEVICES", "")}


def hf_on_gpu(out: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16))
    tokens = torch.randint(0, 64, (32, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=2, report_to=[],
                             save_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data).train()
    return {**_where(model), "world": args.world_size}


def accelerate_on_gpu():
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator()
    net = accelerator.prepare(torch.nn.Linear(4, 1))
    return {**_where(net), "world": accelerator.num_processes}


def lightning_on_gpu():
    import lightning as L
    import torch

    seen = {}

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, i):
            seen.update(_where(self.net))
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.TensorDataset(torch.randn(16, 4))
    trainer = L.Trainer(max_steps=2, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=2))
    return {**seen, "world": trainer.world_size}


@pytest.mark.parametrize("library", ["transformers", "accelerate", "lightning"])
def test_each_trainer_puts_each_ranks_model_on_its_own_gpu_with_nccl(cuda_client, tmp_path, library):
    import torch

    fn = {"transformers": hf_on_gpu, "accelerate": accelerate_on_gpu, "lightning": lightning_on_gpu}[library]
    args = (str(tmp_path / "hf"),) if library == "transformers" else ()
    out = dispatch.run(cuda_client, fn, *args, progress=False).result(timeout=600)
    n = torch.cuda.device_count()
    assert len(out) == n
    assert [o["world"] for o in out] == [n] * n, out
    assert all(o["backend"] == "nccl" for o in out), out
    assert all(o["model"] == o["own"] for o in out), f"a model is not on its rank's own GPU: {out}"
    assert len({o["own"] for o in out}) == n, f"two ranks share a GPU: {out}"

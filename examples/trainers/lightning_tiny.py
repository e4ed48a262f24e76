"""A Lightning script, unchanged from what torchrun runs: no devices=, no num_nodes=, no strategy=.

    dask-ddp run examples/trainers/lightning_tiny.py                          # 2 ranks on a local cluster
    PL_TRAINER_DEVICES=2 torchrun --nproc_per_node 2 examples/trainers/lightning_tiny.py   # the same line

Under torchrun Lightning needs devices= to match the ranks per host (here through its PL_TRAINER_DEVICES default),
or it trains each rank alone; a dask-ddp rank gets it (docs/guide/trainers.md). Rank 0 prints one RESULT line.
"""

import lightning as L
import torch


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.001)


torch.manual_seed(0)
model = Model()
data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(1)),
                                      torch.randn(64, 1, generator=torch.Generator().manual_seed(2)))
trainer = L.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False)
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
if trainer.is_global_zero:
    total = sum(p.double().sum().item() for p in model.parameters())
    print(f"RESULT lightning world={trainer.world_size} steps={trainer.global_step} params={total:.9f}", flush=True)

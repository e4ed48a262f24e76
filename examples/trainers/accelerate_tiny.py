"""An Accelerate script, unchanged from what torchrun runs: no cpu=True.

    dask-ddp run examples/trainers/accelerate_tiny.py                         # 2 ranks on a local cluster
    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 examples/trainers/accelerate_tiny.py   # the same line

Without ACCELERATE_USE_CPU=true (or Accelerator(cpu=True)), torchrun on CPUs trains each rank alone; a dask-ddp rank
gets it (docs/guide/trainers.md). Rank 0 prints one RESULT line.
"""

import torch
from accelerate import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.01)
data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(1)),
                                      torch.randn(64, 1, generator=torch.Generator().manual_seed(2)))
net, opt, loader = accelerator.prepare(net, opt, torch.utils.data.DataLoader(data, batch_size=4))
for epoch in range(2):
    for x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(net(x), y))
        opt.step()
        opt.zero_grad()
if accelerator.is_main_process:
    total = sum(p.double().sum().item() for p in net.parameters())
    print(f"RESULT accelerate world={accelerator.num_processes} params={total:.9f}", flush=True)

"""GPU telemetry on a real GPU (skipped without one): memory from torch.cuda, utilisation from NVML, the
collective wait timed with CUDA events on NCCL. Self-contained: its own one-worker LocalCluster per GPU."""

from __future__ import annotations

import pytest
from _cluster import local_client, run

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def train_on_gpu(seconds):
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dask_ddp

    ctx = dask_ddp.get_context()
    model = DDP(torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10))
                .to(ctx.device), device_ids=ctx.device_ids)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = time.time()
    while time.time() - start < seconds:
        x = torch.randn(256, 1024, device=ctx.device)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        dask_ddp.report(loss=loss)
    return str(ctx.device), ctx.backend


class Seen:
    def __init__(self):
        self.items = []

    def on_telemetry(self, item):
        self.items.append(item)


def test_gpu_fields():
    import torch

    n = torch.cuda.device_count()
    seen = Seen()
    with local_client(n) as client:
        out = run(client, train_on_gpu, 6.0, callbacks=[seen]).result(timeout=300)
    assert all(device.startswith("cuda") for device, _ in out), out
    for rank in range(n):
        items = [it for it in seen.items if it["rank"] == rank and it["steps"]]
        assert len(items) >= 3, seen.items
        last = items[-1]
        print(f"rank {rank} ({out[rank][1]}): {last}")
        assert last["gpu_mem_bytes"] > 0 and last["gpu_mem_peak_bytes"] >= last["gpu_mem_bytes"]
        assert last["step_time"] and last["step_time"] > 0
        assert last["collective_wait"] is not None and 0 <= last["collective_wait"] <= 1
        try:
            import pynvml  # noqa: F401 - nvidia-ml-py, the cuda extra
        except ImportError:
            assert last["gpu_util"] is None
        else:
            assert last["gpu_util"] is not None and 0 <= last["gpu_util"] <= 100

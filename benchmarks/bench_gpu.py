"""One GPU rank under dask-ddp (LocalCUDACluster, nccl) beside ``torchrun --nproc-per-node 1``, in one run.

Usage (on a GPU machine; on a CPU-only one it says so and exits 0)::

    python benchmarks/bench_gpu.py [--images 1024] [--repeats 3] [--out benchmarks/RESULTS_gpu.md]

Two workloads, the same function source on both sides (copied into a script
for torchrun, as ``bench_dispatch.py`` does):

1. ``loop``: 300 steps of a small CNN on random 1x28x28 batches of 32 on the
   GPU (the CPU benchmark's loop), timed inside the rank around the loop,
   ``torch.cuda.synchronize()`` at both ends.
2. ``resnet``: ResNet-18 (10 classes) on batches of 64 224x224 JPEGs decoded
   from an :class:`dask_ddp.S3ImageFolder` on a moto S3 server on 127.0.0.1
   (``--images`` JPEGs the benchmark makes), DataLoader with 6 workers,
   ``pin_memory=True``, ``non_blocking`` copies. The first epoch fills the
   dataset's local cache; the second is timed: mean step time, and the share
   of it the loop spent waiting for the next batch (``next(loader)``), so
   the input-wait share says whether the GPU ever waited for input once the
   cache was warm.

Each repeat runs dask-ddp and torchrun, alternating which goes first; the
ratios are of medians.
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path


def loop(steps=300, seed=0, batch=32):
    """The CPU benchmark's CNN loop, on this rank's GPU; seconds per step."""
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device("cuda", 0)  # one rank: torchrun's LOCAL_RANK 0, dask-cuda's own GPU
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
                        nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(784, 10)).to(dev)
    model = DDP(net, device_ids=[dev.index])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    x = torch.randn(batch, 1, 28, 28, device=dev, generator=gen)
    y = torch.randint(0, 10, (batch,), device=dev, generator=gen)
    for _ in range(10):  # warm-up: cuDNN picks its algorithms
        nn.functional.cross_entropy(model(x), y).backward()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return {"rank": dist.get_rank(), "step_s": (time.perf_counter() - t0) / steps, "loss": loss.item()}


def resnet(root, cache, storage_options, batch=64, workers=6, seed=0):
    """ResNet-18 on S3ImageFolder batches: epoch 1 fills the cache, epoch 2 is timed (step time, input wait)."""
    import os
    import time

    import torch
    import torch.distributed as dist
    import torchvision
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torchvision import transforms

    import dask_ddp

    dev = torch.device("cuda", 0)
    torch.manual_seed(seed)
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.25] * 3)])
    data = dask_ddp.S3ImageFolder(root, transform=tf, storage_options=storage_options, cache=cache)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, num_workers=workers, pin_memory=True,
                                         persistent_workers=True, drop_last=True)
    model = DDP(torchvision.models.resnet18(num_classes=10).to(dev), device_ids=[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    out = {}
    for epoch in range(2):
        waited, steps = 0.0, 0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        it = iter(loader)
        while True:
            t_wait = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                break
            waited += time.perf_counter() - t_wait
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        out = {"rank": dist.get_rank(), "epoch": epoch, "step_s": took / steps, "input_wait": waited / took,
               "steps": steps, "loss": loss.item(), "pid": os.getpid()}
    return out


TORCHRUN_MAIN = '''
if __name__ == "__main__":
    import json
    import sys

    import torch.distributed as dist

    dist.init_process_group("nccl")
    out = {"loop": loop, "resnet": resnet}[sys.argv[1]](**json.loads(sys.argv[2]))
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
'''


def write_script(folder: str) -> str:
    path = os.path.join(folder, "gpu_train.py")
    src = "\n\n".join(textwrap.dedent(inspect.getsource(f)) for f in (loop, resnet))
    Path(path).write_text('"""Written by benchmarks/bench_gpu.py."""\n\n' + src + "\n" + TORCHRUN_MAIN)
    return path


def jpeg(i: int, size: int = 224) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(i)
    y, x = np.mgrid[0:size, 0:size]
    base = np.stack([x * (1 + i % 3), y * (1 + i % 4), (x + y) // 2], axis=-1) % 256
    pixels = np.clip(base + rng.randint(-40, 40, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def torchrun(script: str, name: str, kwargs: dict, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           script, name, json.dumps(kwargs)], capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"torchrun {name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(re.findall(r"RESULT (\{[^}]*\})", proc.stdout)[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).with_name("RESULTS_gpu.md")))
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU here; the GPU side-by-side was skipped")
        return 0
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    env = dict(os.environ)
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    import dask_ddp
    from dask_ddp.cli.demo import embedded_s3, upload

    rows = {"loop": {"dask-ddp": [], "torchrun": []}, "resnet": {"dask-ddp": [], "torchrun": []}}
    with tempfile.TemporaryDirectory() as tmp, embedded_s3() as endpoint:
        opts = {"client_kwargs": {"endpoint_url": endpoint}}
        files = {f"train/c{i % 10}/{i}.jpg": jpeg(i) for i in range(args.images)}
        upload(files, "s3://bench-gpu/data", opts)
        script = write_script(tmp)
        with LocalCUDACluster(n_workers=1, threads_per_worker=1, dashboard_address=None) as cluster, \
                Client(cluster) as client:
            dask_ddp.dispatch.warm_up(client)
            for r in range(args.repeats):
                for name in ("loop", "resnet"):
                    kw = {} if name == "loop" else {"root": "s3://bench-gpu/data/train",
                                                    "cache": f"{tmp}/cache-{name}-{r}", "storage_options": opts}
                    kw_t = dict(kw, cache=f"{tmp}/cache-t-{name}-{r}") if kw else kw
                    order = ("dask-ddp", "torchrun") if r % 2 == 0 else ("torchrun", "dask-ddp")
                    for side in order:
                        if side == "dask-ddp":
                            got = dask_ddp.dispatch.run(client, globals()[name], backend="nccl", progress=False,
                                                        **kw).result(timeout=900)[0]
                        else:
                            got = torchrun(script, name, kw_t, env)
                        rows[name][side].append(got)
                        print(name, side, json.dumps(got), flush=True)
    med = {n: {s: statistics.median(g["step_s"] for g in v) for s, v in sides.items()} for n, sides in rows.items()}
    wait = {s: statistics.median(g["input_wait"] for g in rows["resnet"][s]) for s in ("dask-ddp", "torchrun")}
    name = torch.cuda.get_device_name(0)
    lines = ["# One GPU rank: dask-ddp (LocalCUDACluster, nccl) beside torchrun --nproc-per-node 1", "",
             f"`python benchmarks/bench_gpu.py --images {args.images} --repeats {args.repeats}` on {name}, "
             f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}. Medians of {args.repeats} alternating runs.",
             "", "| workload | dask-ddp s/step | torchrun s/step | ratio | input wait (dask-ddp / torchrun) |",
             "|---|---:|---:|---:|---:|",
             f"| 300-step CNN loop, batch 32 | {med['loop']['dask-ddp'] * 1e3:.3f} ms | "
             f"{med['loop']['torchrun'] * 1e3:.3f} ms | {med['loop']['dask-ddp'] / med['loop']['torchrun']:.3f}x | |",
             f"| ResNet-18, batch 64 of 224x224 JPEGs from S3ImageFolder (cache warm) | "
             f"{med['resnet']['dask-ddp'] * 1e3:.1f} ms | {med['resnet']['torchrun'] * 1e3:.1f} ms | "
             f"{med['resnet']['dask-ddp'] / med['resnet']['torchrun']:.3f}x | "
             f"{wait['dask-ddp'] * 100:.1f} % / {wait['torchrun'] * 100:.1f} % |"]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

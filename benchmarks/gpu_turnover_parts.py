"""Where a GPU trial's turnover goes: the parts of a 1-rank nccl rank's start and end, timed in forked children.

Usage (on a GPU machine)::

    python benchmarks/gpu_turnover_parts.py [--repeats 5] [--frac 0.3]

The parent imports torch and registers its backends as dask-ddp's zygote does, then forks one child per
measurement, as the zygote forks a rank. Each child times, in ms: CUDA's start (``set_device`` and a first
tensor), a 1-rank TCPStore and nccl process group (``device_id`` given: the communicator is made at once; or
not: made by the first collective), the first all-reduce, an allocation of ``--frac`` of the GPU's memory,
``destroy_process_group``; the parent times the child's exit (its message "exiting" to ``waitpid``), with and
without ``destroy_process_group`` before ``os._exit``. "warm" children start CUDA first and wait for the
parent's go, as a rank forked ahead of its job could: the start is then timed from the go. Prints a JSON line
per child and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta


def child(w, go_r, variant: str, frac: float) -> None:
    import torch
    import torch.distributed as dist

    t = {}
    if variant == "warm":
        t0 = time.perf_counter()
        torch.cuda.set_device(0)
        torch.empty(1, device="cuda")
        t["warm_cuda"] = time.perf_counter() - t0
        os.read(go_r, 1)
    t0 = time.perf_counter()
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")
    t["cuda"] = time.perf_counter() - t0
    s0 = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    t["store"] = time.perf_counter() - s0
    s0 = time.perf_counter()
    eager = variant != "lazy"
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60),
                            device_id=torch.device("cuda", 0) if eager else None)
    t["init_pg"] = time.perf_counter() - s0
    s0 = time.perf_counter()
    x = torch.ones(1024, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    t["first_allreduce"] = time.perf_counter() - s0
    t["start_total"] = time.perf_counter() - t0
    s0 = time.perf_counter()
    free, total = torch.cuda.mem_get_info()
    block = torch.empty(int(total * frac), dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    t["alloc"] = time.perf_counter() - s0
    if variant != "nodestroy":
        s0 = time.perf_counter()
        dist.destroy_process_group()
        t["destroy"] = time.perf_counter() - s0
    os.write(w, (json.dumps({k: round(v * 1000, 1) for k, v in t.items()}) + "\n").encode())
    os._exit(0)


def measure(variant: str, frac: float) -> dict:
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    t_fork = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            child(w, go_r, variant, frac)
        finally:
            os._exit(1)
    os.close(w)
    if variant == "warm":
        time.sleep(3.0)  # the job runs elsewhere meanwhile
        t_fork = time.perf_counter()
        os.write(go_w, b"g")
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(r, 4096)
        if not chunk:
            break
        data += chunk
    t_msg = time.perf_counter()
    _, status = os.waitpid(pid, 0)
    t_exit = time.perf_counter()
    for fd in (r, go_r, go_w):
        os.close(fd)
    out = json.loads(data) if data else {"error": status}
    out["exit_after_message"] = round((t_exit - t_msg) * 1000, 1)
    out["fork_or_go_to_message"] = round((t_msg - t_fork) * 1000, 1)
    out["variant"] = variant
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--frac", type=float, default=0.3)
    args = parser.parse_args()
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from dask_ddp.rank.warm import warm_imports

    warm_imports()
    rows: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for variant in ("eager", "lazy", "nodestroy", "warm"):
            row = measure(variant, args.frac)
            print(json.dumps(row), flush=True)
            rows.setdefault(variant, []).append(row)
    for variant, got in rows.items():
        keys = [k for k in got[0] if k != "variant"]
        med = {k: statistics.median(r[k] for r in got if k in r) for k in keys}
        print("median", variant, json.dumps(med), flush=True)


if __name__ == "__main__":
    main()

"""Sharded checkpoints on moto S3: training stall (blocking vs async) and save/load MB/s against torch and s3fs.

Usage::

    python benchmarks/bench_sharded.py [--gib 1.0] [--pairs 3] [--out benchmarks/RESULTS_sharded.md]

Two gloo ranks (forked processes, CPU) hold an FSDP2 model of ``--gib`` GiB of float32 parameters (half on each
rank) and a moto S3 server runs in this process on 127.0.0.1. Side by side, in one run, each timed on rank 0
between barriers (MB = 1e6 bytes, MiB = 2**20):

- ours (after one unmeasured async save and load: first-call imports, the checkpoint's gloo group, the clients,
  the host buffers an async save allocates once and reuses):
  ``save_sharded`` blocking (its time is the stall), ``save_sharded(async_save=True)`` (the stall is the
  time until it returns; the upload ends at ``wait_sharded``), ``load_sharded`` at 2 ranks, and the same step read
  whole in one process (``read_sharded``: resharded to one);
- torch DCP with its ``FsspecWriter`` / ``FsspecReader`` (2 ranks);
- ``torch.save`` of the full state to s3fs from rank 0 (the full state gathered first: timed apart) and
  ``torch.load`` of it on rank 0;
- the s3fs ceilings, no torch in the loop, each rank moving its own half of the same bytes concurrently: writes
  as many ``pipe_file`` per rank as ours writes (4 threads; one object of 512 MiB per rank is a multipart upload
  that moto 5.2 completed in 42 s or failed: not a ceiling), reads as one GET per object of the files ours
  wrote (``cat_file(..., max_concurrency=1)``: s3fs's plain ``cat_file`` sends a HEAD and ranged GETs for an
  object bigger than its block size), one after another and 4 at a time, and as 8 MiB ranged GETs. The best
  read is the read ceiling; in every round of ``--pairs`` the ceiling is measured again beside ours (the best of
  one after another and 4 at a time), at 2 ranks and into one process.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _model(gib: float):
    import torch

    import dask_ddp

    width = 4096
    layers = max(2, round(gib * 2**30 / (width * width * 4)))
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    dask_ddp.shard_model(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_()
    return model


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - started


def _bench(rank, world, endpoint, bucket, gib, pairs=0):
    import s3fs
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import dask_ddp

    opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}
    fs = s3fs.S3FileSystem(**opts)
    model = _model(gib)
    nbytes = sum(p.to_local().numel() * 4 for p in model.parameters()) * world
    out = {"bytes": nbytes}
    base = f"s3://{bucket}"

    # warm-up, not measured: first-call imports, the checkpoint gloo group, the filesystem's clients
    # and the async path's host buffers (allocated by the first async save, reused by the next ones)
    dask_ddp.save_sharded({"model": model}, 0, directory=f"{base}/warm", storage_options=opts, async_save=True)
    dask_ddp.wait_sharded()
    dask_ddp.load_sharded({"model": model}, directory=f"{base}/warm", storage_options=opts)
    dist.barrier()
    if rank == 0:
        fs.rm(f"{bucket}/warm", recursive=True)

    def blocking():
        started = time.perf_counter()
        dask_ddp.save_sharded({"model": model}, 1, directory=f"{base}/ours", storage_options=opts)
        return time.perf_counter() - started

    out["ours_save_s"] = _timed(blocking)
    stall = {}

    def asynchronous():
        started = time.perf_counter()
        dask_ddp.save_sharded({"model": model}, 2, directory=f"{base}/ours", storage_options=opts, async_save=True)
        stall["s"] = time.perf_counter() - started
        dask_ddp.wait_sharded()

    out["ours_async_total_s"] = _timed(asynchronous)
    out["ours_async_stall_s"] = stall["s"]
    fresh = _model(gib)
    out["ours_load_s"] = _timed(lambda: dask_ddp.load_sharded({"model": fresh}, directory=f"{base}/ours", step=1,
                                                              storage_options=opts))
    same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), fresh.parameters()))
    out["ours_load_equal"] = bool(same)
    step_folder = dask_ddp.checkpoint.list_sharded(f"{base}/ours", storage_options=opts)[0]
    files = sorted(f for f in fs.ls(step_folder.url.removeprefix("s3://")) if f.endswith(".distcp"))
    mine = [f for f in files if f"-rank-{rank:05d}-" in f]
    out["files"] = len(mine)

    sd = {"model": get_model_state_dict(model)}
    out["torch_dcp_save_s"] = _timed(lambda: dcp.save(sd, storage_writer=FsspecWriter(f"{base}/torch", **opts)))
    back = {"model": get_model_state_dict(fresh)}
    out["torch_dcp_load_s"] = _timed(lambda: dcp.load(back, storage_reader=FsspecReader(f"{base}/torch", **opts)))

    started = time.perf_counter()
    full = {"sd": get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))}
    out["torch_save_gather_s"] = time.perf_counter() - started

    def torch_save():
        if rank == 0:
            with fs.open(f"{bucket}/whole.pt", "wb", block_size=32 << 20) as f:
                torch.save(full["sd"], f)

    out["torch_save_s"] = _timed(torch_save)

    def torch_load():
        if rank == 0:
            with fs.open(f"{bucket}/whole.pt", "rb", block_size=32 << 20) as f:
                torch.load(f, weights_only=True)

    out["torch_load_s"] = _timed(torch_load)
    full.clear()
    if rank == 0:
        fs.rm(f"{bucket}/whole.pt")
        fs.rm(f"{bucket}/torch", recursive=True)

    half = {"b": b"\0" * (nbytes // world)}
    count = len(mine)
    out["s3fs_write_n_s"] = _timed(lambda: _write_ceiling(fs, f"{bucket}/ceiling{count}/{rank}",
                                                          half["b"][: len(half["b"]) // count], count))
    half.clear()
    if rank == 0:
        fs.rm(f"{bucket}/ceiling{len(mine)}", recursive=True)
    out["s3fs_read_whole_s"] = _timed(lambda: _one_get_each(fs, mine, 4))
    out["s3fs_read_seq_s"] = _timed(lambda: _one_get_each(fs, mine, 1))

    def ranged():
        for f in mine:
            size = fs.info(f)["size"]
            for start in range(0, size, 8 << 20):
                fs.cat_file(f, start=start, end=min(size, start + (8 << 20)))

    out["s3fs_read_ranged_s"] = _timed(ranged)
    out["pairs"] = _pairs(rank, fs, model, fresh, nbytes // world, base, bucket, opts, pairs)
    dist.barrier()
    return out


def _one_get_each(fs, files: list, threads: int) -> None:
    """The read ceiling: each file in one GET (no HEAD, no ranges), ``threads`` at a time."""
    import concurrent.futures as cf

    if threads == 1:
        for f in files:
            fs.cat_file(f, max_concurrency=1)
        return
    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda f: fs.cat_file(f, max_concurrency=1), files))


def _write_ceiling(fs, prefix: str, piece: bytes, count: int) -> None:
    """The write ceiling: ``count`` objects of ``piece`` under ``prefix-<i>``, 4 threads (the writer's own count)."""
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: fs.pipe_file(f"{prefix}-{i}", piece), range(count)))


def _pairs(rank, fs, model, fresh, half_bytes, base, bucket, opts, count):
    """``count`` rounds of (ours, its ceiling) back to back, for save and for load: the ratio of each pair, so a
    machine whose load drifts during the run (other work on 2 shared cores) compares like with like."""
    import dask_ddp

    rounds = []
    for i in range(count):
        step = 100 + i
        if i and rank == 0:  # the previous round's step, untimed (keep= would prune inside the timed save)
            fs.rm(f"{bucket}/pairs", recursive=True)
        fs.invalidate_cache()
        save = _timed(lambda: dask_ddp.save_sharded({"model": model}, step, directory=f"{base}/pairs",
                                                    storage_options=opts))
        found = dask_ddp.checkpoint.list_sharded(f"{base}/pairs", storage_options=opts)[-1]
        mine = sorted(f for f in fs.ls(found.url.removeprefix("s3://"), refresh=True)
                      if f.endswith(".distcp") and f"-rank-{rank:05d}-" in f)
        piece = b"\0" * (half_bytes // len(mine))
        write_s = _timed(lambda: _write_ceiling(fs, f"{bucket}/pairceil/{rank}", piece, len(mine)))
        piece = b""  # the memory back before the load
        load = _timed(lambda: dask_ddp.load_sharded({"model": fresh}, directory=f"{base}/pairs", step=step,
                                                    storage_options=opts))
        read_s = min(_timed(lambda: _one_get_each(fs, mine, 1)), _timed(lambda: _one_get_each(fs, mine, 4)))
        rounds.append({"save": save, "write": write_s, "load": load, "read": read_s})
        if rank == 0:
            fs.rm(f"{bucket}/pairceil", recursive=True)
    return rounds


def one_process(rank, world, endpoint, bucket, rounds=3):
    """The step read whole in one process (a child: moto's threads hold this process's GIL): ``rounds`` of
    (``read_sharded``, then one GET per file of the step, the best of one after another and 4 at a time)."""
    from dask_ddp.checkpoint import read_sharded

    opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}
    read_sharded(f"s3://{bucket}/ours", step=2, storage_options=opts)  # warm-up: imports, clients
    import s3fs

    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    files = [f for f in fs.find(f"{bucket}/ours") if "/step" in f and f.endswith(".distcp")]
    step1 = [f for f in files if "/step-000000001-" in f]
    fs.cat_file(step1[0], start=0, end=1)  # the client, connected

    def timed(fn) -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    out = []
    for _ in range(max(1, rounds)):
        ours = timed(lambda: read_sharded(f"s3://{bucket}/ours", step=1, storage_options=opts))
        ceiling = min(timed(lambda: _one_get_each(fs, step1, 1)), timed(lambda: _one_get_each(fs, step1, 4)))
        out.append((ours, ceiling))
    return out, len(step1)


LOAD = list(os.getloadavg())  # at start: the machine is shared


def report(r: dict, one_process: tuple, gib: float) -> str:
    mb = r["bytes"] / 1e6
    import statistics

    one_rounds, one_files = one_process
    one = statistics.median(o for o, _ in one_rounds)
    one_ceiling = statistics.median(c for _, c in one_rounds)
    one_ratio = statistics.median(c / o for o, c in one_rounds)

    def rate(key):
        return mb / r[key]

    write_ceiling = rate("s3fs_write_n_s")
    read_ceiling = max(rate("s3fs_read_whole_s"), rate("s3fs_read_seq_s"), rate("s3fs_read_ranged_s"))
    rows = [
        ("ours: save_sharded, blocking", r["ours_save_s"], rate("ours_save_s"), rate("ours_save_s") / write_ceiling),
        ("ours: save_sharded, async (until committed)", r["ours_async_total_s"], rate("ours_async_total_s"),
         rate("ours_async_total_s") / write_ceiling),
        ("torch DCP FsspecWriter", r["torch_dcp_save_s"], rate("torch_dcp_save_s"),
         rate("torch_dcp_save_s") / write_ceiling),
        ("torch.save to s3fs from rank 0 (gather not included)", r["torch_save_s"], rate("torch_save_s"),
         rate("torch_save_s") / write_ceiling),
        (f"ceiling: s3fs pipe_file, {r['files']} objects per rank (4 threads)", r["s3fs_write_n_s"],
         rate("s3fs_write_n_s"), None),
        ("ours: load_sharded at 2 ranks", r["ours_load_s"], rate("ours_load_s"), rate("ours_load_s") / read_ceiling),
        (f"ours: read_sharded in 1 process (resharded to one; median of {len(one_rounds)} rounds, each x its own "
         "ceiling below)", one, mb / one, one_ratio),
        ("torch DCP FsspecReader", r["torch_dcp_load_s"], rate("torch_dcp_load_s"),
         rate("torch_dcp_load_s") / read_ceiling),
        ("torch.load from s3fs on rank 0", r["torch_load_s"], rate("torch_load_s"),
         rate("torch_load_s") / read_ceiling),
        ("ceiling: one GET per object, 4 at a time, both ranks", r["s3fs_read_whole_s"],
         rate("s3fs_read_whole_s"), None),
        ("ceiling: one GET per object, one after another, both ranks", r["s3fs_read_seq_s"],
         rate("s3fs_read_seq_s"), None),
        ("ceiling: s3fs 8 MiB ranged GETs, both ranks", r["s3fs_read_ranged_s"], rate("s3fs_read_ranged_s"), None),
        (f"ceiling for 1 process: one GET per object of the {one_files} files (best of 1 and 4 at a time; median)",
         one_ceiling, mb / one_ceiling, None),
    ]
    lines = [f"# Sharded checkpoints on moto S3 ({datetime.date.today()}, {platform.node()}, "
             f"{os.cpu_count()} cores, CPU)", "",
             f"`python benchmarks/bench_sharded.py --gib {gib} --pairs {len(r['pairs'])}`: an FSDP2 model of "
             f"{r['bytes'] / 2**30:.2f} GiB "
             "(float32) on 2 gloo ranks, moto on 127.0.0.1 in the benchmark's process. MB = 1e6 bytes. Load "
             f"average (1 min) before the run {LOAD[0]:.1f}, after it {os.getloadavg()[0]:.1f}.", "",
             "| what | seconds | MB/s | x ceiling |", "|---|---:|---:|---:|"]
    for name, seconds, speed, ratio in rows:
        lines.append(f"| {name} | {seconds:.2f} | {speed:.0f} | {'' if ratio is None else f'{ratio:.2f}'} |")
    if r["pairs"]:
        save = [p["write"] / p["save"] for p in r["pairs"]]
        load = [p["read"] / p["load"] for p in r["pairs"]]
        lines += ["", f"{len(r['pairs'])} rounds of (ours, then its ceiling) back to back, each ratio within its round "
                  "(blocking save vs the s3fs write ceiling; load_sharded at 2 ranks vs one GET per object of the "
                  "same step's files, the best of one after another and 4 at a time):", "",
                  "| round | save s | write ceiling s | save x ceiling | load s | read ceiling s | load x ceiling |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for i, p in enumerate(r["pairs"]):
            lines.append(f"| {i + 1} | {p['save']:.2f} | {p['write']:.2f} | {save[i]:.2f} | {p['load']:.2f} | "
                         f"{p['read']:.2f} | {load[i]:.2f} |")
        lines += ["", f"Median of the rounds: save **{statistics.median(save):.2f}x**, load "
                  f"**{statistics.median(load):.2f}x** the ceiling; one process (read_sharded) "
                  f"**{one_ratio:.2f}x** its ceiling ("
                  + ", ".join(f"{c / o:.2f}" for o, c in one_rounds) + ")."]
    share = 100 * r["ours_async_stall_s"] / r["ours_save_s"]
    lines += ["", f"Training stall per checkpoint: blocking {r['ours_save_s']:.2f} s, async "
              f"{r['ours_async_stall_s']:.3f} s ({share:.1f} % of blocking). torch.save's full-state gather took "
              f"{r['torch_save_gather_s']:.2f} s more. Loaded state equal to the saved one: {r['ours_load_equal']}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--pairs", type=int, default=3, help="rounds of (ours, ceiling) back to back")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import boto3
    import torch._dynamo  # noqa: F401 - once here, not in each forked rank
    import torch.distributed.checkpoint  # noqa: F401
    from moto.server import ThreadedMotoServer
    from sharded_ranks import run_ranks

    import dask_ddp  # noqa: F401

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
        result = run_ranks(2, _bench, endpoint, "bench", args.gib, args.pairs, timeout=3600)[0]
        one = run_ranks(1, one_process, endpoint, "bench", args.pairs, timeout=1800)[0]
    finally:
        server.stop()
    text = report(result, one, args.gib)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

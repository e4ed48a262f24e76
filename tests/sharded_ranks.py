"""Run a function on N forked gloo ranks (no Dask): the fast path of the sharded-checkpoint tests.

Runs in: the test process and its forked rank processes.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
import traceback

__all__ = ["run_ranks"]


def _child(rank: int, world: int, port: int, out: str, fn, args) -> None:
    import torch
    import torch.distributed as dist

    # The test process may have run torch ops on OpenMP threads (an earlier test in the same xdist worker): GNU
    # OpenMP's team does not survive fork, and the child's first parallel op would wait on it forever (seen in
    # FSDP's new_zeros). One thread: torch runs its ops inline, as DataLoader workers do for the same reason.
    torch.set_num_threads(1)
    code = 0
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        value = fn(rank, world, *args)
        result = ("ok", value)
    except BaseException as exc:  # noqa: BLE001 - handed back to the test
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        code = 1
    try:
        with open(out, "wb") as f:
            pickle.dump(result, f)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os._exit(code)


def run_ranks(world: int, fn, *args, timeout: float = 120, lost_ok: bool = False) -> list:
    """``fn(rank, world, *args)`` on ``world`` forked processes in one gloo group; their return values by rank.

    Raises AssertionError with every failing rank's traceback; kills what is left after ``timeout``. With
    ``lost_ok``, a rank that died without a result (``kill -9``) gives None instead.
    """
    import torch.distributed as dist

    ctx = multiprocessing.get_context("fork")
    server = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        outs = [f"{tmp}/out-{r}" for r in range(world)]
        procs = [ctx.Process(target=_child, args=(r, world, server.port, outs[r], fn, args)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join(timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        results = []
        for r, path in enumerate(outs):
            if not os.path.exists(path):
                lost = f"rank {r} left no result (exit code {procs[r].exitcode})"
                results.append(("ok", None) if lost_ok else ("error", lost))
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    del server
    errors = [f"rank {r}: {v}" for r, (kind, v) in enumerate(results) if kind == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [v for _, v in results]

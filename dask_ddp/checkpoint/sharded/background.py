"""Async sharded saves: stage to reused host buffers, upload in a background thread, one in flight at most.

Runs in: the rank process.

``save_sharded(..., async_save=True)`` copies the state off the GPU into host
buffers that are kept and reused by the next save of the same shapes (pinned
when CUDA is up), then returns; a thread uploads and commits it over a gloo
process group of its own (:func:`control_group`), so its collectives never
interleave with training's. Threads, not a process: the upload is I/O that
releases the GIL, and a thread reads the staged buffers without a copy.

At most one save is in flight: the next ``save_sharded`` (or ``load_sharded``)
waits for it first and the time waited goes into the save's telemetry
(``waited_s``). A failed upload is kept and raised by the next
``save_sharded``, ``load_sharded``, ``wait_sharded`` or ``report()`` (its text
names the rank and the key); a stalled one fails after
``ddp.checkpoint.upload-timeout`` seconds. Each save's figures (stall, upload
time, bytes, MB/s) are appended to :data:`SAVES` for the rank's telemetry.
"""

from __future__ import annotations

import collections
import threading
import time

__all__ = ["stage", "submit", "wait_previous", "raise_failed", "control_group", "upload_timeout", "record", "SAVES",
           "FAILED"]

SAVES: collections.deque = collections.deque(maxlen=100)  # the latest saves' figures, for telemetry
FAILED: list = [None]  # the failure of the latest background save, until raised (report() checks it: one load)


class _State:
    thread: threading.Thread | None = None
    buffers: dict | None = None
    layout: object = None
    group: tuple | None = None  # (the default group it was made for, the gloo group)


_S = _State()


def upload_timeout() -> float | None:
    """``ddp.checkpoint.upload-timeout`` in seconds (None: no deadline)."""
    import dask.config

    value = dask.config.get("ddp.checkpoint.upload-timeout", None)
    return None if value is None else float(value)


def control_group():
    """A gloo group of all ranks for checkpoint collectives (made once, on the first call of every rank), or None
    outside a process group. Saves in the background use it, so they never interleave with training's."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if _S.group is None or _S.group[0] is not world:
        _S.group = (world, dist.new_group(backend="gloo"))
    return _S.group[1]


def stage(flat: dict) -> dict:
    """A host copy of ``flat`` in buffers reused from the last save of the same layout."""
    import torch
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    layout = _layout(flat)
    if _S.buffers is None or _S.layout != layout:
        pin = torch.cuda.is_available() and torch.cuda.is_initialized()
        _S.buffers, _S.layout = _create_cpu_state_dict(flat, pin_memory=pin), layout
    out = _copy_state_dict(flat, _S.buffers)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return out


def _layout(flat: dict):
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    items, _ = flatten_state_dict(flat)
    return tuple((k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, type(v).__name__)
                 for k, v in sorted(items.items()))


def submit(fn, *, step: int, stall: float, waited: float) -> None:
    """Run ``fn()`` (returning its ShardWriter) in the background; keep its failure for the next call."""
    def run():
        try:
            writer = fn()
            record(step, writer, stall=stall, waited=waited, background=True)
        except BaseException as exc:  # noqa: BLE001 - kept and raised on the training thread
            FAILED[0] = exc

    _S.thread = threading.Thread(target=run, name=f"dask-ddp-save-{step}", daemon=True)
    _S.thread.start()


def wait_previous() -> float:
    """Wait for the save in flight; raise its failure; return the seconds waited."""
    started = time.perf_counter()
    thread = _S.thread
    if thread is not None:
        thread.join()
        _S.thread = None
    raise_failed()
    return time.perf_counter() - started


def raise_failed() -> None:
    """Raise the failure of a finished background save, once (nothing if none); never waits."""
    error = FAILED[0]
    if error is not None and (_S.thread is None or not _S.thread.is_alive()):
        FAILED[0] = None
        raise error


def record(step: int, writer, *, stall: float, waited: float, background: bool) -> None:
    """Append one save's figures to :data:`SAVES` (seconds, bytes, MB/s)."""
    stats = writer.stats
    upload = stats.get("upload_s", 0.0)
    SAVES.append({"step": step, "stall_s": stall, "waited_s": waited, "upload_s": upload,
                  "bytes": int(stats.get("bytes", 0)), "files": int(stats.get("files", 0)),
                  "mb_s": (stats.get("bytes", 0) / 1e6 / upload) if upload > 0 else None,
                  "async": background, "time": time.time()})

"""The reading side of sharded checkpoints: torch DCP's ``StorageReader`` over any fsspec URL.

Runs in: the rank process (and one process exporting a checkpoint).

Each rank reads only the items its shards need, grouped by file: a file it
needs most of (``whole_file_share``, half by default) in one GET
(:func:`dask_ddp.storage.read_whole`, the fastest path on S3), else the items'
byte ranges; files in parallel threads. Each item's CRC-32 is checked before it
lands in the state; a mismatch or a missing file raises :class:`~.writer.ShardError` naming the rank and the key.

A CRC-32 proves nothing against whoever can write the folder (it lives in
``.metadata``, theirs to write too): a non-tensor item is unpickled here with
``weights_only=True`` (:mod:`.values`) and handed to the planner
as a value, never as bytes that DCP's planner would unpickle with
``weights_only=False``; an item the safe loader refuses raises ``ShardError``
naming the rank, the URL, the key and what to do, and nothing of it runs.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import threading
import time
import zlib

from dask_ddp import storage
from dask_ddp.checkpoint.sharded import values as dcp_values
from dask_ddp.checkpoint.sharded import writer as dcp_storage
from dask_ddp.checkpoint.sharded.writer import ShardError, with_retries

__all__ = ["ShardReader"]


@functools.cache
def _quiet_readonly_views() -> None:
    """torch warns once a process when a tensor views read-only bytes; the reader's views are only copied from
    (into the state's own tensors), so spend that one warning here, silenced, instead of copying every file."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.frombuffer(bytes(4), dtype=torch.uint8)


class ShardReader:
    """DCP ``StorageReader`` for one committed step folder; ``metadata`` is its decoded ``.metadata``."""

    def __init__(self, fs, folder_path: str, url: str, metadata, *, rank: int = 0, threads: int = 4,
                 options: dict | None = None, whole_file_share: float = 0.5):
        self.fs, self.path, self.url, self.metadata, self.rank = fs, folder_path, url, metadata, rank
        self.threads, self.options, self.whole_file_share = threads, options or {}, whole_file_share
        self.stats = {"bytes": 0, "download_s": 0.0}
        _quiet_readonly_views()

    def reset(self, checkpoint_id=None) -> None:
        self.stats = {"bytes": 0, "download_s": 0.0}

    def read_metadata(self, *args, **kwargs):
        return self.metadata

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def read_data(self, plan, planner):
        from torch.futures import Future

        started = time.perf_counter()
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].file, []).append(req)
        lock = threading.Lock()
        with cf.ThreadPoolExecutor(max(1, min(self.threads, len(per_file) or 1))) as pool:
            for fut in [pool.submit(self._read_file, name, reqs, planner, lock) for name, reqs in per_file.items()]:
                fut.result()
        self.stats["download_s"] += time.perf_counter() - started
        fut = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, name: str, reqs: list, planner, lock) -> None:
        items = {req.storage_index: self.storage_data[req.storage_index] for req in reqs}
        spans = sorted({(it.offset, it.length) for it in items.values()})
        needed = sum(length for _, length in spans)
        size = max((o + n for o, n in spans), default=0)
        path = f"{self.path}/{name}"
        try:
            if needed >= self.whole_file_share * size:  # views of the bytes read: no copy (tensors only read them)
                whole = memoryview(with_retries(lambda: storage.read_whole(self.fs, path)))
                chunk: dict = {span: whole[span[0]:span[0] + span[1]] for span in spans}
            else:
                chunk = {span: with_retries(functools.partial(self.fs.cat_file, path, start=span[0],
                                                              end=span[0] + span[1])) for span in spans}
        except FileNotFoundError:
            raise ShardError(f"rank {self.rank}: {self.url}/{name} is missing although its step is committed: it "
                             "was deleted (keep= pruning by another job, or by hand); load another step=...") from None
        except Exception as exc:  # noqa: BLE001 - named and re-raised
            raise dcp_storage.named(exc, self.rank, f"{self.url}/{name}", "reading", self.options) from None
        self.stats["bytes"] += sum(len(c) for c in chunk.values())
        for req in reqs:
            self._land(req, items[req.storage_index], chunk[(items[req.storage_index].offset,
                                                            items[req.storage_index].length)], planner, lock)

    def _land(self, req, item: dcp_storage.Item, data, planner, lock) -> None:
        import torch
        from torch.distributed._shard._utils import narrow_tensor_by_index
        from torch.distributed.checkpoint.planner import LoadItemType

        if len(data) != item.length or zlib.crc32(data) != item.crc:
            raise ShardError(f"rank {self.rank}: {self.url}/{item.file} bytes {item.offset}-"
                             f"{item.offset + item.length} ({req.storage_index.fqn}) fail their CRC-32 check: the "
                             "object was changed or is corrupt; load another step=...")
        if req.type == LoadItemType.BYTE_IO:
            value = self._value(req, item, data)
            with lock:  # the planner's bookkeeping is not thread-safe
                dcp_values.hand_over(planner, req, value)
            return
        dtype = getattr(torch, str(item.dtype), None)
        if not isinstance(dtype, torch.dtype):
            raise ShardError(f"rank {self.rank}: {self.url}/.metadata gives {req.storage_index.fqn} the dtype "
                             f"{str(item.dtype)[:40]!r}, which is not a torch dtype: the checkpoint is corrupt or was "
                             "changed; load another step=...")
        tensor = torch.frombuffer(data, dtype=dtype) if item.length else torch.empty(0, dtype=dtype)
        tensor = narrow_tensor_by_index(tensor.reshape(item.shape), req.storage_offsets, req.lengths)
        with lock:
            target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise ShardError(f"rank {self.rank}: {req.storage_index.fqn} has shape {tuple(tensor.size())} in "
                             f"{self.url} but {tuple(target.size())} here: the checkpoint was made with "
                             "another model")
        target.copy_(tensor)  # each request lands in a target of its own: no lock needed for the copy
        with lock:
            planner.commit_tensor(req, target)

    def _value(self, req, item: dcp_storage.Item, data):
        """A non-tensor item's value, read with ``weights_only=True``; a refusal is a ShardError naming the key."""
        try:
            return dcp_values.load(bytes(data))
        except dcp_values.Refused as exc:
            raise ShardError(
                f"rank {self.rank}: {self.url}/{item.file} item {req.storage_index.fqn!r} {exc.reason}, so it was "
                "not loaded (nothing in it ran). Whoever can write that folder may have planted code there: do not "
                "use this step unless you trust them and know what wrote it. Load another step (step=...; dask-ddp "
                "export: --step N), or, for a type of your own in a checkpoint you trust, register it with "
                f"{dcp_values.HOW_TO_ALLOW}") from None

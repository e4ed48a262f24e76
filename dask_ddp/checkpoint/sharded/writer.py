"""The storage layer under sharded checkpoints: torch DCP's ``StorageWriter``/``StorageReader`` on any fsspec URL.

Runs in: the rank process (and one process exporting or inspecting a checkpoint).

Why not torch's ``FsspecWriter``: it assumes that creating a file is atomic
(on S3 it is not), it returns before knowing that the bytes arrived (the
silent loss of pytorch #183878), and it writes no commit marker. This writer:

- writes each rank's items as raw tensor bytes into files of at most
  ``max_file_bytes`` each, uploaded by parallel threads, each file in one PUT
  from memory (a save needs about ``threads x max_file_bytes`` of memory beyond
  the tensors themselves; an item bigger than that gets a file of its own,
  streamed as a multipart upload in parts of ``block_size``), named with a
  4-hex-digit hash first so that many ranks spread over S3's key partitions;
- records each item's offset, length, dtype, shape and CRC-32, and each
  file's size and CRC-32; refuses a non-tensor value that ``torch.load(weights_only=True)``
  could not read back (:mod:`.values`: loads read no other way);
- closes (local disk: fsyncs) every file and checks its size on the store
  before it reports the item written; a transient failure (503 SlowDown, 5xx,
  a network error: :mod:`dask_ddp.storage.transient`) is retried with exponential
  backoff and jitter; an upload that outlives the
  deadline fails naming the rank and the key;
- leaves the commit to :mod:`.folder`: the coordinator
  (after every rank's writes came back, i.e. all ranks agree) checks every
  file, writes ``.metadata`` and ``manifest.json`` and then the marker.

Every save attempt writes to a folder of its own (``step-N-<8 hex>``, chosen
by the coordinator), so a torn attempt never mixes with a committed one. The
reader (:mod:`.reader`) reads a whole file in one GET when it needs most of it, else
byte ranges, and checks each item's CRC-32 before it lands in the state.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import io
import os
import threading
import time
import zlib
from typing import Any, Callable

from dask_ddp import storage
from dask_ddp.checkpoint.sharded import values as dcp_values
from dask_ddp.storage import transient

__all__ = ["ShardWriter", "ShardError", "Item", "file_name", "FAULTS", "with_retries", "throttled", "fault"]

# test hook: called as FAULTS[0](point, info) at each step of a save, may raise to cut the save there
FAULTS: list[Callable[[str, dict], None] | None] = [None]


class ShardError(OSError):
    """A shard could not be written, verified or read: names the rank, the key and what to do."""


@dataclasses.dataclass(frozen=True)
class Item:
    """Where one DCP item lives: its file (relative to the step folder), byte range, dtype, shape, CRC-32."""
    file: str
    offset: int
    length: int
    dtype: str | None  # None: bytes (torch.save of a non-tensor value)
    shape: tuple
    crc: int


def fault(point: str, **info) -> None:
    """Run the test hook at ``point`` (nothing without one)."""
    hook = FAULTS[0]
    if hook is not None:
        hook(point, info)


def file_name(step: int, rank: int, index: int) -> str:
    """A shard's name: a hash prefix first (S3 partitions keys by prefix), then what it is."""
    tag = hashlib.sha1(f"{step}/{rank}/{index}".encode()).hexdigest()[:4]
    return f"{tag}-rank-{rank:05d}-{index:03d}.distcp"


def throttled(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it chains) is an object store asking to slow down or failing on its side
    (:func:`dask_ddp.storage.transient.throttled`). Raises nothing."""
    return transient.throttled(exc)


def with_retries(fn: Callable[[], Any], *, tries: int = 6) -> Any:
    """``fn()``, ``tries`` calls at most, again after a transient error (throttled, 5xx, network) with backoff:
    :func:`dask_ddp.storage.transient.retrying`. Raises what the last call raised."""
    return transient.retrying(fn, tries=tries)


def _tensor_bytes(tensor) -> tuple[memoryview, str, tuple]:
    import torch

    t = tensor.detach()
    if hasattr(t, "to_local"):  # a DTensor resolved whole (not expected: DCP hands out local shards)
        t = t.to_local()
    t = t.cpu().contiguous()
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return memoryview(flat.numpy()).cast("B"), str(t.dtype).removeprefix("torch."), tuple(t.shape)


class _Upload:
    """Write one shard file from a list of items; return their ``Item`` records and the file's size and CRC."""

    def __init__(self, writer: "ShardWriter", folder: str, name: str, items: list, planner, size: int):
        self.w, self.folder, self.name, self.items, self.planner = writer, folder, name, items, planner
        self.path = f"{writer.root}/{folder}/{name}"
        # an object store takes a file of at most max_file_bytes in one PUT from memory (no multipart upload to
        # assemble); a bigger one (a single item over the bound) is streamed in parts of block_size
        self.buffered = not storage.is_local(writer.fs) and size <= writer.max_file_bytes

    def run(self) -> tuple[list, int, int]:
        return with_retries(self._once)

    def _open(self):
        if storage.is_local(self.w.fs):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            return open(self.path, "wb")
        if self.buffered:
            return _Buffered(self.w.fs, self.path)
        return self.w.fs.open(self.path, "wb", block_size=self.w.block_size)

    def _once(self) -> tuple[list, int, int]:
        from torch.distributed.checkpoint.planner import WriteItemType

        fault("file-open", rank=self.w.rank, file=self.name)
        records, offset, crc = [], 0, 0
        f = self._open()
        try:
            for item in self.items:
                data = self.planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    raw, dtype, shape = memoryview(data.getvalue()), None, ()
                else:
                    raw, dtype, shape = _tensor_bytes(data)
                item_crc = zlib.crc32(raw)
                f.write(raw)
                crc = zlib.crc32(raw, crc)
                records.append((item, Item(self.name, offset, len(raw), dtype, shape, item_crc)))
                offset += len(raw)
                fault("item-written", rank=self.w.rank, file=self.name, bytes=offset)
            if storage.is_local(self.w.fs):
                f.flush()
                os.fsync(f.fileno())
            fault("file-close", rank=self.w.rank, file=self.name)
        except BaseException:
            _abandon(f)  # never complete a partial object: S3 would show it whole
            raise
        f.close()
        self.w.check_size(f"{self.folder}/{self.name}", offset)
        return records, offset, crc


class _Buffered(io.BytesIO):
    """A file in memory that becomes one object, in one PUT, when closed; ``discard`` drops it."""

    def __init__(self, fs, path: str):
        super().__init__()
        self.fs, self.path = fs, path

    def close(self) -> None:
        if not self.closed:
            self.fs.pipe_file(self.path, self.getvalue())  # bytes: botocore takes no memoryview
        super().close()

    def discard(self) -> None:
        super().close()


def _abandon(f) -> None:
    discard = getattr(f, "discard", None)  # fsspec's buffered files: drop the buffer, abort a multipart upload
    try:
        if discard is not None:
            discard()
        else:
            f.close()
    except Exception:  # noqa: BLE001, S110 - the original error is the one to report
        pass


class ShardWriter:
    """DCP ``StorageWriter`` for one step of a sharded checkpoint (see the module's docs).

    ``root`` is the checkpoint folder's path in ``fs``; ``commit(folder, metadata, files)`` is called by the
    coordinator in ``finish`` once every rank's files are verified; ``check_step()`` by the coordinator before
    any rank writes (it raises, e.g., FileExistsError for a committed step: every rank then gets the error).
    """

    def __init__(self, fs, root: str, url: str, step: int, rank: int, *, commit: Callable, check_step: Callable,
                 timeout: float | None = None, threads: int = 4, max_file_bytes: int = 64 << 20,
                 block_size: int = 32 << 20, options: dict | None = None):
        self.fs, self.root, self.url, self.step, self.rank = fs, root, url, step, rank
        self.commit_fn, self.check_step = commit, check_step
        self.timeout, self.threads, self.max_file_bytes, self.block_size = timeout, threads, max_file_bytes, block_size
        self.options = options or {}
        self.stats = {"bytes": 0, "files": 0, "upload_s": 0.0}
        self.current = threading.local()

    # --- StorageWriter ---
    def reset(self, checkpoint_id=None) -> None:
        self.stats = {"bytes": 0, "files": 0, "upload_s": 0.0}

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans: list) -> list:
        self.check_step()
        self.folder = folder = f"step-{self.step:09d}-{os.urandom(4).hex()}"
        return [dataclasses.replace(p, storage_data={"folder": folder, "rank": i}) for i, p in enumerate(plans)]

    def write_data(self, plan, planner):
        from torch.distributed.checkpoint.storage import WriteResult
        from torch.futures import Future

        self.folder, self.rank = folder, rank = plan.storage_data["folder"], plan.storage_data["rank"]
        dcp_values.check_items(planner, plan.items, rank)  # a value weights_only=True could not read back: refused
        started = time.perf_counter()
        uploads = [_Upload(self, folder, file_name(self.step, rank, i), group, planner, size)
                   for i, (group, size) in enumerate(self._groups(plan.items))]
        results = []
        for records, size, crc in self._run_all(uploads):
            self.stats["bytes"] += size
            results += [WriteResult(index=item.index, size_in_bytes=rec.length,
                                    storage_data=rec) for item, rec in records]
            results.append(_file_record(records, size, crc))
        self.stats["files"] = len(uploads)
        self.stats["upload_s"] = time.perf_counter() - started
        fut = Future()
        fut.set_result([r for r in results if r is not None])
        return fut

    def finish(self, metadata, results: list) -> None:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        files: dict[str, dict] = {}
        storage_md = {}
        for rank, per_rank in enumerate(results):
            for wr in per_rank:
                if isinstance(wr.index, MetadataIndex) and wr.index.fqn.startswith(_FILE_KEY):
                    files[wr.storage_data["file"]] = {**wr.storage_data, "rank": rank}
                else:
                    storage_md[wr.index] = wr.storage_data
        metadata.storage_data = storage_md
        self.commit_fn(self.folder, metadata, files)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def storage_meta(self):
        return None

    # --- helpers ---
    def _groups(self, items: list) -> list[tuple[list, int]]:
        """(items, bytes) of each file: files of at most max_file_bytes (bigger only for one item over it), at least
        one; the biggest items first, each into the file with the fewest bytes so far."""
        def size(item):
            td = item.tensor_data
            if td is None:
                return 1 << 10
            n = 1
            for s in td.chunk.sizes:
                n *= s
            return n * _itemsize(td.properties.dtype)

        groups: list[list] = []
        loads: list[int] = []
        for item in sorted(items, key=size, reverse=True):
            fits = [i for i, load in enumerate(loads) if load + size(item) <= self.max_file_bytes]
            if fits:
                i = min(fits, key=loads.__getitem__)
            else:
                groups.append([])
                loads.append(0)
                i = len(groups) - 1
            groups[i].append(item)
            loads[i] += size(item)
        return list(zip(groups, loads)) or [([], 0)]

    def _run_all(self, uploads: list) -> list:
        if len(uploads) == 1 and self.timeout is None:
            return [uploads[0].run()]
        pool = cf.ThreadPoolExecutor(max(1, min(self.threads, len(uploads))), thread_name_prefix="dask-ddp-upload")
        futures = {pool.submit(u.run): u for u in uploads}
        try:
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            out = []
            for fut, upload in futures.items():
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    out.append(fut.result(timeout=left))
                except cf.TimeoutError:
                    raise ShardError(f"rank {self.rank}: the upload of {self.url}/{upload.folder}/{upload.name} "
                                     f"did not finish within ddp.checkpoint.upload-timeout ({self.timeout} s): the "
                                     "store stalls or is too slow; check it, or raise the setting") from None
                except ShardError:
                    raise
                except Exception as exc:  # noqa: BLE001 - named and re-raised
                    raise named(exc, self.rank, f"{self.url}/{upload.folder}/{upload.name}", "writing",
                                 self.options) from None
            return out
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # a stalled thread is left behind, not waited for

    def check_size(self, relative: str, expected: int) -> None:
        """Raise ShardError unless the object at ``relative`` holds ``expected`` bytes on the store."""
        path = f"{self.root}/{relative}"
        fault("verify", rank=self.rank, file=relative)
        with_retries(lambda: self.fs.invalidate_cache(path))
        try:
            size = with_retries(lambda: self.fs.info(path)["size"])
        except FileNotFoundError:
            size = None
        except Exception as exc:  # noqa: BLE001 - named
            raise named(exc, self.rank, f"{self.url}/{relative}", "checking the size of", self.options) from None
        if size != expected:
            raise ShardError(f"rank {self.rank}: {self.url}/{relative} holds {size} bytes after its upload closed, "
                             f"{expected} were written: the store lost data; this step is not committed (the "
                             "previous one stays the latest): check the store and save again")


_FILE_KEY = "__dask_ddp_file__/"


def _file_record(records: list, size: int, crc: int):
    """A WriteResult carrying a file's size and CRC (removed from the metadata's items in finish)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    name = records[0][1].file if records else None
    if name is None:
        return None
    return WriteResult(index=MetadataIndex(_FILE_KEY + name), size_in_bytes=size,
                       storage_data={"file": name, "bytes": size, "crc32": crc})


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def named(exc: BaseException, rank: int, url: str, doing: str, options: dict) -> BaseException:
    """``exc`` as PermissionError / FileNotFoundError (see :func:`storage.translate`) or ShardError, naming rank
    and URL, no secret in the text."""
    mapped = storage.translate(exc, url, doing=f"{doing} it (rank {rank})", storage_options=options)
    if mapped is not None:
        return mapped
    text = storage.redact(f"rank {rank}: {doing} {url} failed: {type(exc).__name__}: {exc}", options)
    if throttled(exc):
        text += " (the store still asked to slow down after the retries with backoff)"
    if doing in ("writing", "checking the size of"):
        return ShardError(text + " — the step is not committed (the previous one stays the latest); check the "
                          "store and save again")
    return ShardError(text + " — check the store and its credentials, and try again")

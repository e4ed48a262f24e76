"""``StreamingDataset``: samples packed in shards (ours, WebDataset's, MDS, LitData), read from any fsspec URL.

Runs in: the rank process and its DataLoader workers (the dataset pickles as values: its filesystem,
fetcher and cache are opened lazily in each process).

Use :meth:`StreamingDataset.loader` (a :class:`~.loader.StreamingLoader`) for training:
it yields whole batches in the epoch's global order (:mod:`.order`), the same on every world size,
and knows its place in the epoch, which dask-ddp's checkpoints carry (:mod:`.state`). The dataset
is also a plain map-style torch dataset (``dataset[i]``) for a ``DataLoader`` with any sampler.
"""

from __future__ import annotations

import io
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

import numpy as np
import torch.utils.data

from dask_ddp import storage
from dask_ddp.data.folder_index import normalize_root
from dask_ddp.data.streaming import batch_decode
from dask_ddp.data.streaming import foreign as foreign_shards
from dask_ddp.data.streaming.cache import ShardCache
from dask_ddp.data.streaming.fetch import ShardFetcher
from dask_ddp.data.streaming.format import INDEX_NAME, ShardDataError, ShardIndex, crc32, scan_tar
from dask_ddp.data.streaming.write import parse_size

__all__ = ["StreamingDataset", "SampleDecodeError"]

logger = logging.getLogger("dask_ddp.data")
ON_ERROR = ("raise", "skip")
PREFETCH = "256MB"  # fetched ahead by each reading process: a few large shards, or many small ones
PREFETCH_MIN, PREFETCH_MAX, PREFETCH_THREADS = 2, 16, 8  # shards ahead for a size, and its threads


class SampleDecodeError(ShardDataError):
    """A sample's bytes could not be decoded (or transformed); names the shard and the sample's key."""


def _prefetch_budget(prefetch: Any) -> int | None:
    """``prefetch`` as bytes (a size), or None for a number of shards; ValueError for neither."""
    if isinstance(prefetch, int) and not isinstance(prefetch, bool) and prefetch >= 0:
        return None
    if isinstance(prefetch, str):
        try:
            return parse_size(prefetch)
        except ValueError:
            pass
    raise ValueError(f"prefetch must be a number of shards >= 0 or a size such as '256MB', got {prefetch!r}")


def _decode(data: bytes, ext: str) -> Any:
    """PIL, RGB (torchvision's ``pil_loader``; not imported from there: torchvision takes seconds to import)."""
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


class StreamingDataset(torch.utils.data.Dataset):
    """A dataset of shards at ``url``: ours (:func:`~dask_ddp.data.write_shards`), WebDataset tars, or MDS
    (Mosaic Streaming) and LitData shards as those libraries wrote them.

    Parameters
    ----------
    url : fsspec URL or local folder holding ``index.json`` and its shards, or ``*.tar`` WebDataset shards
        (then indexed once, here, by reading their headers). An MDS or LitData ``index.json`` is read with
        each shard's offset table; a sample is then the image field of a record (a field named ``image``,
        ``img``, ``jpg`` ... encoded ``jpeg``, ``png`` or ``bytes``) and its class the int field named
        ``label``, ``cls``, ``class`` or ``target`` (-1 without one); keys are ``<shard>#<k>``.
    shuffle, seed : the epoch's order (see ``dask_ddp.data.streaming.order``); the same seed and epoch give
        the same global order at any world size and number of DataLoader workers.
    transform, target_transform : applied to the decoded sample and to its class. A ``transform`` that is
        ``ToTensor`` (or a ``Compose`` starting with it) with the default decoder makes the loader decode a
        step's JPEGs in one ``decode_jpeg`` call, bitwise the same tensors (``dask_ddp.data.streaming.batch_decode``;
        ``batched`` is then True); any other transform gets PIL images.
    decoder : ``decoder(data: bytes, ext: str)`` -> sample; default: PIL, RGB (as ``ImageFolder``).
    cache_dir, cache_limit : a node-local cache of whole shards shared by this user's processes of a host
        (``dask_ddp.data.streaming.cache``), at most ``cache_limit`` bytes; None: no cache. The shards are kept
        in ``<cache_dir>/dask-ddp-<uid>`` (``0700``, files ``0600``): another local user can neither read nor
        plant one, and ``cache_dir`` itself may be shared by users.
    storage_options : fsspec options (s3: ``key``, ``secret``, ``client_kwargs``).
    buffer : the in-buffer shuffle's window, in samples.
    on_error : ``"raise"`` a :class:`~dask_ddp.data.SampleDecodeError` for a sample that fails to decode, or
        ``"skip"`` it (counted in the loader's ``skipped``).
    retries : attempts after a throttled or failed GET, with exponential backoff.
    prefetch : what is fetched ahead in background threads: a size (``"256MB"``, the default: as many shards as
        fit in it, at the dataset's mean shard size, between 2 and 16; the threads at most 8) or an int, that
        many shards (and threads). ``ahead`` and ``threads`` say what it came to.

    Raises
    ------
    FileNotFoundError
        No such URL, or neither ``index.json`` nor ``*.tar`` files there (the message names it).
    ShardDataError
        The index is not valid, a WebDataset tar is corrupt or truncated (named), MDS or LitData shards are
        compressed or encrypted, or hold no encoded image field.
    PermissionError
        The credentials were refused (the URL named, never the secret).
    ValueError
        Bad ``on_error``, ``cache_limit``, ``buffer``, ``seed``, ``prefetch``.
    """

    def __init__(self, url: str | os.PathLike, *, shuffle: bool = True, seed: int = 0,
                 transform: Callable | None = None, target_transform: Callable | None = None,
                 decoder: Callable[[bytes, str], Any] | None = None, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int = 16 << 30, storage_options: Mapping[str, Any] | None = None,
                 buffer: int = 4096, on_error: str = "raise", retries: int = 5,
                 prefetch: int | str = PREFETCH) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        if cache_limit < 0 or buffer < 1 or seed < 0 or retries < 0:
            raise ValueError(f"cache_limit, seed, retries must be >= 0 and buffer >= 1, got {cache_limit}, "
                             f"{seed}, {retries}, {buffer}")
        budget = _prefetch_budget(prefetch)  # then ahead, threads: shards fetched ahead by each reading process
        self.url, self.storage_options = normalize_root(url), dict(storage_options or {})
        self.shuffle, self.seed, self.buffer, self.on_error = shuffle, seed, buffer, on_error
        self.transform, self.target_transform, self.decoder = transform, target_transform, decoder or _decode
        # ToTensor first and PIL's decoding: a step's JPEGs decoded in one call, the same tensors (batch_decode)
        self.batched, self._after_tensor = batch_decode.split_to_tensor(transform) if decoder is None else (False,
                                                                                                          None)
        self.cache_dir = os.fspath(cache_dir) if cache_dir is not None else None
        self.cache_limit, self.retries, self.prefetch = int(cache_limit), retries, prefetch
        self.layout: foreign_shards.Layout | None = None  # set for MDS or LitData shards
        self.index = self._read_index()
        self.shard_sizes = np.bincount(self.index.shard, minlength=len(self.index.shards))
        if budget is None:
            self.ahead, self.threads = int(prefetch), max(1, int(prefetch))
        else:  # a size: as many shards as fit, at the mean of the shard sizes the index knows (else 4 ahead)
            known = [n for n in self.index.sizes if n > 0]
            mean = max(1, sum(known) // len(known)) if known else max(1, budget // 4)
            self.ahead = min(PREFETCH_MAX, max(PREFETCH_MIN, budget // mean))
            self.threads = min(self.ahead, PREFETCH_THREADS)
        self._check_grouped()
        self._fetcher: ShardFetcher | None = None
        self._pid: int | None = None
        self._columns: dict[str, list] | None = None
        self._last = -2  # the last sample dataset[i] read (in order or not)

    @property
    def classes(self) -> list[str]:
        """The class names, as ``ImageFolder``'s ``classes`` (shards written from an image folder; else empty)."""
        return list(self.index.names)

    @property
    def class_to_idx(self) -> dict[str, int]:
        """``{class name: class index}``, as ``ImageFolder``'s (empty when the shards hold no names)."""
        return {name: i for i, name in enumerate(self.index.names)}

    @property
    def fingerprint(self) -> str:
        """The index's fingerprint (what a saved position belongs to)."""
        return self.index.fingerprint

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        """``(sample, class)`` of sample ``i``.

        Read in order (``i`` is 0, or past the last sample read and in its shard or the next, as under a
        sequential sampler, also split over DataLoader workers), it fetches the whole shard, kept for the next
        samples; read out of order (a random sampler), it reads only the sample's bytes (a ranged GET) unless
        its shard is held already. Raises as :meth:`load`.
        """
        i, last, shard = int(i), self._last, self.columns["shard"]
        sequential = i == 0 or (0 <= last < i and shard[i] - shard[last] <= 1)
        self._last = i
        return self.load(i, ranged=not sequential)

    def loader(self, batch_size: int, **kwargs: Any) -> Any:
        """A :class:`~dask_ddp.data.StreamingLoader` over this dataset; arguments as there."""
        from dask_ddp.data.streaming.loader import StreamingLoader

        return StreamingLoader(self, batch_size, **kwargs)

    @property
    def columns(self) -> dict[str, list]:
        """The index's ``shard``, ``offset``, ``length`` and ``classes`` as lists of ints (fast per-sample lookups)."""
        if self._columns is None:
            self._columns = {c: getattr(self.index, c).tolist() for c in ("shard", "offset", "length", "classes")}
        return self._columns

    @property
    def fetcher(self) -> Any:
        """This process's shard fetcher, made on first use (a forked child makes its own)."""
        if self._fetcher is None or self._pid != os.getpid():
            cache = ShardCache(self.cache_dir, self.cache_limit) if self.cache_dir else None
            idx = self.index
            self._fetcher = ShardFetcher(self.url, idx.shards, idx.sizes, idx.crcs, self.storage_options, cache,
                                         retries=self.retries, threads=self.threads, keep=self.ahead + 4)
            self._pid = os.getpid()
        return self._fetcher

    def load(self, i: int, shard_bytes: Any = None, ranged: bool = False) -> Any:
        """Sample ``i`` decoded and transformed, as ``(sample, class)``; None when skipped (``on_error="skip"``).

        Its bytes come from ``shard_bytes`` (its shard's: bytes or a memory map), else from its whole shard
        fetched (and kept), or with ``ranged`` from a ranged read of them alone.
        Raises SampleDecodeError (``on_error="raise"``), ShardDataError, OSError as the fetch does.
        """
        j = self.columns["shard"][i]
        o, n = self.columns["offset"][i], self.columns["length"][i]
        if ranged and shard_bytes is None:
            blob = self.fetcher.get_range(j, o, n)
        else:
            blob = (shard_bytes if shard_bytes is not None else self.fetcher.get(j))[o:o + n]
        try:
            blob, ext, target = self._record(i, blob)
        except Exception as err:  # noqa: BLE001 - named by _failed, raised or skipped as asked
            return self._failed(i, err)
        return self._finish(i, blob, ext, target)

    def load_many(self, ids: list[int], shard_bytes: Mapping[int, Any]) -> list:
        """:meth:`load` of each of ``ids`` from its shard's bytes in ``shard_bytes``, with the step's JPEGs decoded
        in one call where the transform starts with ``ToTensor`` (:mod:`.batch_decode`: the same tensors).
        Raises as :meth:`load`."""
        if not self.batched:
            shard = self.columns["shard"]
            return [self.load(i, shard_bytes[shard[i]]) for i in ids]
        cols = self.columns
        out: list = [None] * len(ids)
        fast: list[tuple[int, int, Any, Any]] = []  # (position, sample, bytes, class) of the JPEGs
        for k, i in enumerate(ids):
            o, n = cols["offset"][i], cols["length"][i]
            try:
                blob, ext, target = self._record(i, shard_bytes[cols["shard"][i]][o:o + n])
            except Exception as err:  # noqa: BLE001 - named by _failed
                out[k] = self._failed(i, err)
                continue
            if str(ext).lower() in batch_decode.JPEG_EXTS:
                fast.append((k, i, blob, target))
            else:
                out[k] = self._finish(i, blob, ext, target)
        for (k, i, blob, target), tensor in zip(fast, batch_decode.decode_jpegs([f[2] for f in fast])):
            if isinstance(tensor, Exception):  # PIL reads what decode_jpeg cannot (CMYK), or names the error
                out[k] = self._finish(i, blob, "jpg", target)
                continue
            try:
                sample = self._after_tensor(tensor) if self._after_tensor is not None else tensor
                out[k] = (sample, self._target(target))
            except Exception as err:  # noqa: BLE001 - named by _failed
                out[k] = self._failed(i, err)
        return out

    def _record(self, i: int, blob: Any) -> tuple[Any, str, Any]:
        """``(bytes, extension, class)`` of sample ``i`` from its record's bytes ``blob``."""
        n = self.columns["length"][i]
        if len(blob) != n:
            raise EOFError(f"{n} bytes expected at offset {self.columns['offset'][i]} of the shard, found "
                           f"{len(blob)}")
        if self.layout is not None:  # an MDS or LitData record: its image and class out of its fields
            blob, ext, label = self.layout.parse(blob)
            return blob, ext, -1 if label is None else label
        return blob, self.index.ext[i], self.columns["classes"][i]

    def _finish(self, i: int, blob: Any, ext: str, target: Any) -> Any:
        """Sample ``i`` by the PIL path (decoder, transform): ``(sample, class)``, or as :meth:`_failed`."""
        try:
            sample = self.decoder(blob, ext)
            if self.transform is not None:
                sample = self.transform(sample)
            return sample, self._target(target)
        except Exception as err:  # noqa: BLE001 - named by _failed
            return self._failed(i, err)

    def _target(self, target: Any) -> Any:
        return self.target_transform(target) if self.target_transform is not None else target

    def _failed(self, i: int, err: Exception) -> Any:
        """None for a sample skipped (``on_error="skip"``, logged), else raise SampleDecodeError naming it."""
        idx, j = self.index, self.columns["shard"][i]
        if self.on_error == "skip":
            logger.warning("skipping sample %s of shard %s: %s: %s", idx.keys[i], self.fetcher.url(j),
                           type(err).__name__, err)
            return None
        raise SampleDecodeError(
            f"sample {idx.keys[i]!r} (#{i}) of shard {self.url}/{idx.shards[j]} failed to decode: "
            f"{type(err).__name__}: {err}. Fix or drop it, or pass on_error='skip' to skip such samples",
            shard=f"{self.url}/{idx.shards[j]}", key=idx.keys[i]) from err

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_fetcher=None, _pid=None, _columns=None)
        return state

    def _read_index(self) -> ShardIndex:
        fs, root = storage.open_fs(self.url, self.storage_options)
        path = f"{root.rstrip('/')}/{INDEX_NAME}"
        try:
            data = storage.call(lambda: fs.cat_file(path), f"{self.url}/{INDEX_NAME}", doing="reading the index",
                                storage_options=self.storage_options)
        except FileNotFoundError:
            return self._scan_webdataset(fs, root)
        try:  # parsed once: the index of a million samples is tens of megabytes of JSON
            doc = json.loads(data)
        except ValueError:
            doc = None  # from_json below names what is wrong with it
        fmt = foreign_shards.detect(doc)
        if fmt is not None:
            base = root.rstrip("/")
            index, self.layout = foreign_shards.read_index(fmt, doc, self.url, lambda name, a, b: (
                storage.call(lambda: fs.cat_file(f"{base}/{name}", start=a, end=b), f"{self.url}/{name}",
                             doing="reading its offset table", storage_options=self.storage_options)))
            return index
        return ShardIndex.from_json(doc if isinstance(doc, dict) else data, f"{self.url}/{INDEX_NAME}")

    def _scan_webdataset(self, fs: Any, root: str) -> ShardIndex:
        try:
            names = sorted(p.rsplit("/", 1)[-1] for p in storage.call(
                lambda: fs.ls(root, detail=False), self.url, doing="listing it", storage_options=self.storage_options)
                if p.endswith(".tar"))
        except FileNotFoundError:
            names = []
        if not names:
            raise FileNotFoundError(f"{storage.redact(self.url, self.storage_options)} has no {INDEX_NAME} and no "
                                    "*.tar shards (or does not exist): build shards with dask_ddp.data.write_shards, "
                                    "or point at a folder of WebDataset tars")
        with ThreadPoolExecutor(8) as pool:
            blobs = list(pool.map(lambda n: storage.read_whole(fs, f"{root.rstrip('/')}/{n}"), names))
        cols: dict[str, list] = {k: [] for k in ("keys", "classes", "shard", "offset", "length", "ext")}
        for j, (name, data) in enumerate(zip(names, blobs)):
            for s in scan_tar(data, f"{self.url}/{name}"):
                for col, v in (("keys", s["key"]), ("classes", s["cls"]), ("shard", j), ("offset", s["offset"]),
                               ("length", s["length"]), ("ext", s["ext"])):
                    cols[col].append(v)
        return ShardIndex.build(names, [len(b) for b in blobs], [crc32(b) for b in blobs], **cols)

    def _check_grouped(self) -> None:
        """Samples are numbered shard after shard (the order's contract); raise ShardDataError otherwise."""
        sh = self.index.shard
        if len(sh) and np.any(np.diff(sh) < 0):
            raise ShardDataError(f"{self.url}/{INDEX_NAME} does not list its samples shard after shard: rebuild it "
                             "with write_shards", shard=f"{self.url}/{INDEX_NAME}")

    def __repr__(self) -> str:
        return (f"StreamingDataset({self.url!r}, samples={len(self)}, shards={len(self.index.shards)}, "
                f"shuffle={self.shuffle}, seed={self.seed}" + (f", cache_dir={self.cache_dir!r})" if self.cache_dir
                                                               else ")"))

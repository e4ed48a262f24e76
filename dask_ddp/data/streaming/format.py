"""The shard format: plain tar files in WebDataset layout plus one index, and the errors bad shards give.

Runs in: wherever shards are written (Dask workers, through :mod:`.write`) or read (the rank
process and its DataLoader workers, through :mod:`.dataset`).

A dataset is a folder of ``shard-NNNNN.tar`` files, each holding ``<key>.<ext>`` (the sample's bytes)
and ``<key>.cls`` (its class as text) per sample, readable by any tar or WebDataset reader, and
``index.json`` written last (its presence means the build is complete): every sample's key, class,
shard, byte offset and length, and every shard's size and CRC-32. A folder of someone else's
WebDataset tars has no index: :func:`scan_tar` builds the same one from the tar headers.
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import tarfile
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

__all__ = ["ShardDataError", "ShardIndex", "INDEX_NAME", "FORMAT", "pack_tar", "scan_tar", "crc32", "check_shard_name"]

INDEX_NAME = "index.json"
FORMAT = "dask-ddp-shards/1"
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "pgm", "tif", "tiff", "gif")


class ShardDataError(OSError):
    """A shard, its index or one of its samples is unusable: names the shard (and the sample) and what to do.

    Attributes: ``shard`` (URL or name, may be ``""``) and ``key`` (the sample's key, may be ``""``).
    """

    def __init__(self, message: str, *, shard: str = "", key: str = "") -> None:
        super().__init__(message)
        self.shard, self.key = shard, key

    def __reduce__(self):
        return (_rebuild, (type(self), str(self), self.shard, self.key))


def _rebuild(cls, message, shard, key):
    return cls(message, shard=shard, key=key)


def crc32(data: bytes | memoryview | mmap.mmap) -> int:
    """The CRC-32 of ``data`` (any buffer; zlib's, unsigned); raises nothing."""
    return zlib.crc32(data) & 0xFFFFFFFF


def check_shard_name(name: Any, index: str) -> str:
    """``name``, a shard's file name as the index ``index`` gives it, when it stays inside the dataset's folder.

    Shard names are joined to the dataset's root: an absolute name, a ``..`` segment or a control character
    would read outside it (``../other/x.tar``, ``/etc/passwd``). Raises :class:`ShardDataError` naming ``index``
    and the name (not a non-empty text, absolute, a ``..`` segment, a control character).
    """
    if not isinstance(name, str) or not name:
        why = "is not a file name"
    elif name.startswith(("/", "\\")):
        why = "is an absolute path"
    elif ".." in name.replace("\\", "/").split("/"):
        why = "has a '..' segment"
    elif any(ord(c) < 32 or ord(c) == 127 for c in name):
        why = "holds a control character"
    else:
        return name
    raise ShardDataError(f"{index} names the shard {name!r}, which {why}: refused, shard names are paths inside "
                         "the dataset's folder (relative, no '..' segment, no control character) and this one could "
                         "read outside it. The index was made wrong or tampered with: rebuild it with write_shards, "
                         "or get it again from its source", shard=index)


@dataclass(frozen=True)
class ShardIndex:
    """Every sample's place: columns of equal length, plus the shards' names, sizes and CRC-32s.

    ``keys[i]`` is sample i's key, ``classes[i]`` its class (-1: none), ``shard[i]`` the position of its
    shard in ``shards``, ``offset[i]``/``length[i]`` its bytes in that tar, ``ext[i]`` its extension.
    ``sizes[j]``/``crcs[j]`` are shard j's byte count and CRC-32 (-1: unknown, not checked).
    ``names[c]`` is class c's name where the source had names (an image folder's class folders), else empty.
    """

    shards: tuple[str, ...]
    sizes: tuple[int, ...]
    crcs: tuple[int, ...]
    keys: tuple[str, ...]
    classes: np.ndarray
    shard: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    ext: tuple[str, ...]
    names: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def fingerprint(self) -> str:
        """A short hash of the shards (names, sizes, CRCs) and sample count: what a saved position belongs to."""
        text = json.dumps([self.shards, self.sizes, self.crcs, len(self.keys)])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_json(self) -> bytes:
        """The index file's bytes (columns as lists); raises nothing."""
        return json.dumps({
            "format": FORMAT, "shards": list(self.shards), "sizes": list(self.sizes), "crcs": list(self.crcs),
            "keys": list(self.keys), "classes": self.classes.tolist(), "shard": self.shard.tolist(),
            "offset": self.offset.tolist(), "length": self.length.tolist(), "ext": list(self.ext),
            "names": list(self.names)}).encode()

    @classmethod
    def from_json(cls, data: bytes | dict, url: str) -> ShardIndex:
        """Parse an index file (its bytes, or the dict a caller parsed them to already); raise
        :class:`ShardDataError` naming ``url`` when it is not one or not consistent, or names a shard outside
        the dataset's folder (:func:`check_shard_name`)."""
        try:
            d = data if isinstance(data, dict) else json.loads(data)
            if d.get("format") != FORMAT:
                raise ValueError(f"format {d.get('format')!r}, expected {FORMAT!r}")
            index = cls.build(d["shards"], d["sizes"], d["crcs"], d["keys"], d["classes"], d["shard"],
                              d["offset"], d["length"], d["ext"], d.get("names", ()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ShardDataError(f"{url} is not a valid shard index ({type(err).__name__}: {err}); rebuild it with "
                             "dask_ddp.data.write_shards, or delete it to read the tars as WebDataset shards",
                             shard=url) from None
        for name in index.shards:
            check_shard_name(name, url)
        return index

    @classmethod
    def build(cls, shards: Sequence[str], sizes: Sequence[int], crcs: Sequence[int], keys: Sequence[str],
              classes: Sequence[int], shard: Sequence[int], offset: Sequence[int], length: Sequence[int],
              ext: Sequence[str], names: Sequence[str] = ()) -> ShardIndex:
        """An index from its columns; raise ValueError when their lengths or shard numbers disagree."""
        n = len(keys)
        if not (len(classes) == len(shard) == len(offset) == len(length) == len(ext) == n):
            raise ValueError("the index's sample columns differ in length")
        if not (len(shards) == len(sizes) == len(crcs)):
            raise ValueError("the index's shard columns differ in length")
        sh = np.asarray(shard, dtype=np.int64)
        if n and (sh.min() < 0 or sh.max() >= len(shards)):
            raise ValueError("a sample names a shard the index does not list")
        return cls(tuple(shards), tuple(int(s) for s in sizes), tuple(int(c) for c in crcs), tuple(keys),
                   np.asarray(classes, dtype=np.int64), sh, np.asarray(offset, dtype=np.int64),
                   np.asarray(length, dtype=np.int64), tuple(ext), tuple(str(n) for n in names))


def pack_tar(samples: Iterable[tuple[str, str, bytes, int]]) -> tuple[bytes, list[tuple[str, int, int, int, str]]]:
    """Pack ``(key, ext, data, class)`` samples into tar bytes (WebDataset layout).

    Returns the tar and, per sample, ``(key, class, offset, length, ext)`` of its data member.
    Raises ValueError for a key with ``/`` or ``.`` (WebDataset splits keys at the first dot).
    """
    buf, entries = io.BytesIO(), []
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, ext, data, cls in samples:
            if "." in key or "/" in key or not key:
                raise ValueError(f"sample key {key!r} has a '.' or '/' or is empty: keys name tar members "
                                 "'<key>.<ext>'; give keys without them")
            _add(tar, f"{key}.{ext}", data)
            entries.append((key, int(cls), buf.tell() - _padded(len(data)), len(data), ext))
            if cls >= 0:
                _add(tar, f"{key}.cls", str(int(cls)).encode())
    return buf.getvalue(), entries


def _padded(n: int) -> int:
    return (n + 511) // 512 * 512


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0  # mtime 0: the same samples give the same bytes
    tar.addfile(info, io.BytesIO(data))


def scan_tar(data: bytes, name: str) -> list[dict[str, Any]]:
    """The samples of a WebDataset tar: ``{"key", "ext", "offset", "length", "cls"}`` per sample, in tar order.

    A sample is the members sharing a key (the member name up to the first dot of its base name); its
    data is its first image member (else its first member that is not ``.cls``/``.json``), its class the
    integer in ``.cls`` (``-1`` without). Raises :class:`ShardDataError` naming ``name`` when the tar is corrupt
    or truncated.
    """
    groups: dict[str, dict[str, tuple[int, int]]] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                base = member.name.rsplit("/", 1)
                stem, _, ext = base[-1].partition(".")
                key = (base[0] + "/" + stem) if len(base) == 2 else stem
                groups.setdefault(key, {})[ext.lower()] = (member.offset_data, member.size)
    except (tarfile.TarError, EOFError) as err:
        raise ShardDataError(f"shard {name} is corrupt or truncated ({type(err).__name__}: {err}): re-copy or "
                             "rebuild it", shard=name) from None
    end = max((o + n for g in groups.values() for o, n in g.values()), default=0)
    if end > len(data):
        raise ShardDataError(f"shard {name} is truncated ({len(data)} bytes, a member ends at {end}): re-copy it",
                         shard=name)
    return [_sample(key, members, data) for key, members in groups.items()]


def _sample(key: str, members: dict[str, tuple[int, int]], data: bytes) -> dict[str, Any]:
    exts = [e for e in members if e in IMAGE_EXTS] or [e for e in members if e not in ("cls", "json", "txt")]
    ext = exts[0] if exts else next(iter(members))
    cls = -1
    if "cls" in members:
        o, n = members["cls"]
        try:
            cls = int(data[o:o + n].decode().strip() or -1)
        except ValueError:
            cls = -1
    offset, length = members[ext]
    return {"key": key, "ext": ext, "offset": offset, "length": length, "cls": cls}

"""MDS (Mosaic Streaming) and LitData shards read as they are: their index, and each sample's fields.

Runs in: the rank process and its DataLoader workers (and the client, where a dataset is opened).

Both formats store a shard as ``uint32 count``, ``uint32 offsets[count + 1]`` (absolute), then the sample
records (MDS puts its JSON config between the two). A record is a header of ``uint32`` sizes (MDS: of its
variable-size columns; LitData: of every field) followed by the fields' bytes. Opening reads each shard's
offset table (one ranged GET of ``4 * (count + 2)`` bytes); a sample's record is then read like one of ours,
and :meth:`Layout.parse` takes its image, class and key out of it. Keys are ``<shard>#<k>`` (the k-th record
of that shard). Compressed or encrypted shards, and images stored as raw pixels (MDS/LitData ``pil``), are
refused with a message that says so.
"""

from __future__ import annotations

import json
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from dask_ddp.data.streaming.format import ShardDataError, ShardIndex, check_shard_name

__all__ = ["Layout", "detect", "read_index"]

IMAGE_CODECS = {"jpeg": "jpg", "jpg": "jpg", "png": "png", "bytes": "bin"}
INT_CODECS = {"int": "<q", "int64": "<q", "int32": "<i", "int16": "<h", "uint8": "<B", "uint16": "<H",
              "uint32": "<I", "uint64": "<Q", "int8": "<b"}
IMAGE_NAMES = ("image", "img", "jpg", "jpeg", "png")
CLASS_NAMES = ("label", "cls", "class", "target", "y")
KEY_NAMES = ("key", "__key__")


@dataclass(frozen=True)
class Layout:
    """The fields of a foreign shard's records: names, codecs, fixed sizes (None: in the record's header)."""

    fmt: str
    names: tuple[str, ...]
    codecs: tuple[str, ...]
    sizes: tuple[int | None, ...]
    image: int
    label: int | None
    all_sized: bool  # LitData: every field has a size in the header; MDS: the variable-size ones only

    def parse(self, record: bytes) -> tuple[bytes, str, int | None]:
        """``(image bytes, extension, class or None)`` of one record; raises ValueError when it is cut short."""
        sized = [i for i, s in enumerate(self.sizes) if self.all_sized or s is None]
        head = 4 * len(sized)
        if len(record) < head:
            raise ValueError(f"the record holds {len(record)} bytes, less than its {head}-byte header")
        lengths = list(self.sizes)
        for k, v in zip(sized, struct.unpack(f"<{len(sized)}I", bytes(record[:head]))):
            lengths[k] = v
        starts, at = [], head
        for n in lengths:
            starts.append(at)
            at += int(n or 0)
        if at != len(record):
            raise ValueError(f"its fields add up to {at} bytes, the record holds {len(record)}")
        i = self.image
        image = bytes(record[starts[i]:starts[i] + int(lengths[i] or 0)])
        label = None
        if self.label is not None:
            j = self.label
            field = bytes(record[starts[j]:starts[j] + int(lengths[j] or 0)])
            label = int(struct.unpack(INT_CODECS[self.codecs[j]], field)[0])
        return image, IMAGE_CODECS[self.codecs[i]], label


def detect(doc: Any) -> str | None:
    """``"mds"`` or ``"litdata"`` when ``doc`` (a parsed ``index.json``) is that format's index, else None."""
    if isinstance(doc, dict) and isinstance(doc.get("shards"), list) and doc["shards"] and all(
            isinstance(s, dict) and s.get("format") == "mds" for s in doc["shards"]):
        return "mds"
    if isinstance(doc, dict) and isinstance(doc.get("chunks"), list) and isinstance(doc.get("config"), dict):
        return "litdata"
    return None


def _layout(fmt: str, names: list[str], codecs: list[str], sizes: list[int | None], url: str) -> Layout:
    lower = [n.lower() for n in names]
    image = next((i for i, n in enumerate(lower) if n in IMAGE_NAMES and codecs[i] in IMAGE_CODECS), None)
    if image is None:
        image = next((i for i, c in enumerate(codecs) if c in ("jpeg", "jpg", "png")), None)
    if image is None:
        raise ShardDataError(f"{url}: no field of {dict(zip(names, codecs))} holds an encoded image (jpeg, png or "
                             "bytes named image/img/jpg): images stored as raw pixels ('pil') are not read; write "
                             "them as 'jpeg', or convert with dask_ddp.data.write_shards", shard=url)
    label = next((i for i, n in enumerate(lower) if n in CLASS_NAMES and codecs[i] in INT_CODECS), None)
    return Layout(fmt, tuple(names), tuple(codecs), tuple(sizes), image, label, fmt == "litdata")


def _shards(fmt: str, doc: dict, url: str) -> tuple[Layout, list[tuple[str, int, int]]]:
    """The layout and ``[(file name, size or -1, samples)]`` of an MDS or LitData index."""
    refuse = "; write them uncompressed, or convert them with dask_ddp.data.write_shards"
    if fmt == "mds":
        first = doc["shards"][0]
        for s in doc["shards"]:
            if s.get("compression") or s.get("zip_data"):
                raise ShardDataError(f"{url}: MDS shard {s.get('raw_data', {}).get('basename')} is compressed "
                                     f"({s.get('compression')}): compressed shards are not read" + refuse, shard=url)
            if s.get("column_encodings") != first.get("column_encodings"):
                raise ShardDataError(f"{url}: its MDS shards differ in their columns", shard=url)
        layout = _layout(fmt, first["column_names"], first["column_encodings"], first["column_sizes"], url)
        return layout, [(s["raw_data"]["basename"], int(s["raw_data"].get("bytes", -1)), int(s["samples"]))
                        for s in doc["shards"]]
    cfg = doc["config"]
    if cfg.get("compression") or cfg.get("encryption") or cfg.get("item_loader", "PyTreeLoader") != "PyTreeLoader":
        raise ShardDataError(f"{url}: LitData chunks with compression {cfg.get('compression')!r}, encryption "
                             f"{cfg.get('encryption')!r} or item loader {cfg.get('item_loader')!r} are not read"
                             + refuse, shard=url)
    codecs = list(cfg["data_format"])
    names = [str(i) for i in range(len(codecs))]
    try:  # the pytree spec names a dict's fields, in the order of data_format
        spec = json.loads(cfg.get("data_spec") or "null")
        if isinstance(spec, list) and spec[1].get("type") == "builtins.dict":
            names = [str(n) for n in json.loads(spec[1]["context"])]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        pass
    sizes = [8 if c in ("int", "float") else None for c in codecs]  # unused: LitData sizes every field
    return _layout(fmt, names, codecs, sizes, url), [(c["filename"], int(c.get("chunk_bytes", -1)),
                                                      int(c["chunk_size"])) for c in doc["chunks"]]


def read_index(fmt: str, doc: dict, url: str, read_range: Callable[[str, int, int], bytes]) -> tuple[ShardIndex,
                                                                                                  Layout]:
    """The :class:`ShardIndex` (one sample per record, classes -1: they are read with the sample) and the
    :class:`Layout` of an MDS or LitData dataset; ``read_range(name, start, end)`` reads part of a shard.

    Raises ShardDataError naming the shard whose offset table disagrees with the index, or the index and the
    shard name that would lead outside the dataset's folder (absolute, a ``..`` segment).
    """
    try:
        layout, shards = _shards(fmt, doc, url)
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise ShardDataError(f"{url}/index.json is not a {fmt} index dask-ddp can read ({type(err).__name__}: "
                             f"{err})", shard=url) from None
    for name, _, _ in shards:  # joined to the root below: none may lead outside it
        check_shard_name(name, f"{url}/index.json")

    def table(entry: tuple[str, int, int]) -> list[int]:
        name, _, count = entry
        raw = read_range(name, 0, 4 * (count + 2))
        if len(raw) != 4 * (count + 2) or struct.unpack("<I", raw[:4])[0] != count:
            raise ShardDataError(f"shard {url}/{name} does not start with the {count} samples its index says: "
                                 "the index and the shards come from different writes", shard=f"{url}/{name}")
        return list(struct.unpack(f"<{count + 1}I", raw[4:]))

    with ThreadPoolExecutor(8) as pool:
        tables = list(pool.map(table, shards))
    cols: dict[str, list] = {k: [] for k in ("keys", "classes", "shard", "offset", "length", "ext")}
    for j, ((name, _, count), offs) in enumerate(zip(shards, tables)):
        for k in range(count):
            for col, v in (("keys", f"{name}#{k}"), ("classes", -1), ("shard", j), ("offset", offs[k]),
                           ("length", offs[k + 1] - offs[k]), ("ext", fmt)):
                cols[col].append(v)
    return ShardIndex.build([s[0] for s in shards], [s[1] for s in shards], [-1] * len(shards), **cols), layout

"""The data wing: datasets, checkpoints, storage and caches.

Runs in: the rank process and its DataLoader workers (and the client, where a user
builds a dataset or reads a checkpoint): ``S3ImageFolder`` (:mod:`.image_folder`, over
one listing :mod:`.folder_index` and an optional :mod:`.blob_cache`, in a per-user
:mod:`.private_folder`), checkpoints
(:mod:`.checkpoint`), sharded checkpoints over torch DCP (:mod:`.sharded`, with
:mod:`.sharded_state`, :mod:`.sharded_async`, :mod:`.sharded_folder`, :mod:`.sharded_export`
and the storage layer :mod:`.dcp_storage` / :mod:`.dcp_reader`, non-tensor items read safely
by :mod:`.dcp_values`) and the filesystem plumbing
they share (:mod:`.storage`, the one door to a filesystem, and :mod:`.transient`, the one rule for what is retried).

May import: :mod:`dask_ddp.wire` (and :mod:`dask_ddp.config`).

Streaming (issue 28): shards written on the cluster (:mod:`.shards_write`, format :mod:`.shards_format`),
read by ``StreamingDataset`` (:mod:`.streaming`, fetching through :mod:`.stream_fetch` and the node cache
:mod:`.stream_cache`) and its ``StreamingLoader`` (:mod:`.stream_loader`, order :mod:`.stream_order`),
whose positions checkpoints carry (:mod:`.stream_state`).

The public names are ``dask_ddp.data.S3ImageFolder``, ``FolderIndex``, ``ImageDecodeError``,
``index_folder``, ``pil_loader``, ``write_shards``, ``StreamingDataset``, ``StreamingLoader``,
``ShardDataError``, ``SampleDecodeError`` and, to decode on the GPU (:mod:`.gpu_decode`),
``encoded_bytes``, ``collate_encoded``, ``EncodedBatch`` and ``decode_images``; they are imported on first
use (torchvision takes seconds to import, and :mod:`.checkpoint` and :mod:`.storage` must not pay for it).
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker and an editor see; at run time they come from __getattr__
    from dask_ddp.data.gpu_decode import EncodedBatch, collate_encoded, decode_images, encoded_bytes
    from dask_ddp.data.image_folder import FolderIndex, ImageDecodeError, S3ImageFolder, index_folder, pil_loader
    from dask_ddp.data.shards_format import ShardDataError
    from dask_ddp.data.shards_write import write_shards
    from dask_ddp.data.stream_loader import StreamingLoader
    from dask_ddp.data.streaming import SampleDecodeError, StreamingDataset

_HOME = {"S3ImageFolder": "image_folder", "FolderIndex": "image_folder", "ImageDecodeError": "image_folder",
         "index_folder": "image_folder", "pil_loader": "image_folder", "write_shards": "shards_write",
         "StreamingDataset": "streaming", "StreamingLoader": "stream_loader", "ShardDataError": "shards_format",
         "SampleDecodeError": "streaming", "encoded_bytes": "gpu_decode", "collate_encoded": "gpu_decode",
         "decode_images": "gpu_decode", "EncodedBatch": "gpu_decode"}
__all__ = ["S3ImageFolder", "FolderIndex", "ImageDecodeError", "index_folder", "pil_loader", "write_shards",
           "StreamingDataset", "StreamingLoader", "ShardDataError", "SampleDecodeError",
           "encoded_bytes", "collate_encoded", "EncodedBatch", "decode_images"]


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The data wing: the datasets a rank trains on.

Runs in: the rank process and its DataLoader workers (and the client, where a user
builds a dataset or writes shards): ``S3ImageFolder`` (:mod:`.image_folder`, over one
listing :mod:`.folder_index` and an optional :mod:`.blob_cache`), decoding JPEGs on the
GPU (:mod:`.gpu_decode`), and streaming (:mod:`.streaming`: shards written on the cluster,
read in a global order by ``StreamingDataset`` and its resumable ``StreamingLoader``, whose
positions ride in every checkpoint). Files and URLs are opened through the one door,
:mod:`dask_ddp.storage`.

May import: :mod:`dask_ddp.checkpoint` (the streaming positions register as a checkpoint
rider), :mod:`dask_ddp.storage` and :mod:`dask_ddp.wire` (and :mod:`dask_ddp.config`).

The public names are ``dask_ddp.data.S3ImageFolder``, ``FolderIndex``, ``ImageDecodeError``,
``index_folder``, ``pil_loader``, ``write_shards``, ``StreamingDataset``, ``StreamingLoader``,
``ShardDataError``, ``SampleDecodeError`` and, to decode on the GPU, ``encoded_bytes``,
``collate_encoded``, ``EncodedBatch`` and ``decode_images``; they are imported on first use
(torchvision takes seconds to import).
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker and an editor see; at run time they come from __getattr__
    from dask_ddp.data.gpu_decode import EncodedBatch, collate_encoded, decode_images, encoded_bytes
    from dask_ddp.data.image_folder import FolderIndex, ImageDecodeError, S3ImageFolder, index_folder, pil_loader
    from dask_ddp.data.streaming.dataset import SampleDecodeError, StreamingDataset
    from dask_ddp.data.streaming.format import ShardDataError
    from dask_ddp.data.streaming.loader import StreamingLoader
    from dask_ddp.data.streaming.write import write_shards

_HOME = {"S3ImageFolder": "image_folder", "FolderIndex": "image_folder", "ImageDecodeError": "image_folder",
         "index_folder": "image_folder", "pil_loader": "image_folder", "write_shards": "streaming.write",
         "StreamingDataset": "streaming.dataset", "StreamingLoader": "streaming.loader",
         "ShardDataError": "streaming.format", "SampleDecodeError": "streaming.dataset",
         "encoded_bytes": "gpu_decode", "collate_encoded": "gpu_decode", "decode_images": "gpu_decode",
         "EncodedBatch": "gpu_decode"}
__all__ = ["S3ImageFolder", "FolderIndex", "ImageDecodeError", "index_folder", "pil_loader", "write_shards",
           "StreamingDataset", "StreamingLoader", "ShardDataError", "SampleDecodeError",
           "encoded_bytes", "collate_encoded", "EncodedBatch", "decode_images"]


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

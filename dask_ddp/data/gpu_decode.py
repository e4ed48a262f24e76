"""Decoding a batch of JPEGs on the GPU: the loader hands over encoded bytes, the rank decodes them at once.

Runs in: the rank process (:func:`decode_images`) and its DataLoader workers (:func:`encoded_bytes`,
:func:`collate_encoded`).

With ``StreamingDataset(url, decoder=encoded_bytes)`` and ``loader(..., collate_fn=collate_encoded)`` the
DataLoader workers only cut samples out of their shards; :func:`decode_images` then decodes a whole batch
with ``torchvision.io.decode_jpeg`` on ``device`` (nvJPEG on CUDA) and resizes it there. The CPU path
(PIL in the workers) stays the default: see ``benchmarks/bench_streaming_gpu.py`` for when each is faster.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from dask_ddp.data.streaming.format import ShardDataError

__all__ = ["EncodedBatch", "encoded_bytes", "collate_encoded", "decode_images"]


class EncodedBatch(NamedTuple):
    """A batch of encoded samples in one ``uint8`` buffer (one tensor crosses from a DataLoader worker, not one
    per sample): sample ``i`` is ``data[offsets[i]:offsets[i] + lengths[i]]``; :meth:`tensors` gives those views."""

    data: torch.Tensor
    lengths: torch.Tensor

    def __len__(self) -> int:  # type: ignore[override]  # a batch's length is its samples', not the tuple's
        return len(self.lengths)

    def tensors(self) -> list[torch.Tensor]:
        """Each sample's bytes, a 1-D ``uint8`` view of :attr:`data` (no copy)."""
        return list(torch.split(self.data, self.lengths.tolist()))


def encoded_bytes(data: bytes, ext: str) -> bytes:
    """A ``StreamingDataset`` decoder that decodes nothing: the sample's bytes, as they are in the shard."""
    return bytes(data)


def collate_encoded(items: Sequence[tuple[bytes, int]]) -> tuple[EncodedBatch, torch.Tensor]:
    """A ``collate_fn`` for :func:`encoded_bytes` samples: ``(EncodedBatch, classes)``."""
    joined = bytearray().join(data for data, _ in items)
    data = torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
    return (EncodedBatch(data, torch.tensor([len(d) for d, _ in items], dtype=torch.long)),
            torch.tensor([int(c) for _, c in items], dtype=torch.long))


def decode_images(encoded: EncodedBatch | Sequence[torch.Tensor], device: Any = "cpu",
                  size: tuple[int, int] | None = None,
                  keys: Sequence[str] | None = None) -> torch.Tensor | list[torch.Tensor]:
    """Decode JPEGs (an :class:`EncodedBatch` or 1-D ``uint8`` tensors) to RGB ``uint8`` images on ``device``.

    Returns one ``(N, 3, H, W)`` tensor when ``size=(H, W)`` is given (each image resized there, antialiased)
    or when every image has the same shape, else a list of ``(3, h, w)`` tensors. On CUDA the batch goes to
    nvJPEG; on the CPU to libjpeg-turbo.

    Raises
    ------
    SampleDecodeError
        A sample is not a JPEG torchvision can decode; names it (``keys[i]``, e.g. the loader's
        ``batch_keys``, else its place in the batch).
    ValueError
        ``encoded`` is empty or ``size`` is not two positive ints.
    """
    from torchvision.io import ImageReadMode, decode_jpeg

    from dask_ddp.data.streaming.dataset import SampleDecodeError

    if isinstance(encoded, EncodedBatch):
        encoded = encoded.tensors()
    if not len(encoded):
        raise ValueError("decode_images got an empty batch")
    if size is not None and (len(size) != 2 or min(int(s) for s in size) < 1):
        raise ValueError(f"size must be (height, width) of positive ints, got {size!r}")
    try:
        images = decode_jpeg(list(encoded), mode=ImageReadMode.RGB, device=device)
    except (RuntimeError, ValueError) as err:
        for i, one in enumerate(encoded):  # the batch call does not say which sample broke it: find it
            try:
                decode_jpeg(one, mode=ImageReadMode.RGB)
            except (RuntimeError, ValueError) as bad:
                key = keys[i] if keys is not None and i < len(keys) else f"#{i} of the batch"
                raise SampleDecodeError(f"sample {key!r} is not a JPEG torchvision can decode: {bad}. Drop or fix it, "
                                        "or decode on the CPU with on_error='skip'", key=str(key)) from bad
        raise ShardDataError(f"decoding a batch of {len(encoded)} JPEGs on {device} failed, though each decodes "
                             f"alone on the CPU: {err}") from err
    if size is not None:
        from torchvision.transforms.v2.functional import resize

        return torch.stack([resize(im, list(size), antialias=True) for im in images])
    if len({tuple(im.shape) for im in images}) == 1:
        return torch.stack(images)
    return list(images)

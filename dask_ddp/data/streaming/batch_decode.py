"""A step's JPEGs decoded in one call: the fast path of ``StreamingDataset`` for ``ToTensor``.

Runs in: the rank process and its DataLoader workers (the loader's steps).

A dataset whose decoder is the default (PIL, RGB) and whose transform starts with ``ToTensor`` (torchvision's
``transforms.ToTensor()`` or ``functional.to_tensor``, alone or first in a ``Compose``) gets the same tensors
without PIL: torchvision's ``decode_jpeg`` on the step's list of JPEGs (libjpeg-turbo, in C++, no per-image
Python), then ``to(float32).div_(255)``, which is what ``to_tensor`` does with PIL's pixels. On the 96x96
JPEGs of ``benchmarks/bench_streaming.py``: 106 us an image against 337 us, and the tensors are bitwise equal to
PIL's (the test compares them). What the fast path cannot read (a PNG, a CMYK JPEG, a corrupt file) takes
the PIL path, sample by sample, as before; the rest of a ``Compose`` runs on the tensor, as it would after
``ToTensor``. Any other transform, or a decoder of the user's, keeps the PIL path and gets a PIL image.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

__all__ = ["split_to_tensor", "decode_jpegs", "JPEG_EXTS"]

JPEG_EXTS = frozenset({"jpg", "jpeg", "jpe"})


def split_to_tensor(transform: Callable | None) -> tuple[bool, Callable | None]:
    """``(True, rest)`` when ``transform`` is ``ToTensor`` or a ``Compose`` that starts with it (``rest``: the
    transforms after it, None when none); else ``(False, transform)``. Raises nothing."""
    if transform is None:
        return False, None
    if "torchvision.transforms" not in sys.modules:  # no ToTensor can exist yet: skip torchvision's import (~1 s)
        return False, transform
    try:
        from torchvision.transforms import Compose, ToTensor
        from torchvision.transforms.functional import to_tensor
    except ImportError:  # torchvision is a dependency, but a stripped install must still load
        return False, transform

    def is_to_tensor(t: Any) -> bool:
        return t is to_tensor or type(t) is ToTensor

    if is_to_tensor(transform):
        return True, None
    steps = list(transform.transforms) if type(transform) is Compose else []  # type: ignore[attr-defined]
    if steps and is_to_tensor(steps[0]):
        return True, (Compose(steps[1:]) if steps[1:] else None)
    return False, transform


def decode_jpegs(blobs: Sequence[Any]) -> list:
    """Each of ``blobs`` (JPEG bytes or a view of them) as a float32 CHW tensor in [0, 1], RGB, as
    ``to_tensor(PIL.Image.open(...).convert("RGB"))`` gives it; an exception in place of one that
    ``decode_jpeg`` cannot read (the caller takes the PIL path for it). Raises nothing of its own."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]  # writable: no torch warning
    try:
        decoded: list = decode_jpeg(data, mode=ImageReadMode.RGB) if data else []
    except Exception:  # noqa: BLE001 - one bad file fails the call: find it, decode the others
        decoded = []
        for one in data:
            try:
                decoded.append(decode_jpeg(one, mode=ImageReadMode.RGB))
            except Exception as err:  # noqa: BLE001 - returned: the PIL path reads or names it
                decoded.append(err)
    return [d if isinstance(d, Exception) else d.to(torch.float32).div_(255) for d in decoded]

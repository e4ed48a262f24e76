"""The batch-decode fast path of ``StreamingDataset`` (issue 44): a step's JPEGs decoded by torchvision's
``decode_jpeg`` in one call when the transform starts with ``ToTensor``, bitwise the tensors of the PIL path.

Real parts: real JPEGs (RGB, grayscale, CMYK), a PNG and a corrupt file in real tar shards on local disk, the
loader with and without DataLoader worker processes. The PIL path is forced by a transform the fast path cannot
recognise (a lambda around ``to_tensor``), so each comparison is the same data through both paths.
"""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms
from torchvision.transforms.functional import to_tensor

from dask_ddp.data import SampleDecodeError, StreamingDataset
from dask_ddp.data.streaming import batch_decode


def _image(value: int, size: int, fmt: str, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(value)
    arr = rng.integers(0, 256, (size, size, 3)).astype(np.uint8)
    img = Image.fromarray(arr).convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _tars(folder, samples: list[tuple[str, str, bytes]], per_tar: int = 7) -> str:
    """WebDataset tars of ``(key, ext, bytes)`` with class ``k % 3`` in a ``.cls`` member; returns the folder."""
    folder.mkdir()
    for t in range(0, len(samples), per_tar):
        with tarfile.open(folder / f"shard-{t // per_tar:03d}.tar", "w") as tar:
            for key, ext, blob in samples[t:t + per_tar]:
                for name, data in ((f"{key}.{ext}", blob), (f"{key}.cls", str(int(key[1:]) % 3).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(folder)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """40 samples: RGB JPEGs of two sizes, grayscale and CMYK JPEGs, PNGs."""
    samples = []
    for i in range(40):
        kind = i % 8
        if kind == 5:
            samples.append((f"s{i:03d}", "jpg", _image(i, 24, "JPEG", "L")))
        elif kind == 6:
            samples.append((f"s{i:03d}", "jpg", _image(i, 24, "JPEG", "CMYK")))
        elif kind == 7:
            samples.append((f"s{i:03d}", "png", _image(i, 24, "PNG")))
        else:
            samples.append((f"s{i:03d}", "jpg", _image(i, 24, "JPEG")))
    return _tars(tmp_path_factory.mktemp("decode") / "tars", samples)


def _batches(url: str, transform, nw: int = 0, **kw) -> list:
    ds = StreamingDataset(url, shuffle=True, seed=3, transform=transform, **kw)
    return [(x, y) for x, y in ds.loader(4, num_workers=nw)], ds


@pytest.mark.parametrize("nw", [0, 2])
def test_to_tensor_batches_are_bitwise_the_pil_paths(mixed, nw):
    fast, ds = _batches(mixed, to_tensor, nw)
    slow, plain = _batches(mixed, lambda img: to_tensor(img), nw)
    assert ds.batched and not plain.batched
    assert len(fast) == len(slow) == 10
    for (a, ya), (b, yb) in zip(fast, slow):
        assert a.dtype == torch.float32 and a.shape == (4, 3, 24, 24)
        assert torch.equal(a, b), (a - b).abs().max()
        assert torch.equal(ya, yb)


def test_a_compose_starting_with_to_tensor_runs_its_rest_on_the_tensor(mixed):
    norm = transforms.Normalize((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    fast, ds = _batches(mixed, transforms.Compose([transforms.ToTensor(), norm]))
    slow, _ = _batches(mixed, transforms.Compose([transforms.Lambda(lambda img: to_tensor(img)), norm]))
    assert ds.batched
    for (a, _), (b, _) in zip(fast, slow):
        assert torch.equal(a, b)


def test_transforms_that_take_a_pil_image_still_get_one(mixed):
    seen = []

    def crop(img):
        seen.append(type(img).__name__)
        return img.crop((0, 0, 16, 16))

    got, ds = _batches(mixed, transforms.Compose([crop, transforms.ToTensor()]))
    assert not ds.batched and set(seen) == {"Image"} and got[0][0].shape == (4, 3, 16, 16)
    custom = StreamingDataset(mixed, transform=to_tensor, decoder=lambda blob, ext: Image.open(io.BytesIO(blob)))
    assert not custom.batched, "a decoder of the user's keeps the per-sample path"


def test_a_corrupt_jpeg_is_named_or_skipped_as_on_the_pil_path(tmp_path):
    good = [(f"s{i:03d}", "jpg", _image(i, 16, "JPEG")) for i in range(5)]
    url = _tars(tmp_path / "bad", good[:2] + [("s099", "jpg", b"\xff\xd8 not really a jpeg")] + good[2:], per_tar=9)
    with pytest.raises(SampleDecodeError, match="sample 's099'.*on_error='skip'"):
        list(StreamingDataset(url, shuffle=False, transform=to_tensor).loader(3))
    loader = StreamingDataset(url, shuffle=False, transform=to_tensor, on_error="skip").loader(3)
    batches = list(loader)
    assert loader.skipped == 1 and sum(len(x) for x, _ in batches) == 5


def test_the_split_rule():
    assert batch_decode.split_to_tensor(to_tensor) == (True, None)
    assert batch_decode.split_to_tensor(transforms.ToTensor())[0]
    ok, rest = batch_decode.split_to_tensor(transforms.Compose([transforms.ToTensor(), transforms.Normalize(0, 1)]))
    assert ok and isinstance(rest, transforms.Compose) and len(rest.transforms) == 1
    assert batch_decode.split_to_tensor(transforms.Compose([transforms.Resize(8), transforms.ToTensor()]))[0] is False
    assert batch_decode.split_to_tensor(None) == (False, None)
    assert batch_decode.split_to_tensor(lambda x: x)[0] is False

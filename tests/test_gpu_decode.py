"""Encoded samples from a StreamingLoader, a whole batch decoded by ``decode_images`` (CPU here, CUDA on a GPU).

Real parts: real JPEGs (48x40, photo-like), tar shards on local disk written by write_shards, torch's DataLoader
with worker processes; the CUDA test runs nvJPEG on a real GPU (skipped without one).
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from PIL import Image

from dask_ddp.data import (
    EncodedBatch,
    SampleDecodeError,
    StreamingDataset,
    collate_encoded,
    decode_images,
    encoded_bytes,
    write_shards,
)

N = 37


def photo(i: int, h: int = 40, w: int = 48, subsampling: int = -1) -> bytes:
    """A smooth image with a little noise (JPEG's usual input; pure noise decodes with large IDCT differences)."""
    y, x = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(i)
    arr = np.stack([(x * 5 + i * 7) % 256, (y * 6 + i * 3) % 256, (x + y + i) % 256], -1)
    arr = arr + rng.integers(0, 8, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90, subsampling=subsampling)
    return buf.getvalue()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpudecode")
    truth = {}
    for i in range(N):
        os.makedirs(root / "src" / f"c{i % 2}", exist_ok=True)
        data = photo(i)
        (root / "src" / f"c{i % 2}" / f"im{i:03d}.jpg").write_bytes(data)
        truth[f"c{i % 2}_im{i:03d}"] = (data, i % 2)
    write_shards(str(root / "src"), str(root / "shards"), shard_size="20KB", progress=False, client=False)
    return str(root / "shards"), truth


def pil(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy()).permute(2, 0, 1)


def close(a: torch.Tensor, b: torch.Tensor, mean: float = 1.5, most: int = 40) -> None:
    """Two JPEG decoders may round the IDCT differently: equal within a few levels on average."""
    diff = (a.int() - b.int()).abs().float()
    assert a.shape == b.shape and diff.mean() < mean and diff.max() <= most, (a.shape, b.shape, diff.mean(), diff.max())


@pytest.mark.parametrize("workers", [0, 2])
def test_encoded_batches_decode_to_the_pil_images(shards, workers):
    url, truth = shards
    loader = StreamingDataset(url, decoder=encoded_bytes, seed=3).loader(8, collate_fn=collate_encoded,
                                                                         num_workers=workers, world_size=1, rank=0)
    seen = 0
    for encoded, classes in loader:
        assert isinstance(encoded, EncodedBatch) and encoded.data.dtype == torch.uint8 and encoded.data.dim() == 1
        assert int(encoded.lengths.sum()) == encoded.data.numel()
        images = decode_images(encoded, keys=loader.batch_keys)
        assert images.shape == (len(encoded), 3, 40, 48) and images.dtype == torch.uint8
        for key, img, c, raw in zip(loader.batch_keys, images, classes.tolist(), encoded.tensors()):
            assert bytes(raw.numpy()) == truth[key][0] and c == truth[key][1]
            close(img, pil(truth[key][0]))
        small = decode_images(encoded, size=(20, 24))
        assert small.shape == (len(encoded), 3, 20, 24)
        seen += len(encoded)
    assert seen == N // 8 * 8


def test_mixed_shapes_come_back_as_a_list_and_bad_input_is_named():
    a, b = torch.frombuffer(bytearray(photo(1)), dtype=torch.uint8), torch.frombuffer(
        bytearray(photo(2, 24, 30)), dtype=torch.uint8)
    out = decode_images([a, b])
    assert isinstance(out, list) and out[0].shape == (3, 40, 48) and out[1].shape == (3, 24, 30)
    broken = torch.frombuffer(bytearray(b"\xff\xd8 not a jpeg at all"), dtype=torch.uint8)
    with pytest.raises(SampleDecodeError, match="'cat_7'"):
        decode_images([a, broken], keys=["dog_1", "cat_7"])
    with pytest.raises(SampleDecodeError, match="#1 of the batch"):
        decode_images([a, broken])
    with pytest.raises(ValueError, match="empty batch"):
        decode_images([])
    with pytest.raises(ValueError, match="positive ints"):
        decode_images([a], size=(0, 3))
    assert encoded_bytes(memoryview(b"ab"), "jpg") == b"ab"
    batch, classes = collate_encoded([(b"", 1), (b"xyz", 2)])
    assert [bytes(t.numpy()) for t in batch.tensors()] == [b"", b"xyz"] and classes.tolist() == [1, 2]


@pytest.mark.gpu
def test_cuda_decode_matches_the_cpu(shards):
    """nvJPEG against libjpeg-turbo: close on full-colour (4:4:4) JPEGs; with 4:2:0 chroma (the shards' JPEGs,
    PIL's default) nvJPEG upsamples chroma its own way (seen on an H200: mean 3.3 levels apart, at most 79)."""
    url, truth = shards
    loader = StreamingDataset(url, decoder=encoded_bytes, shuffle=False).loader(16, collate_fn=collate_encoded,
                                                                                world_size=1, rank=0)
    encoded, _ = next(iter(loader))
    on_gpu = decode_images(encoded, device="cuda", size=(32, 32))
    assert on_gpu.device.type == "cuda" and on_gpu.shape == (16, 3, 32, 32)
    close(decode_images(encoded, device="cuda").cpu(), decode_images(encoded), mean=6, most=128)
    full = [torch.frombuffer(bytearray(photo(i, subsampling=0)), dtype=torch.uint8) for i in range(8)]
    close(decode_images(full, device="cuda").cpu(), decode_images(full))

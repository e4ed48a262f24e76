"""Writes the MDS and LitData fixtures of tests/test_foreign_shards.py with the real writers (not dask-ddp's).

Run with an interpreter that has ``mosaicml-streaming`` and ``litdata`` (they are no dependency of dask-ddp;
see benchmarks/README_streaming.md for the benchmark venv): ``/work/bench-venv/bin/python
tests/data/foreign/make.py``. It writes ``mds/`` (MDSWriter, columns image: jpeg, label: int, key: str) and
``litdata/`` (litdata.optimize, samples {"image": JPEG image, "label": int, "key": str}), 23 16x20 JPEGs of
3 classes in 2-3 shards each, and ``truth.json``: each key's class and the SHA-256 of its JPEG file.
"""

import hashlib
import io
import json
import os
import shutil

import numpy as np
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
N = 23


def jpeg(i: int) -> bytes:
    rng = np.random.default_rng(1000 + i)
    arr = (rng.integers(0, 256, (16, 20, 3)) // 32 * 32).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def sample(i: int) -> dict:
    os.makedirs(f"{HERE}/src", exist_ok=True)
    path = f"{HERE}/src/im{i:03d}.jpg"
    with open(path, "wb") as f:
        f.write(jpeg(i))
    return {"image": Image.open(path), "label": i % 3, "key": f"im{i:03d}"}  # a JpegImageFile: its file's bytes


def main() -> None:
    from litdata import optimize
    from streaming import MDSWriter

    for sub in ("mds", "litdata", "src"):
        shutil.rmtree(f"{HERE}/{sub}", ignore_errors=True)
    truth = {f"im{i:03d}": [i % 3, hashlib.sha256(jpeg(i)).hexdigest()] for i in range(N)}
    with MDSWriter(out=f"{HERE}/mds", columns={"image": "jpeg", "label": "int", "key": "str"},
                   size_limit=3000) as out:
        for i in range(N):
            out.write(sample(i))
    optimize(fn=sample, inputs=list(range(N)), output_dir=f"{HERE}/litdata", chunk_bytes=3000, num_workers=1)
    shutil.rmtree(f"{HERE}/src")
    with open(f"{HERE}/truth.json", "w") as f:
        json.dump(truth, f, indent=0, sort_keys=True)


if __name__ == "__main__":
    main()

"""S3ImageFolder inside a real DDP job: 2 ranks, DistributedSampler shards, 2 DataLoader workers each."""

from __future__ import annotations

import io

import pytest
from dask.distributed import Client, LocalCluster

import dask_ddp
from dask_ddp.data import S3ImageFolder


def read_shards(dataset, epochs):
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    seen = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2)
        ids = []
        for x, y in loader:
            # each image is one colour that encodes its sample id: red + 256 * green
            ids += (x[:, 0, 0, 0] * 255).round().long().add((x[:, 1, 0, 0] * 255).round().long() * 256).tolist()
        seen.append(ids)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("n_per_class", [10])
def test_two_ranks_see_every_sample_once_per_epoch(s3, n_per_class):
    import boto3
    import torchvision.transforms as T
    from PIL import Image

    s3c = boto3.client("s3", endpoint_url=s3["endpoint"], region_name="us-east-1")
    sample_id = 0
    for cls in ("ant", "bee", "cat"):
        for i in range(n_per_class):
            buf = io.BytesIO()
            Image.new("RGB", (8, 8), (sample_id % 256, sample_id // 256, 0)).save(buf, format="PNG")
            s3c.put_object(Bucket=s3["bucket"], Key=f"train/{cls}/{i:03d}.png", Body=buf.getvalue())
            sample_id += 1
    # listed once, here on the client; the index travels with the pickled dataset to the ranks
    data = S3ImageFolder(f"s3://{s3['bucket']}/train", transform=T.ToTensor(), storage_options=s3["storage_options"])
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, Client(cluster) as c:
        per_rank = dask_ddp.dispatch.run(c, read_shards, data, 2, progress=False).result(timeout=300)
    total = 3 * n_per_class
    for epoch in range(2):
        ids = per_rank[0][epoch] + per_rank[1][epoch]
        assert sorted(ids) == list(range(total)), f"epoch {epoch}: every sample exactly once"
        assert len(per_rank[0][epoch]) == len(per_rank[1][epoch]) == total // 2
    assert per_rank[0][0] != per_rank[0][1], "set_epoch reshuffles"

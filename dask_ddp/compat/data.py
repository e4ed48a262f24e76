"""dask-pytorch-ddp 0.2.2's ``data.S3ImageFolder(s3_bucket, s3_prefix, ...)`` on dask-ddp's dataset.

Runs in: the rank process and its DataLoader workers (the dataset), built on the client or a rank.

``from dask_ddp.compat.data import S3ImageFolder`` replaces
``from dask_pytorch_ddp.data import S3ImageFolder``; calls stay as they were.
The dataset is :class:`dask_ddp.S3ImageFolder` (torchvision's ImageFolder
rules, listed once, batch-concurrent fetching), so what differs from 0.2.2 is
what ImageFolder does differently: classes are the prefix's immediate
sub-folders (0.2.2 used each file's parent folder), files that are not images
are skipped (0.2.2 tried to open them), and an empty prefix raises
``FileNotFoundError`` naming it. The endpoint and credentials come from the
usual AWS settings (``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ...) or
``storage_options=``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from dask_ddp.data.image_folder import S3ImageFolder as _S3ImageFolder

__all__ = ["S3ImageFolder"]


class S3ImageFolder(_S3ImageFolder):
    """``S3ImageFolder(s3_bucket, s3_prefix, transform=None, target_transform=None, anon=False)``, as in 0.2.2.

    Parameters
    ----------
    s3_bucket, s3_prefix : str
        The images are ``s3://{s3_bucket}/{s3_prefix}/<class>/<image>``.
    transform, target_transform : callable, optional
        As in torchvision's ImageFolder.
    anon : bool
        Read the bucket without credentials.
    storage_options : mapping, optional
        Further s3fs options (dask-ddp's addition), e.g. ``{"client_kwargs": {"endpoint_url": ...}}``.
    **kwargs
        The rest of :class:`dask_ddp.S3ImageFolder`'s keywords (``cache=``, ``loader=``, ...).

    Raises
    ------
    FileNotFoundError, PermissionError, ValueError
        As :class:`dask_ddp.S3ImageFolder`: no such bucket or prefix, no class folder, refused credentials.
    """

    def __init__(self, s3_bucket: str, s3_prefix: str, transform: Callable | None = None,
                 target_transform: Callable | None = None, anon: bool = False,
                 storage_options: Mapping[str, Any] | None = None, **kwargs: Any):
        options = dict(storage_options or {})
        if anon:
            options["anon"] = True
        url = f"s3://{s3_bucket.strip('/')}/{s3_prefix.strip('/')}".rstrip("/")
        super().__init__(url, transform=transform, target_transform=target_transform, storage_options=options,
                         **kwargs)

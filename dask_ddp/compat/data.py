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

0.2.2's attributes ``all_files``, ``s3_bucket``, ``s3_prefix`` and ``anon``
are kept, read-only and derived from the dataset: ``all_files[i]`` is the
object key of sample ``i`` (images only, so ``len(all_files) == len(ds)``;
0.2.2 listed every object under the prefix), and ``s3_prefix`` has no
leading or trailing ``/``. 0.2.2's ``s3_client`` (boto3) is not there: the
dataset reads through ``ds.fs`` (s3fs), opened in each process.
"""

from __future__ import annotations

import functools
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

    Attributes
    ----------
    all_files : list of str
        The object key of each sample, in sample order (``"prefix/cat/1.png"``).
    s3_bucket, s3_prefix : str
        The bucket and the prefix (no leading or trailing ``/``), from the dataset's URL.
    anon : bool
        Whether the bucket is read without credentials.

    Raises
    ------
    FileNotFoundError, PermissionError, ValueError
        As :class:`dask_ddp.S3ImageFolder`: no such bucket or prefix, no class folder, refused credentials.
    """

    def __init__(self, s3_bucket: str, s3_prefix: str, transform: Callable | None = None,
                 target_transform: Callable | None = None, anon: bool = False,
                 storage_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        options = dict(storage_options or {})
        if anon:
            options["anon"] = True
        url = f"s3://{s3_bucket.strip('/')}/{s3_prefix.strip('/')}".rstrip("/")
        super().__init__(url, transform=transform, target_transform=target_transform, storage_options=options,
                         **kwargs)

    @property
    def s3_bucket(self) -> str:
        """The bucket, from the dataset's URL ``s3://{s3_bucket}/{s3_prefix}``; raises nothing."""
        return self._bucket_and_prefix()[0]

    @property
    def s3_prefix(self) -> str:
        """The prefix, without leading or trailing ``/`` (``""`` for the whole bucket); raises nothing."""
        return self._bucket_and_prefix()[1]

    @property
    def anon(self) -> bool:
        """Whether the bucket is read without credentials (``anon=True`` or ``storage_options["anon"]``)."""
        return bool(self.storage_options.get("anon", False))

    @functools.cached_property
    def all_files(self) -> list[str]:
        """The object key of each sample, in sample order, as 0.2.2 listed them (images only here); raises nothing.

        Made on first use and kept (``samples`` edited later are not reflected); never pickled.
        """
        start = len(f"s3://{self.s3_bucket}/")
        return [url[start:] for url, _ in self.samples]

    def _bucket_and_prefix(self) -> tuple[str, str]:
        bucket, _, prefix = str(self.root).removeprefix("s3://").partition("/")
        return bucket, prefix.strip("/")

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("all_files", None)  # derived: DataLoader workers and ranks need not receive a second listing
        return state

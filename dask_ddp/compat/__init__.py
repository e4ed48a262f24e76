"""The API of dask-pytorch-ddp 0.2.2, on dask-ddp's engine.

Runs in: the client (``dispatch``, ``results``); results' ``submit_result`` in the rank process.

Code written for dask-pytorch-ddp runs after changing ``dask_pytorch_ddp`` to
``dask_ddp.compat`` in its imports::

    # from dask_pytorch_ddp import dispatch, results
    # from dask_pytorch_ddp.data import S3ImageFolder
    # from dask_pytorch_ddp.dispatch import dispatch_with_ddp
    from dask_ddp.compat import dispatch, results
    from dask_ddp.compat.data import S3ImageFolder
    from dask_ddp.compat.dispatch import dispatch_with_ddp

There is no ``dask_pytorch_ddp`` alias package on purpose: where the real
one is installed too, it would shadow it. README's "Coming from
dask-pytorch-ddp" lists every difference that remains.

    futures = dispatch.run(client, train, bucket=..., backend="nccl")
    rh = results.DaskResultsHandler(key)
    rh.process_results("training/", futures, raise_errors=False)

What stays the same: :func:`dispatch.run` returns one Dask future per worker,
in rank order, for ``distributed.wait`` and ``client.gather``; each gives
its rank's return value or raises its rank's error. ``backend`` defaults to
``"nccl"``; ``pass_local_rank=True`` passes ``local_rank=`` to the function.
Inside the function ``torch.distributed`` is initialised, and ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` are set (with the rest of
torchrun's variables). :class:`results.DaskResultsHandler` moves small
results from the ranks to files under a local directory.

:func:`dispatch.dispatch_with_ddp` is 0.2.2's runner of one rank, for code
that submitted it to each worker itself (it runs in the calling process, as
before; ``run`` does not use it).

``compat.data.S3ImageFolder(bucket, prefix, transform=...)`` is dask-ddp's
:class:`dask_ddp.S3ImageFolder` with 0.2.2's signature and its attributes
``all_files``, ``s3_bucket``, ``s3_prefix`` and ``anon`` (imported on first
use: it needs torchvision).

What is better: the rendezvous port is picked by the OS (0.2.2 used the
fixed port 23456), a failed rank stops the others instead of leaving them
hanging in a collective, each rank runs in a child process of its worker, so
``DataLoader(num_workers>0)`` works without ``distributed.worker.daemon:
False``, and the ranks' output is echoed on the client. Positional ``*args``
work (0.2.2 could only pass keyword arguments).

What differs: ``backend="nccl"`` on a worker without a GPU fails at once
with :class:`dask_ddp.PlanError` (0.2.2 failed inside torch); pass
``backend="gloo"`` (or ``"auto"``) on CPU. A result over 64 KiB is refused:
write checkpoints with :func:`dask_ddp.save_checkpoint` instead.
``submit_result`` works only inside a function started by
:func:`dispatch.run` (0.2.2's Pub worked in any Dask task).
"""

from dask_ddp.compat import dispatch, results

__all__ = ["dispatch", "results"]

"""dask-ddp's settings live in ``dask.config`` under ``ddp`` (defaults in ``ddp.yaml``).

Runs in: every process that imports dask_ddp (client, Dask worker, rank process).

So ``DASK_DDP__STALL_TIMEOUT=600`` in the environment, a site file
``~/.config/dask/ddp.yaml`` and ``dask.config.set({"ddp.stall-timeout": 600})``
all work, as for Dask's own settings. ``ddp-schema.yaml`` beside it describes
every setting in Dask's schema style (JSON Schema in YAML, as distributed's
``distributed-schema.yaml``); ``SCHEMA`` is its path.

Logging goes to the ``dask_ddp`` logger (what happens to a running job:
transitions, restarts, stragglers, lost workers); configure it as any logger,
e.g. ``logging.getLogger("dask_ddp").setLevel(logging.WARNING)``. Advice about
how dask-ddp is used (a sink to attach, a limit a rank passes) is a
:class:`~dask_ddp.DaskDDPWarning` through :mod:`warnings`.
"""

from __future__ import annotations

import os

import dask.config
import yaml

_fn = os.path.join(os.path.dirname(__file__), "ddp.yaml")
SCHEMA = os.path.join(os.path.dirname(__file__), "ddp-schema.yaml")
with open(_fn) as f:
    _defaults = yaml.safe_load(f)

dask.config.update_defaults(_defaults)

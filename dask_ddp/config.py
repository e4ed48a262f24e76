"""dask-ddp's settings live in ``dask.config`` under ``ddp`` (defaults in ``ddp.yaml``).

Runs in: every process that imports dask_ddp (client, Dask worker, rank process).

So ``DASK_DDP__STALL_TIMEOUT=600`` in the environment, a site file
``~/.config/dask/ddp.yaml`` and ``dask.config.set({"ddp.stall-timeout": 600})``
all work, as for Dask's own settings.
"""

from __future__ import annotations

import os

import dask.config
import yaml

_fn = os.path.join(os.path.dirname(__file__), "ddp.yaml")
with open(_fn) as f:
    _defaults = yaml.safe_load(f)

dask.config.update_defaults(_defaults)

"""Runs in: the user's shell (``python -m dask_ddp.cli``, the same as the ``dask-ddp`` command)."""

import sys

from dask_ddp.cli import main

sys.exit(main())

"""``dask_ddp.dispatch``: the public home of :func:`run`, :func:`warm_up` and :func:`attach`.

Runs in: the client (the notebook). The code lives in :mod:`dask_ddp.client.dispatch`
(launching) and :mod:`dask_ddp.client.detach` (attaching); this module is the path users
and the CLI import.
"""

from dask_ddp.client.dispatch import LaunchSpec, attach, run, warm_up

__all__ = ["run", "attach", "warm_up", "LaunchSpec"]

"""DDP's gradient all-reduce, timed: how long a rank waits for the others in each step.

Runs in: the rank process (patched in when its job starts; the process runs
one job, then exits).

DDP keeps ranks in lockstep at the gradient all-reduce: a rank whose last
gradient bucket is ready early waits there for the slowest rank, and the
slowest rank hardly waits at all. The wait of a step is measured from the
moment the step's last bucket is ready (its backward pass is done) to that
bucket's all-reduce completing: wall clock on gloo, CUDA events on NCCL
(whose futures complete when the work is queued, not done).

Why a comm hook: it is the one place where DDP hands each bucket to the
collective, it costs one Python call per bucket (tens of microseconds per
step), and it needs no change to the user's code. The first
``DistributedDataParallel`` built in a rank gets dask-ddp's hook at
construction; the hook does what DDP does without one (scale by
1/world size, all-reduce SUM; the same numbers) or, once the user registers
a hook of their own (``register_comm_hook``, the built-in ALLREDUCE and
FP16_COMPRESS, a fused optimizer), calls theirs inside the timing. A model
built with ``mixed_precision=`` (which registers its own hook) and later DDP
models are left alone: their ranks report ``collective_wait`` None.
"""

from __future__ import annotations

import time
import weakref
from collections import deque

from dask_ddp.rank import goodput

__all__ = ["patch_ddp", "settle", "mark_first_forward"]

_PENDING: deque = deque()  # (start, end) CUDA events of NCCL steps not yet known to be done


class _Timing:
    """The hook's state: the counters to add to and the user's own hook, if any.

    The process group is held weakly. The hook's futures complete on the backend's own threads, and what
    they hold is freed there: had the last reference to a group been this state (a script that destroys
    its group, then drops its model), the group would be freed on one of its own threads, which joins
    itself and aborts the rank ("Resource deadlock avoided", the tutorial script of tests/test_cli.py).
    """

    def __init__(self, counters, process_group):
        self.c = counters
        self._pg = weakref.ref(process_group) if process_group is not None else None
        self.hook = self.state = None
        self.user = False  # a user hook (or built-in) replaced the default

    @property
    def pg(self):
        """The model's process group; None for the default group (or once the group is gone)."""
        return self._pg() if self._pg is not None else None


def _timed_hook(timing: _Timing, bucket):
    """DDP's comm hook: run the user's hook (or DDP's default) and time the last bucket of the step."""
    import torch.distributed as dist

    last = bucket.is_last()
    if timing.hook is None:
        tensor = bucket.buffer()
        group = timing.pg if timing.pg is not None else dist.group.WORLD
        tensor.mul_(1.0 / group.size())  # what DDP's reducer does without a hook, before its SUM
        fut, unwrap = dist.all_reduce(tensor, group=group, async_op=True).get_future(), True
    else:
        fut, unwrap = timing.hook(timing.state, bucket), False
    if not last:
        return fut.then(lambda f: f.value()[0]) if unwrap else fut
    start = _cuda_event() if bucket.buffer().is_cuda else None
    t0 = time.perf_counter()
    c = timing.c  # the callback holds the counters only: it is freed on the backend's thread

    def done(f):
        t1 = time.perf_counter()
        if start is None:
            c.coll_wait += t1 - t0
        else:
            _PENDING.append((start, _cuda_event()))
        c.ddp_steps += 1
        c.last_ddp_step = t1
        c.samples_at_ddp_step = c.samples
        c.input_wait_at_ddp_step = c.input_wait
        value = f.value()
        return value[0] if unwrap else value

    return fut.then(done)


def _cuda_event():
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def settle(counters) -> None:
    """Add the waits of NCCL steps whose CUDA events have completed (called by the sampler, never blocks)."""
    while _PENDING:
        start, end = _PENDING[0]
        if not end.query():
            return
        _PENDING.popleft()
        counters.coll_wait += max(0.0, start.elapsed_time(end) / 1000.0)


def mark_first_forward() -> None:
    """Mark the rank's first step at the first forward of any module (DDP, FSDP2, a plain one): a global hook
    that removes itself then, or at the first forward after another mark (a batch asked for, ``report()``)."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    def first(mod, inputs):
        goodput.began()
        handle.remove()  # returns None: the inputs go on unchanged

    handle = register_module_forward_pre_hook(first)


def patch_ddp(counters) -> None:
    """Give the first ``DistributedDataParallel`` built in this process the timing hook (see the module doc)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if getattr(DDP.__init__, "_dask_ddp", False):
        return
    init, register, builtin = DDP.__init__, DDP.register_comm_hook, DDP._register_builtin_comm_hook

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if counters.ddp_timed or self._comm_hooks:
            return  # a later model, or one with a hook of its own (mixed_precision=)
        timing = _Timing(counters, self.process_group)
        try:
            register(self, timing, _timed_hook)
        except Exception:  # noqa: BLE001 - a model that takes no hook is trained untimed
            return
        self._comm_hooks.pop()  # the Python reducer (compiled autograd) calls these per parameter: not ours
        self._dask_ddp_timing = timing
        counters.ddp_timed = True

    def register_comm_hook(self, state, hook):
        timing = getattr(self, "_dask_ddp_timing", None)
        if timing is None or timing.user:
            return register(self, state, hook)  # torch's own checks and errors (registered twice, ...)
        self._check_comm_hook(hook)
        self.logger._set_comm_hook_name(hook.__qualname__)
        timing.hook, timing.state, timing.user = hook, state, True

    def _register_builtin_comm_hook(self, comm_hook_type):
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        timing = getattr(self, "_dask_ddp_timing", None)
        if timing is None or timing.user:
            return builtin(self, comm_hook_type)
        self.logger._set_comm_hook_name(str(comm_hook_type))
        if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
            timing.hook, timing.state = default_hooks.fp16_compress_hook, self.process_group
        timing.user = True

    __init__._dask_ddp = True
    DDP.__init__, DDP.register_comm_hook = __init__, register_comm_hook
    DDP._register_builtin_comm_hook = _register_builtin_comm_hook

"""Per-rank telemetry: step time, input and collective wait, CPU, memory and GPU, about once a second.

Runs in: the rank process. Nothing here runs on the training thread but a
few counter updates: the rank's flusher thread (:mod:`dask_ddp.rank.reporting`)
asks the :class:`Sampler` for a ``"telemetry"`` item once per interval and
ships it in the batch it sends anyway.

Where the numbers come from, with no user code:

- **Steps.** One step is one DDP gradient synchronisation (the last
  gradient bucket's all-reduce, counted by dask-ddp's timing comm hook,
  :mod:`dask_ddp.rank.collectives`); without a DDP model, one ``report()`` call
  (distinct ``step`` values); failing both, one batch drawn from a timed
  loader. The item's ``step``: the latest reported step, else the latest step
  a live group committed (``live_steps``), else the DDP steps or batches
  counted (the client's stall watch takes a change of it as progress).
  ``step_time`` is the time between the window's last step boundary and the
  previous window's, divided by the steps in between.
- **Input wait**: the time spent in ``DataLoader`` iterators' ``__next__``
  (patched in the rank process only) and in iterables wrapped with
  :func:`timed`, as a share of the steps' time.
- **Collective wait**: from the moment the last gradient bucket of a step is
  ready to its all-reduce's completion (see :mod:`dask_ddp.rank.collectives`).
- **CPU and RSS** of the rank process (psutil); **GPU** memory from
  ``torch.cuda`` (reserved by the caching allocator, and its peak) and
  utilisation from NVML (``nvidia-ml-py``) when installed. CUDA is never
  initialised here: a rank that did not touch its GPU reports None.
- **Checkpoints**: the latest ``save_sharded`` of the rank: its step, the
  training stall, the wait for the previous async save, the upload's seconds,
  bytes and MB/s (:func:`checkpoint_fields`; absent before the first).
- **Goodput**: the rank's ledger (:mod:`dask_ddp.rank.goodput`): ``goodput_<category>_s``, its seconds since
  the task started (``goodput_since``, unix time), with ``goodput_step`` and ``goodput_from`` (the last and
  the first step reported, None before a report), ``joined`` (the process's ``RankTask.joined``) and
  ``final`` (the rank's last item).

``ddp.telemetry.enabled: false`` turns all of it off (no patching, no items).
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Iterator

from dask_ddp.rank import goodput
from dask_ddp.wire.goodput import fields

__all__ = ["Sampler", "Counters", "COUNTERS", "timed", "start"]


class Counters:
    """Running totals the training thread (and the comm hook's callbacks) add to; the sampler takes deltas.

    Totals only, never reset: a reader taking a difference needs no lock.
    """

    def __init__(self):
        self.input_wait = 0.0  # seconds inside a loader's __next__
        self.batches = 0
        self.samples = 0
        self.samples_known = False
        self.last_batch = None  # perf_counter() after the latest batch
        self.coll_wait = 0.0  # seconds from the last bucket ready to its all-reduce done
        self.ddp_steps = 0
        self.last_ddp_step = None  # perf_counter() at the latest step's all-reduce completion
        self.samples_at_ddp_step = 0  # samples fetched up to the latest step (its batches come before its sync)
        self.input_wait_at_ddp_step = 0.0  # input wait up to the latest step, likewise
        self.ddp_timed = False  # a DDP model carries the timing hook
        self.live_step: int | None = None  # the latest step a live group committed (dask_ddp.rank.live)


COUNTERS = Counters()


def _batch_size(batch: Any) -> int | None:
    """The leading dimension of a batch (a tensor, or the first tensor of a tuple, list or dict)."""
    for _ in range(3):
        if isinstance(batch, (tuple, list)) and batch:
            batch = batch[0]
        elif isinstance(batch, dict) and batch:
            batch = next(iter(batch.values()))
        else:
            break
    shape = getattr(batch, "shape", None)
    if shape is not None and len(shape) > 0:
        return int(shape[0])
    return None


def _count_batch(batch: Any, waited: float, now: float) -> None:
    c = COUNTERS
    c.input_wait += waited
    c.batches += 1
    c.last_batch = now
    size = _batch_size(batch)
    if size is not None:
        c.samples += size
        c.samples_known = True


def timed(iterable: Iterable) -> Iterator:
    """Iterate over ``iterable``, counting the time spent waiting for each item as input wait.

    DataLoaders are timed already inside a rank; wrap other data sources
    (a generator, a streaming dataset's iterator) with this::

        for x, y in dask_ddp.timed(stream):
            ...

    Outside a rank (or with telemetry off) it only iterates. Raises what the iterable raises.
    """
    it = iter(iterable)
    clock = time.perf_counter
    while True:
        t0 = clock()
        goodput.began(t0)
        try:
            item = next(it)
        except StopIteration:
            return
        t1 = clock()
        _count_batch(item, t1 - t0, t1)
        yield item


def _patch_dataloader() -> None:
    """Time every DataLoader iterator's ``__next__`` in this rank process (it runs one job, then exits)."""
    from torch.utils.data import dataloader

    base = dataloader._BaseDataLoaderIter
    if getattr(base.__next__, "_dask_ddp_timed", False):
        return
    original, clock = base.__next__, time.perf_counter

    def __next__(self):
        t0 = clock()
        goodput.began(t0)  # the first batch asked for starts the first step
        batch = original(self)  # StopIteration passes through uncounted
        t1 = clock()
        _count_batch(batch, t1 - t0, t1)
        return batch

    __next__._dask_ddp_timed, __next__.__wrapped__ = True, original
    base.__next__ = __next__


class _Window:
    """Where the previous sample with steps left the collective wait, and each step source's count, boundary
    time, samples and input wait at its last step."""

    def __init__(self):
        self.coll_wait = 0.0
        # source -> (count, boundary time, samples, input wait) at the previous window's last step
        self.marks: dict[str, tuple[int, float | None, int, float]] = {}


class Sampler:
    """Makes one ``"telemetry"`` item per ``interval`` from the counters and the reports it observes.

    Called from the rank's flusher thread only: :meth:`observe` with each
    drained batch of items, which appends a telemetry item when one is due.
    """

    def __init__(self, rank: int, attempt: int, interval: float = 1.0, counters: Counters = COUNTERS,
                 joined: int = 0):
        import psutil

        self.rank, self.attempt, self.interval, self.c, self.joined = rank, attempt, interval, counters, joined
        self.device = None  # set once the rank has its device (a torch.device or None)
        self.proc = psutil.Process()
        self.proc.cpu_percent()  # the first call starts psutil's CPU clock
        self._prev = _Window()
        self._last_sample = time.monotonic()
        self._step = None  # the last step the rank reported
        self._first_step = None  # ... and the first
        self._report_steps = 0  # distinct reported steps so far
        self._report_time = None  # time.time() of the last report
        self._report_mark = None  # perf_counter() when the last report was observed
        self._report_samples, self._report_wait = 0, 0.0  # samples fetched and input wait when it was observed
        self._nvml = None
        self._start = time.perf_counter()  # the boundary before the first step, for a job shorter than a window

    def due(self, now: float) -> bool:
        return now - self._last_sample >= self.interval * 0.9  # slack: the flusher ticks every 0.1 s

    def observe(self, items: list[dict], force: bool = False) -> list[dict]:
        """Note the reports among ``items``; append a telemetry item when one is due (or ``force``)."""
        reported = False
        for item in items:
            if item.get("kind") == "metric":
                if item["step"] != self._step:
                    self._report_steps += 1
                    self._step = item["step"]
                    self._first_step = item["step"] if self._first_step is None else self._first_step
                self._report_time, reported = item["time"], True
        if reported:  # the last report's time on the step clock (perf_counter)
            self._report_mark = time.perf_counter() - max(0.0, time.time() - self._report_time)
            self._report_samples, self._report_wait = self.c.samples, self.c.input_wait
        now = time.monotonic()
        if force or self.due(now):
            self._last_sample = now
            try:
                items.append(self.sample(final=force))
            except Exception:  # noqa: BLE001 - telemetry must never break the rank's reports
                pass
        return items

    def sample(self, final: bool = False) -> dict:
        """The telemetry item of the window since the previous sample (the contract's fields).

        ``final``: the rank's last sample; a job that ended within its first window then gets the mean of its
        steps since the sampler started (its start included) rather than no step time at all."""
        from dask_ddp.rank import collectives

        collectives.settle(self.c)  # CUDA events of finished all-reduces become wait time
        c, p = self.c, self._prev
        steps, span, samples, waited = self._steps(c, p, final)
        item = {"kind": "telemetry", "rank": self.rank, "attempt": self.attempt, "time": time.time(),
                "step": self._step if self._step is not None else (
                    c.live_step if c.live_step is not None else (c.ddp_steps or c.batches or None)),
                "steps": steps, "step_time": span / steps if steps and span > 0 else None,
                "input_wait": _share(waited, span) if c.batches and steps else None,
                "collective_wait": _share(c.coll_wait - p.coll_wait, span) if c.ddp_timed and steps else None,
                "samples_per_s": samples / span if c.samples_known and steps and span > 0 else None,
                "cpu_percent": float(self.proc.cpu_percent()), "rss_bytes": int(self.proc.memory_info().rss),
                "last_report_age": None if self._report_time is None else max(0.0, time.time() - self._report_time)}
        item.update(self._gpu())
        item.update(checkpoint_fields())
        ledger = goodput.LEDGER
        item.update(fields(ledger.split(c.input_wait)), goodput_since=ledger.since, goodput_step=self._step,
                    goodput_from=self._first_step, joined=self.joined, final=final)
        if steps:  # a step longer than the window: its collective wait adds up until it ends
            p.coll_wait = c.coll_wait
        return item

    def _steps(self, c: Counters, p: _Window, final: bool = False) -> tuple[int, float, int, float]:
        """Steps since the previous window's last boundary, the time they took, the samples their batches held
        and the input wait of those batches: DDP syncs first, then reports, then batches. The first steps ever
        seen have no earlier boundary: their time is 0 (unknown), but in the ``final`` sample, where the
        sampler's start stands in for it.

        Samples and input wait are counted at the same boundaries as the steps (a step's batches are fetched
        before its sync): counted when fetched instead, a window of two steps could hold one batch or three,
        and its samples/s and input-wait share were off by half (seen in a 40-step test's last window)."""
        found = None
        for name, count, mark, samples, waited in (
                ("ddp", c.ddp_steps, c.last_ddp_step, c.samples_at_ddp_step, c.input_wait_at_ddp_step),
                ("report", self._report_steps, self._report_mark, self._report_samples, self._report_wait),
                ("batch", c.batches, c.last_batch, c.samples, c.input_wait)):
            before, prev_mark, prev_samples, prev_waited = p.marks.get(name, (0, None, 0, 0.0))
            if prev_mark is None and final:
                prev_mark = self._start
            p.marks[name] = (count, mark, samples, waited)
            if found is None and count > before and mark is not None:
                found = (count - before, 0.0 if prev_mark is None else mark - prev_mark, samples - prev_samples,
                         waited - prev_waited)
        return found or (0, 0.0, 0, 0.0)

    def _gpu(self) -> dict:
        out = {"gpu_util": None, "gpu_mem_bytes": None, "gpu_mem_peak_bytes": None}
        dev = self.device
        if dev is None or getattr(dev, "type", None) != "cuda":
            return out
        import torch

        if not torch.cuda.is_initialized():  # never initialise CUDA for a number
            return out
        out["gpu_mem_bytes"] = int(torch.cuda.memory_reserved(dev))
        out["gpu_mem_peak_bytes"] = int(torch.cuda.max_memory_reserved(dev))
        out["gpu_util"] = self._nvml_util(dev)
        return out

    def _nvml_util(self, dev) -> float | None:
        """The GPU's utilisation in percent through NVML (``nvidia-ml-py``), None where it cannot be had."""
        if self._nvml is False:
            return None
        try:
            import pynvml

            if self._nvml is None:
                import torch

                pynvml.nvmlInit()
                uuid = str(torch.cuda.get_device_properties(dev).uuid)
                uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
                self._nvml = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            return float(pynvml.nvmlDeviceGetUtilizationRates(self._nvml).gpu)
        except Exception:  # noqa: BLE001 - NVML missing, or no NVML GPU: utilisation is unknown, not an error
            self._nvml = False
            return None


def _share(part: float, whole: float) -> float | None:
    if whole <= 0:
        return None
    return min(1.0, max(0.0, part / whole))


CHECKPOINT_FIELDS = ("ckpt_step", "ckpt_stall_s", "ckpt_waited_s", "ckpt_upload_s", "ckpt_bytes", "ckpt_mb_s")


def checkpoint_fields() -> dict:
    """The rank's latest sharded save (``save_sharded``): step, training stall, wait for the previous async
    save, upload seconds, bytes this rank wrote and its MB/s (1e6 bytes); ``{}`` before the first save (the
    item then has the fields it always had)."""
    from dask_ddp.checkpoint.sharded.background import SAVES

    if not SAVES:
        return {}
    last = SAVES[-1]
    return {"ckpt_step": last.get("step"), "ckpt_stall_s": last.get("stall_s"), "ckpt_waited_s": last.get("waited_s"),
            "ckpt_upload_s": last.get("upload_s"), "ckpt_bytes": last.get("bytes"), "ckpt_mb_s": last.get("mb_s")}


def start(rank: int, attempt: int, interval: float, joined: int = 0) -> Sampler:
    """Instrument this rank process (DataLoader iterators, DDP's comm hook), start its goodput ledger and return
    its sampler; ``joined``: the process's ``RankTask.joined`` (a live replacement's number, else 0)."""
    from dask_ddp.rank import collectives

    goodput.LEDGER.reset(COUNTERS.input_wait)
    _patch_dataloader()
    collectives.patch_ddp(COUNTERS)
    collectives.mark_first_forward()
    return Sampler(rank, attempt, interval, joined=joined)

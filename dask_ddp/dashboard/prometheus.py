"""Per-rank gauges of running dask-ddp jobs on the scheduler's ``/metrics`` (Prometheus), prefixed ``dask_ddp_``.

Runs in: the scheduler's process. Dask serves ``/metrics`` from ``prometheus_client``'s process-wide
``REGISTRY``; one :class:`DDPCollector` is registered there once per process and reports every live
:class:`~dask_ddp.dashboard.state.DashboardState` of the process (a test process may hold several
schedulers, one after another). Jobs that ended are not exported: their series stop, as Prometheus expects
of things that are gone. Labels: ``job`` (the run id) and ``rank``; ``dask_ddp_rank_info`` adds ``worker``,
``host`` and ``device``, and ``dask_ddp_job_info`` the job's ``name``, ``state`` and ``attempt``. Running sweeps:
``dask_ddp_sweep_trials{sweep,state}``, ``dask_ddp_sweep_busy_workers``, ``dask_ddp_sweep_workers`` and
``dask_ddp_sweep_occupancy_ratio`` (label ``sweep``). Goodput: ``dask_ddp_goodput_ratio`` and
``dask_ddp_goodput_seconds{job,rank,category}``, the rank process's ledger (:mod:`dask_ddp.wire.goodput`).
"""

from __future__ import annotations

import threading
import time
import weakref

from dask_ddp.dashboard.state import DashboardState, rank_rows
from dask_ddp.wire.goodput import RANK_CATEGORIES

__all__ = ["DDPCollector", "register", "GAUGES"]

#: (metric name, telemetry or row field, help text)
GAUGES = (
    ("dask_ddp_step", "step", "The rank's latest step"),
    ("dask_ddp_step_time_seconds", "step_time", "Mean seconds per step over the rank's last telemetry window"),
    ("dask_ddp_input_wait_ratio", "input_wait", "Share of step time the rank waited for input (0..1)"),
    ("dask_ddp_collective_wait_ratio", "collective_wait", "Share of step time the rank waited in collectives"),
    ("dask_ddp_samples_per_second", "samples_per_s", "Samples per second of the rank"),
    ("dask_ddp_cpu_percent", "cpu_percent", "CPU use of the rank process (percent of one core)"),
    ("dask_ddp_rss_bytes", "rss_bytes", "Resident memory of the rank process"),
    ("dask_ddp_gpu_utilization_percent", "gpu_util", "GPU utilisation of the rank's device"),
    ("dask_ddp_gpu_memory_bytes", "gpu_mem_bytes", "GPU memory used by the rank"),
    ("dask_ddp_gpu_memory_peak_bytes", "gpu_mem_peak_bytes", "Peak GPU memory of the rank"),
    ("dask_ddp_last_report_age_seconds", "last_report_age", "Seconds since the rank's last report()"),
    ("dask_ddp_last_seen_seconds", "last_seen", "Seconds since the scheduler last heard from the rank"),
    ("dask_ddp_dropped_events", "dropped", "Reports and lines of the rank dropped past its limits (ddp.events.max-*)"),
    ("dask_ddp_checkpoint_step", "ckpt_step", "Step of the rank's latest sharded save"),
    ("dask_ddp_checkpoint_stall_seconds", "ckpt_stall_s", "Seconds the latest sharded save stopped training"),
    ("dask_ddp_checkpoint_wait_seconds", "ckpt_waited_s", "Seconds it waited for the previous async save"),
    ("dask_ddp_checkpoint_upload_seconds", "ckpt_upload_s", "Seconds the rank's shards of it took to upload"),
    ("dask_ddp_checkpoint_bytes", "ckpt_bytes", "Bytes the rank wrote in it"),
    ("dask_ddp_checkpoint_megabytes_per_second", "ckpt_mb_s", "The rank's upload throughput in it (1e6 bytes/s)"),
    ("dask_ddp_goodput_ratio", "goodput", "Productive share of the rank process's time since its task started"),
)

_STATES: "weakref.WeakSet[DashboardState]" = weakref.WeakSet()
_LOCK = threading.Lock()
_REGISTERED = False


class DDPCollector:
    """A ``prometheus_client`` custom collector over the live dashboard states of this process."""

    def describe(self):
        return []  # no fixed names: never refused as a duplicate, collected only when scraped

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        families = {name: GaugeMetricFamily(name, text, labels=["job", "rank"]) for name, _, text in GAUGES}
        straggler = GaugeMetricFamily("dask_ddp_straggler", "1 while the job names the rank a straggler",
                                      labels=["job", "rank", "cause"])
        rank_info = GaugeMetricFamily("dask_ddp_rank_info", "Where each rank runs (always 1)",
                                      labels=["job", "rank", "worker", "host", "device"])
        job_info = GaugeMetricFamily("dask_ddp_job_info", "Each running job (always 1)",
                                     labels=["job", "name", "state", "attempt"])
        spent = GaugeMetricFamily("dask_ddp_goodput_seconds", "Seconds of the rank process by category (productive, "
                                  "startup, data, checkpoint, recovery, redone) since its task started",
                                  labels=["job", "rank", "category"])
        sweep_families = _sweep_families(GaugeMetricFamily)
        now = time.time()
        for state in list(_STATES):
            with state.lock:
                for sweep in state.sweeps.values():
                    if sweep["state"] == "RUNNING":
                        _add_sweep(sweep_families, sweep)
                for job in state.jobs.values():
                    if job.ended:
                        continue
                    job_info.add_metric([job.run, job.name, job.state, str(job.attempt + 1)], 1)
                    rows = rank_rows(job, now)
                    _add_ranks(families, straggler, rank_info, job.run, rows)
                    _add_goodput(spent, job.run, rows)
        # only families with samples: a scheduler without a running dask-ddp job shows no dask_ddp_ lines
        yield from (f for f in (*families.values(), straggler, rank_info, job_info, spent, *sweep_families.values())
                    if f.samples)


def _sweep_families(family) -> dict:
    return {"trials": family("dask_ddp_sweep_trials", "Trials of each running sweep by state (QUEUED, RUNNING, "
                             "COMPLETE, PRUNED, FAILED, CANCELLED)", labels=["sweep", "state"]),
            "busy": family("dask_ddp_sweep_busy_workers", "Workers running the sweep's trials", labels=["sweep"]),
            "room": family("dask_ddp_sweep_workers", "Workers the sweep may use", labels=["sweep"]),
            "occupancy": family("dask_ddp_sweep_occupancy_ratio", "Busy worker-seconds over workers x time since "
                                "the sweep started (0..1)", labels=["sweep"])}


def _add_sweep(families: dict, sweep: dict) -> None:
    for state, n in sweep["trials"].items():
        families["trials"].add_metric([sweep["sweep"], state], float(n))
    for key in ("busy", "room", "occupancy"):
        if isinstance(sweep.get(key), (int, float)):
            families[key].add_metric([sweep["sweep"]], float(sweep[key]))


def _add_ranks(families, straggler, rank_info, run: str, rows: dict) -> None:
    for i, rank in enumerate(rows["rank"]):
        labels = [run, str(rank)]
        for name, key, _ in GAUGES:
            value = rows[key][i]
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                families[name].add_metric(labels, float(value))
        cause = rows["straggler"][i]
        straggler.add_metric(labels + [cause or ""], 1.0 if cause else 0.0)
        rank_info.add_metric(labels + [rows[k][i] or "" for k in ("worker", "host", "device")], 1)


def _add_goodput(spent, run: str, rows: dict) -> None:
    for i, rank in enumerate(rows["rank"]):
        for category in RANK_CATEGORIES:
            value = rows[f"goodput_{category}_s"][i]
            if value is not None:
                spent.add_metric([run, str(rank), category], float(value))


def register(state: DashboardState) -> bool:
    """Export ``state`` on this process's ``/metrics``; False when ``prometheus_client`` is not installed."""
    global _REGISTERED
    try:
        import prometheus_client
    except ImportError:
        return False
    with _LOCK:
        _STATES.add(state)
        if not _REGISTERED:
            prometheus_client.REGISTRY.register(DDPCollector())
            _REGISTERED = True
    return True


def unregister(state: DashboardState) -> None:
    """Stop exporting ``state`` (its scheduler closed)."""
    with _LOCK:
        _STATES.discard(state)

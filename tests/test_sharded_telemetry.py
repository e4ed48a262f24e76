"""A sharded save's figures (stall, wait, upload time, bytes, MB/s) in the rank's telemetry item, and where they
show: the notebook's table, the DDP dashboard page and the scheduler's Prometheus gauges."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

import dask_ddp
from dask_ddp.checkpoint.sharded import background as sharded_async
from dask_ddp.dashboard import prometheus
from dask_ddp.dashboard.page import rank_table
from dask_ddp.dashboard.state import DashboardState
from dask_ddp.observe import display
from dask_ddp.rank import telemetry


def test_a_saves_figures_reach_the_notebook_the_page_and_prometheus(tmp_path):
    from prometheus_client.core import GaugeMetricFamily  # noqa: F401 - installed with the dashboard's extras

    sharded_async.SAVES.clear()
    assert telemetry.checkpoint_fields() == {}  # no save yet: the telemetry item keeps its usual fields
    dask_ddp.save_sharded({"model": torch.nn.Linear(256, 256)}, 12, directory=str(tmp_path))
    fields = telemetry.checkpoint_fields()
    # the bytes this rank wrote: its shard files, which hold the tensors and whatever else rides in the save (a
    # streaming loader another test of this process left alive adds its position, so no exact tensor size here)
    written = sum(p.stat().st_size for p in tmp_path.rglob("*-rank-00000-*.distcp"))
    assert fields["ckpt_step"] == 12 and fields["ckpt_bytes"] == written >= (256 * 256 + 256) * 4, (fields, written)
    assert fields["ckpt_stall_s"] > 0 and fields["ckpt_upload_s"] > 0 and fields["ckpt_mb_s"] > 0
    assert fields["ckpt_waited_s"] >= 0

    item = {"kind": "telemetry", "rank": 0, "attempt": 0, "time": time.time(), "step": 12, "cpu_percent": 90.0,
            "rss_bytes": 2**28, **fields}
    state = DashboardState()
    state.feed("dask-ddp-fit-0a1b2c3d", {"run": "fit-0a1b2c3d-0", "rank": 0, "attempt": 0, "seq": 0,
                                         "items": (item,)})
    text = rank_table(state.jobs["fit-0a1b2c3d"], now=time.time())["checkpoint"][0]
    assert text.startswith("step 12: stall ") and "upload " in text and " MB/s" in text and "kiB" in text, text

    prometheus.register(state)
    try:
        found = {m.name: m.samples for m in prometheus.DDPCollector().collect()}
    finally:
        prometheus.unregister(state)
    assert found["dask_ddp_checkpoint_step"][0].value == 12
    assert found["dask_ddp_checkpoint_bytes"][0].value == fields["ckpt_bytes"]
    for name in ("stall_seconds", "upload_seconds", "megabytes_per_second", "wait_seconds"):
        assert f"dask_ddp_checkpoint_{name}" in found, name

    record = SimpleNamespace(cond=threading.Condition(), telemetry={0: item}, stragglers={}, dropped={})
    plan = SimpleNamespace(ranks=[SimpleNamespace(rank=0, address="tcp://a:1", host="a")])
    row = display.rank_rows(record, plan)[0]
    assert row["checkpoint"].startswith("step 12: stall ") and "MB/s" in row["checkpoint"], row

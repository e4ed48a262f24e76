"""A job in the notebook: its per-rank table (HTML), and a widget that refreshes it while the job runs.

Runs in: the client. :func:`rank_rows` turns what the job's record holds
(each rank's latest telemetry, the plan, the stragglers named) into plain
rows; :func:`job_html` renders them with the job's state; :class:`LiveTable`
shows them under the progress bar of ``job.result()`` / ``job.wait()`` in
Jupyter, redrawn at most once a second.
"""

from __future__ import annotations

import html
import time

__all__ = ["rank_rows", "job_html", "progress_text", "dashboard_url", "LiveTable", "COLUMNS"]

COLUMNS = ("rank", "worker", "host", "device", "step", "step time", "input wait", "collective wait", "samples/s",
           "CPU", "memory", "GPU", "GPU memory", "last seen", "dropped", "straggler", "checkpoint")



def _checkpoint(g: dict) -> str:
    """The rank's latest sharded save: ``step 300: stall 0.012 s, upload 1.2 s, 64.0 MiB at 53 MB/s``."""
    if g.get("ckpt_step") is None:
        return ""
    parts = [f"stall {g['ckpt_stall_s']:.3g} s" if g.get("ckpt_stall_s") is not None else "",
             f"upload {g['ckpt_upload_s']:.3g} s" if g.get("ckpt_upload_s") is not None else "",
             _bytes(g.get("ckpt_bytes")) + (f" at {g['ckpt_mb_s']:.0f} MB/s" if g.get("ckpt_mb_s") else "")]
    return f"step {g['ckpt_step']}: " + ", ".join(p for p in parts if p)


def _pct(x) -> str:
    return "" if x is None else f"{x:.0%}"


def _bytes(n) -> str:
    if n is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _device(item: dict | None) -> str:
    if item is None:
        return ""
    return "cuda" if item.get("gpu_mem_bytes") is not None else "cpu"


def rank_rows(record, plan, now: float | None = None) -> list[dict]:
    """One row per rank of ``plan`` (the current attempt), columns :data:`COLUMNS`, values as display text."""
    now = time.time() if now is None else now
    with record.cond:
        telemetry, stragglers, dropped = dict(record.telemetry), dict(record.stragglers), dict(record.dropped)
    rows = []
    for r in (plan.ranks if plan is not None else ()):
        t = telemetry.get(r.rank)
        g = t or {}
        gpu_mem = _bytes(g.get("gpu_mem_bytes"))
        if gpu_mem and g.get("gpu_mem_peak_bytes") is not None:
            gpu_mem += f" (peak {_bytes(g['gpu_mem_peak_bytes'])})"
        rows.append({
            "rank": str(r.rank), "worker": r.address, "host": r.host, "device": _device(t),
            "step": "" if g.get("step") is None else str(g["step"]),
            "step time": "" if g.get("step_time") is None else f"{g['step_time'] * 1000:.1f} ms",
            "input wait": _pct(g.get("input_wait")), "collective wait": _pct(g.get("collective_wait")),
            "samples/s": "" if g.get("samples_per_s") is None else f"{g['samples_per_s']:.1f}",
            "CPU": "" if t is None else f"{g['cpu_percent']:.0f}%", "memory": _bytes(g.get("rss_bytes")),
            "GPU": "" if g.get("gpu_util") is None else f"{g['gpu_util']:.0f}%", "GPU memory": gpu_mem,
            "last seen": "" if t is None else f"{max(0.0, now - g['time']):.1f} s ago",
            "dropped": str(dropped[r.rank]) if dropped.get(r.rank) else "",  # past its limits (ddp.events.max-*)
            "straggler": "straggler: " + stragglers[r.rank] if r.rank in stragglers else "",
            "checkpoint": _checkpoint(g),
        })
    return rows


def progress_text(job) -> str:
    """``step 41 of 100`` (``job.spec.total`` known) or ``step 41``; ``""`` before the first report."""
    top, total = job._record.top_step, getattr(job.spec, "total", None)
    if top < 0:
        return ""
    return f"step {top + 1} of {total}" if total else f"step {top + 1}"


def dashboard_url(job) -> str | None:
    """The DDP page of the job's cluster (the scheduler's dashboard, ``/ddp``), or None when it has none."""
    try:
        link = job.client.dashboard_link
    except Exception:  # noqa: BLE001 - no dashboard (bokeh missing, dashboard_address=None, a closed client)
        return None
    if not link:
        return None
    base = link.rsplit("/", 1)[0] if link.rstrip("/").endswith("status") else link.rstrip("/")
    return base + "/ddp"


def job_html(job, now: float | None = None) -> str:
    """The job as HTML: name, run id, state and attempt, ranks and workers, progress, a link to the DDP page
    of the Dask dashboard, then the per-rank table (telemetry so far)."""
    attempt = job.attempt.index + 1 if job.attempt else 0
    plan = job.plan
    where = "" if plan is None else (f", {plan.world_size} ranks on {len({r.address for r in plan.ranks})} "
                                     f"workers ({len({r.host for r in plan.ranks})} hosts)")
    step = progress_text(job)
    url = dashboard_url(job)
    link = f' &middot; <a href="{html.escape(url)}" target="_blank">DDP dashboard</a>' if url else ""
    head = (f"<b>dask-ddp job</b> {html.escape(str(job.name))} <code>{html.escape(job.run_id)}</code>: "
            f"<b>{html.escape(job.state)}</b>, attempt {attempt}{html.escape(where)}"
            + (f", {html.escape(step)}" if step else "") + link)
    rows = rank_rows(job._record, job.plan, now)
    if not rows:
        return f"<div>{head}</div>"
    cells = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS if c != "straggler")
    body = []
    for row in rows:
        style = ' style="background:#fdd"' if row["straggler"] else ""
        tds = "".join(f"<td>{html.escape(row[c])}</td>" for c in COLUMNS if c != "straggler")
        body.append(f"<tr{style} title=\"{html.escape(row['straggler'])}\">{tds}</tr>")
    notes = "".join(f"<li>{html.escape(row['straggler'])}</li>" for row in rows if row["straggler"])
    return (f"<div>{head}<table class=\"dask-ddp-ranks\"><thead><tr>{cells}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>" + (f"<ul>{notes}</ul>" if notes else "") + "</div>")


class LiveTable:
    """An ``ipywidgets.HTML`` showing :func:`job_html`, redrawn by :meth:`update` at most once a second."""

    def __init__(self, job, every: float = 1.0):
        import ipywidgets
        from IPython.display import display

        self.job, self.every, self._drawn = job, every, 0.0
        self.widget = ipywidgets.HTML(job_html(job))
        display(self.widget)

    def update(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._drawn >= self.every:
            self._drawn = now
            self.widget.value = job_html(self.job)

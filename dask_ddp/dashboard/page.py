"""The DDP page of the Dask dashboard: jobs, a live per-rank table and a step-time chart per rank.

Runs in: the scheduler's process, on its event loop (Bokeh server sessions of the dashboard).

:func:`attach` adds two Bokeh applications, ``/ddp`` (a tab in the dashboard's top bar) and
``/individual-ddp`` (listed under "More..." and in ``individual-plots.json``), to the scheduler's
running dashboard: the Bokeh server that Dask's own pages live in. Bokeh has no public call to add an
application to a running server, so this does what ``BokehTornado.__init__`` does for each application
(an :class:`~bokeh.server.contexts.ApplicationContext` and its routes) and adds the routes with tornado's
``add_handlers``; ``tests/test_dashboard.py`` checks it (last with bokeh 3.9.2 and distributed 2026.7.1).
A scheduler without a dashboard (no bokeh, ``dashboard_address=None``)
gets no page; its ``/metrics`` still has the gauges.

What jobs send (names, worker addresses, straggler causes and messages) shows as text, never as HTML: the
tables' cells through Bokeh's ``StringFormatter`` (text nodes; never an ``HTMLTemplateFormatter``), the
Divs' HTML through :func:`html.escape`.
"""

from __future__ import annotations

import functools
import time
from datetime import datetime
from html import escape

from bokeh.layouts import column
from bokeh.models import ColumnDataSource, DataTable, Div, TableColumn
from bokeh.palettes import Category10_10
from bokeh.plotting import figure
from dask.utils import format_bytes

from dask_ddp.dashboard.state import DashboardState, JobView, rank_rows

__all__ = ["DDPPage", "attach", "PATHS"]

PATHS = ("/ddp", "/individual-ddp")
RANK_COLUMNS = (("rank", "Rank", 50), ("worker", "Worker", 190), ("host", "Host", 110), ("device", "Device", 70),
                ("step", "Step", 60), ("step_time", "Step time", 80), ("input_wait", "Input wait", 80),
                ("collective_wait", "Collective wait", 100), ("samples_per_s", "Samples/s", 80),
                ("cpu", "CPU", 60), ("memory", "Memory", 90), ("gpu", "GPU", 140), ("last_seen", "Last seen", 80),
                ("dropped", "Dropped", 70), ("straggler", "Straggler", 90), ("goodput", "Goodput", 70),
                ("checkpoint", "Checkpoint", 220))
JOB_COLUMNS = (("name", "Job", 160), ("run", "Run id", 220), ("state", "State", 90), ("attempt", "Attempt", 60),
               ("ranks", "Ranks", 50), ("goodput", "Goodput", 70), ("dropped", "Dropped", 70),
               ("started", "Started", 150))


def _seconds(v):
    return "" if v is None else f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"


def _share(v):
    return "" if v is None else f"{100 * v:.0f} %"


def _number(v, fmt="{:.0f}"):
    return "" if v is None else fmt.format(v)


def _gpu(util, used, peak):
    if util is None and used is None:
        return ""
    parts = [f"{util:.0f} %" if util is not None else "", format_bytes(used) if used is not None else ""]
    return " ".join(p for p in parts if p) + (f" (peak {format_bytes(peak)})" if peak is not None else "")


def rank_table(job: JobView, now: float) -> dict[str, list[str]]:
    """The per-rank table of ``job`` as text columns (call under the state's lock)."""
    rows = rank_rows(job, now)
    n = len(rows["rank"])
    return {
        "rank": [str(r) for r in rows["rank"]],
        "worker": [w or "" for w in rows["worker"]], "host": [h or "" for h in rows["host"]],
        "device": [d or "" for d in rows["device"]], "step": [_number(s, "{}") for s in rows["step"]],
        "step_time": [_seconds(v) for v in rows["step_time"]],
        "input_wait": [_share(v) for v in rows["input_wait"]],
        "collective_wait": [_share(v) for v in rows["collective_wait"]],
        "samples_per_s": [_number(v, "{:.1f}") for v in rows["samples_per_s"]],
        "cpu": [_number(v, "{:.0f} %") for v in rows["cpu_percent"]],
        "memory": ["" if v is None else format_bytes(v) for v in rows["rss_bytes"]],
        "gpu": [_gpu(*g) for g in zip(rows["gpu_util"], rows["gpu_mem_bytes"], rows["gpu_mem_peak_bytes"])],
        "last_seen": ["" if v is None else f"{v:.0f} s ago" for v in rows["last_seen"]],
        "dropped": [str(v) if v else "" for v in rows["dropped"]],
        "straggler": [f"yes ({c})" if c else "" for c in rows["straggler"]] if n else [],
        "goodput": [_share(v) for v in rows["goodput"]],
        "checkpoint": [checkpoint_text(*c) for c in zip(rows["ckpt_step"], rows["ckpt_stall_s"], rows["ckpt_upload_s"],
                                                         rows["ckpt_bytes"], rows["ckpt_mb_s"])],
    }


def checkpoint_text(step, stall, upload, size, mb_s) -> str:
    """``step 300: stall 12.0 ms, upload 1.20 s, 64 MiB at 53 MB/s`` (the latest sharded save), or ``""``."""
    if step is None:
        return ""
    parts = [f"stall {_seconds(stall)}" if stall is not None else "",
             f"upload {_seconds(upload)}" if upload is not None else "",
             (format_bytes(size) + (f" at {mb_s:.0f} MB/s" if mb_s is not None else "")) if size is not None else ""]
    return f"step {step}: " + ", ".join(p for p in parts if p)


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t else ""


class DDPPage:
    """One browser session's view of the jobs: :meth:`update` redraws it from the state (every second)."""

    def __init__(self, state: DashboardState):
        self.state = state
        self.selected: str | None = None  # run id shown below the jobs table
        self._updating = False
        self.jobs = ColumnDataSource({k: [] for k, _, _ in JOB_COLUMNS})
        self.ranks = ColumnDataSource({k: [] for k, _, _ in RANK_COLUMNS})
        self.lines = ColumnDataSource({"xs": [], "ys": [], "color": [], "label": []})
        self.title = Div(text="<h3>DDP jobs</h3><p>No dask-ddp job has run on this cluster yet.</p>",
                         name="ddp-title", sizing_mode="stretch_width")
        self.detail = Div(text="", name="ddp-detail", sizing_mode="stretch_width")
        self.sweeps = Div(text="", name="ddp-sweeps", sizing_mode="stretch_width")
        jobs_table = DataTable(source=self.jobs, columns=[TableColumn(field=k, title=t, width=w)
                                                          for k, t, w in JOB_COLUMNS],
                               height=160, index_position=None, sizing_mode="stretch_width", name="ddp-jobs")
        ranks_table = DataTable(source=self.ranks, columns=[TableColumn(field=k, title=t, width=w)
                                                            for k, t, w in RANK_COLUMNS],
                                height=260, index_position=None, sizing_mode="stretch_width", name="ddp-ranks")
        chart = figure(title="Step time per rank (s)", x_axis_type="datetime", height=300,
                       sizing_mode="stretch_width", name="ddp-step-time", tools="pan,wheel_zoom,box_zoom,reset")
        chart.multi_line(xs="xs", ys="ys", color="color", legend_field="label", line_width=2, source=self.lines)
        chart.legend.location = "top_left"
        self.jobs.selected.on_change("indices", self._on_select)
        self.root = column(self.title, self.sweeps, jobs_table, self.detail, ranks_table, chart,
                           sizing_mode="stretch_width")

    def _on_select(self, attr, old, new) -> None:
        runs = self.jobs.data.get("run", [])
        if self._updating or not new or new[0] >= len(runs) or runs[new[0]] == self.selected:
            return  # a selection this page made itself, or no change
        self.selected = runs[new[0]]
        self.update()

    def update(self) -> None:
        """Redraw from the state: the jobs, and the selected job's ranks (the newest running job by default)."""
        jobs, now = self.state.snapshot(), time.time()
        with self.state.lock:  # compute under the lock; Bokeh's setters (which call back) run outside it
            job = self._pick(jobs)
            jobs_data = {"name": [j.name for j in jobs], "run": [j.run for j in jobs],
                         "state": [j.state for j in jobs], "attempt": [str(j.attempt + 1) for j in jobs],
                         "ranks": [str(len(j.ranks)) for j in jobs],
                         "goodput": [_share(j.goodput) for j in jobs], "started": [_stamp(j.started) for j in jobs],
                         "dropped": [str(j.dropped) if j.dropped else "" for j in jobs]}
            if job is not None:
                detail, ranks, lines = _detail(job), rank_table(job, now), _lines(job)
            sweeps = sweeps_html(list(self.state.sweeps.values()))
        self._updating = True
        try:
            if self.sweeps.text != sweeps:
                self.sweeps.text = sweeps
            self.jobs.data = jobs_data
            if job is None:
                return
            index = jobs_data["run"].index(job.run)
            if self.jobs.selected.indices != [index]:
                self.jobs.selected.indices = [index]
            self.title.text = (f"<h3>DDP jobs</h3><p>{len(jobs)} job(s) on this cluster; select one to see its "
                               "ranks.</p>")
            self.detail.text, self.ranks.data, self.lines.data = detail, ranks, lines
        finally:
            self._updating = False

    def _pick(self, jobs: list[JobView]) -> JobView | None:
        by_run = {j.run: j for j in jobs}
        if self.selected not in by_run:
            live = [j for j in jobs if not j.ended]
            self.selected = (live or jobs)[0].run if jobs else None
        return by_run.get(self.selected) if self.selected is not None else None


def sweeps_html(sweeps: list[dict]) -> str:
    """The sweeps table of the page: state, trials running, queued, pruned, done, failed, of n; occupancy."""
    if not sweeps:
        return ""
    head = "".join(f"<th>{h}</th>" for h in ("Sweep", "State", "Running", "Queued", "Pruned", "Complete", "Failed",
                                             "Cancelled", "Trials", "Busy workers", "Occupancy"))
    rows = []
    for w in reversed(sweeps):
        t, occ = w["trials"], w.get("occupancy")
        cells = [w["sweep"], w["state"], *(t.get(s, 0) for s in ("RUNNING", "QUEUED", "PRUNED", "COMPLETE",
                 "FAILED", "CANCELLED")), w["n_trials"], f"{w['busy']} of {w['room']}",
                 "" if occ is None else f"{100 * occ:.0f} %"]
        rows.append("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in cells) + "</tr>")  # every cell as text
    return f"<h4>Sweeps</h4><table><tr>{head}</tr>{''.join(rows)}</table>"


def _detail(job: JobView) -> str:
    """The selected job's heading as HTML (a Div's text is HTML): every text from a job or rank escaped."""
    text = (f"<h4>{escape(job.name)} <small>({escape(job.run)})</small>: {escape(job.state)}, "
            f"attempt {job.attempt + 1}, {len(job.ranks)} ranks</h4>")
    if job.stragglers:
        last = job.stragglers[-1]
        text += f"<p><b>Straggler:</b> {escape(str(last.get('message') or ''))}</p>"
    if job.ignored:
        text += (f"<p>{job.ignored} items about ranks outside the job's plan "
                 f"({'none heard yet' if job.world is None else f'{job.world} ranks'}) were ignored.</p>")
    return text


def _lines(job: JobView) -> dict[str, list]:
    out: dict[str, list] = {"xs": [], "ys": [], "color": [], "label": []}
    for rank in sorted(job.ranks):
        points = list(job.ranks[rank].history)
        if points:
            out["xs"].append([t * 1000 for t, _ in points])  # Bokeh's datetime axis counts milliseconds
            out["ys"].append([s for _, s in points])
            out["color"].append(Category10_10[rank % 10])
            out["label"].append(f"rank {rank}")
    return out


# ---- the Bokeh documents and their place in the scheduler's dashboard ------------------------------------------
def _doc(state: DashboardState, extra: dict, template: str, doc) -> None:
    page = DDPPage(state)
    page.update()
    doc.title = "Dask: DDP"
    doc.add_root(page.root)
    doc.add_periodic_callback(page.update, 1000)
    try:
        from distributed.dashboard.components.scheduler import BOKEH_THEME, env

        doc.template = env.get_template(template)
        doc.template_variables.update(extra)
        doc.theme = BOKEH_THEME
    except Exception:  # noqa: BLE001 - Dask's templates moved: the page works without its frame
        pass


def _dask_bokeh_server(scheduler):
    from bokeh.server.tornado import BokehTornado

    apps = getattr(getattr(scheduler, "http_application", None), "applications", [])
    return next((app for app in apps if isinstance(app, BokehTornado)), None)


def _extra(server, scheduler) -> dict:
    """The template variables Dask's own pages share (top bar, "More..." list), taken from its status page."""
    try:
        handler = server.applications["/status"].application.handlers[0]
        return handler._func.args[1]  # functools.partial(status_doc, scheduler, extra)
    except (KeyError, IndexError, AttributeError, TypeError):
        from distributed.dashboard.scheduler import template_variables

        return {"prefix": server.prefix + "/", **template_variables(scheduler)}


def attach(scheduler, state: DashboardState) -> bool:
    """Add the DDP page to ``scheduler``'s running dashboard; False when it has none. Idempotent.

    Raises
    ------
    Exception
        Whatever Bokeh raises if its server's layout changed (the caller logs it and goes on without the page).
    """
    server = _dask_bokeh_server(scheduler)
    if server is None:
        return False
    if PATHS[0] in server.app_paths:
        return True
    extra = _extra(server, scheduler)
    _add_application(server, PATHS[0], functools.partial(_doc, state, extra, "simple.html"))
    _add_application(server, PATHS[1], functools.partial(_doc, state, extra, "simple.html"))
    if isinstance(extra.get("pages"), list) and "ddp" not in extra["pages"]:
        extra["pages"].append("ddp")  # the list Dask's pages render their top bar from
    if isinstance(extra.get("plots"), list):
        extra["plots"].append({"url": PATHS[1].strip("/"), "name": "DDP"})
    return True


def _add_application(server, path: str, fn) -> None:
    """What ``BokehTornado.__init__`` does for one application, on a server that is already running."""
    from bokeh.application import Application
    from bokeh.application.handlers.document_lifecycle import DocumentLifecycleHandler
    from bokeh.application.handlers.function import FunctionHandler
    from bokeh.server.contexts import ApplicationContext
    from bokeh.server.tornado import create_static_handler
    from bokeh.server.urls import per_app_patterns
    from bokeh.server.views.ws import WSHandler

    app = Application(FunctionHandler(fn))
    app.add(DocumentLifecycleHandler())
    ctx = ApplicationContext(app, url=path, logout_url=None)
    ctx._loop = server.io_loop
    routes = []
    for pattern, handler in per_app_patterns:
        context = {"application_context": ctx}
        if issubclass(handler, WSHandler):
            context.update(compression_level=None, mem_level=None)
        routes.append((server.prefix + path + pattern, handler, context))
    websocket = next(route for route, _, _ in routes if route.endswith("/ws"))
    for _, _, context in routes:
        context["bokeh_websocket_path"] = websocket
    routes.append(create_static_handler(server.prefix, path, app))
    server._applications[path] = ctx  # what app_paths (and so individual-plots.json) lists
    server.add_handlers(r".*", routes)
    server.io_loop.add_callback(ctx.run_load_hook)

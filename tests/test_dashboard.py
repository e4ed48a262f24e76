"""The DDP page of the Dask dashboard, the ``dask_ddp_`` gauges on ``/metrics``, and the page in a real browser.

Real parts: LocalClusters of worker processes with the scheduler's real dashboard (Bokeh, tornado, on a
port of its own), real 2-rank gloo jobs, ``/metrics`` parsed with ``prometheus_client``'s parser, the page's
live Bokeh document pulled over its websocket, and headless Chromium (Debian's) through Selenium.

Until the telemetry of issue 16 (items 1-2) is merged, the training function sends telemetry items of the
agreed shape itself, through the rank's real event path (``reporting._BUFFER``: the same batches, supervisor,
relay and ``worker.log_event`` that carry reports).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request

import dask
import pytest
from _cluster import local_client, run, wait_until
from prometheus_client.parser import text_string_to_metric_families

import dask_ddp
from dask_ddp.dashboard import JOBS_TOPIC, publish
from dask_ddp.dashboard.plugin import NAME
from dask_ddp.dashboard.state import DashboardState, rank_rows
from dask_ddp.wire.goodput import RANK_CATEGORIES

STEP_TIMES = (0.05, 0.12)  # hand-fed telemetry: what each rank says its steps take
COMPUTE = (0.01, 0.08)  # a real job: each rank's compute per step (sleep); rank 1 is the straggler, DDP's lockstep
# gives both ranks a step of at least 0.08 s, and rank 0 waits for rank 1 in the all-reduce


def telemetry(rank: int, step: int, step_time: float, attempt: int = 0, at: float | None = None, **kw) -> dict:
    """A telemetry item of the shape the two halves of issue 16 agreed on."""
    item = {"kind": "telemetry", "rank": rank, "attempt": attempt, "time": time.time() if at is None else at,
            "step": step, "steps": 5, "step_time": step_time, "input_wait": 0.25, "collective_wait": 0.1,
            "samples_per_s": 32 / step_time, "cpu_percent": 97.0, "rss_bytes": 300 * 2**20, "gpu_util": None,
            "gpu_mem_bytes": None, "gpu_mem_peak_bytes": None, "last_report_age": 0.01}
    return item | kw


def train_until(stop_file: str, max_steps: int = 100_000):
    """DDP steps on every rank, rank 1's compute slower (sleeps): real telemetry, no code of the test's in it.
    Stops when ``stop_file`` exists."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    model = DDP(torch.nn.Linear(8, 1))
    for step in range(max_steps):
        time.sleep(COMPUTE[ctx.rank])
        model(torch.randn(4, 8)).sum().backward()
        dask_ddp.report(loss=1.0 / (step + 1))
        if step % 10 == 0 and os.path.exists(stop_file):
            return step
    return max_steps


def one_step():
    dask_ddp.report(loss=1.0)
    return dask_ddp.get_context().rank


def base_url(client) -> str:
    return client.dashboard_link.rsplit("/", 1)[0]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def scrape(client) -> dict:
    """``/metrics`` parsed by prometheus_client: ``{name: [(labels, value)]}`` of the dask_ddp_ families."""
    status, text = get(base_url(client) + "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("dask_ddp_"):
                out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def per_rank(samples, run_id: str) -> dict[int, float]:
    return {int(labels["rank"]): value for labels, value in samples if labels["job"] == run_id}


# ---- the scheduler's state, fed by hand ------------------------------------------------------------------------
def batch(run_id: str, rank: int, *items, attempt: int = 0) -> tuple[str, dict]:
    # as the scheduler gets it: Dask's wire (msgpack) turns lists into tuples
    return f"dask-ddp-{run_id}", {"run": f"{run_id}-{attempt}", "rank": rank, "attempt": attempt, "seq": 0,
                                  "items": tuple(items)}


def test_state_keeps_each_ranks_latest_telemetry_and_its_step_times():
    state = DashboardState(history=3)
    assert state.feed(JOBS_TOPIC, {"kind": "job", "run": "fit-0a1b2c3d", "name": "fit", "state": "RUNNING",
                                   "attempt": 0, "time": 10.0, "ranks": [
                                       {"rank": 0, "worker": "tcp://a:1", "host": "a", "device": "cpu"},
                                       {"rank": 1, "worker": "tcp://b:2", "host": "b", "device": "cpu"}]})
    for i in range(5):
        state.feed(*batch("fit-0a1b2c3d", 1, telemetry(1, i, 0.1 * (i + 1), at=11.0 + i)))
    state.feed(*batch("fit-0a1b2c3d", 0, {"kind": "metric", "rank": 0, "attempt": 0, "step": 7, "time": 20.0}))
    job = state.snapshot()[0]
    rows = rank_rows(job, now=21.0)
    assert (job.name, job.state, rows["rank"], rows["worker"]) == ("fit", "RUNNING", [0, 1], ["tcp://a:1", "tcp://b:2"])
    assert rows["step"] == [7, 4] and rows["step_time"] == [None, pytest.approx(0.5)]
    assert rows["last_seen"] == [1.0, 6.0] and rows["input_wait"] == [None, 0.25]
    assert [round(s, 3) for _, s in job.ranks[1].history] == [0.3, 0.4, 0.5]  # bounded: the latest 3


def test_the_page_shows_gpu_telemetry_and_the_device_it_implies():
    """No GPU here: the values a GPU rank sends (the agreed fields) are fed by hand."""
    from dask_ddp.dashboard.page import rank_table

    state = DashboardState()
    state.feed(*batch("g-0a1b2c3d", 0, telemetry(0, 9, 0.25, gpu_util=87.0, gpu_mem_bytes=3 * 2**30,
                                                 gpu_mem_peak_bytes=5 * 2**30)))
    table = rank_table(state.jobs["g-0a1b2c3d"], now=time.time())
    assert table["gpu"] == ["87 % 3.00 GiB (peak 5.00 GiB)"] and table["device"] == ["cuda"]
    assert table["step_time"] == ["250.0 ms"] and table["samples_per_s"] == ["128.0"]


# what a user or a job controls (names, worker addresses, straggler causes and messages), written to run as HTML
HOSTILE_NAME = "<img src=x onerror=alert(1)>"
HOSTILE_MESSAGE = "<script>alert(2)</script> rank 1 is slow <img src=y onerror=alert(3)>"


def hostile_state(run_id: str = "xss-0a1b2c3d") -> DashboardState:
    state = DashboardState()
    for msg in hostile_messages(run_id):
        assert state.feed(JOBS_TOPIC, msg)
    return state


def hostile_messages(run_id: str) -> list[dict]:
    return [{"kind": "job", "run": run_id, "name": HOSTILE_NAME, "state": "RUNNING", "attempt": 0,
             "time": time.time(), "ranks": [{"rank": 0, "worker": "<b>tcp://a:1</b>", "host": "<i>a</i>"},
                                            {"rank": 1, "worker": "tcp://b:2", "host": "b", "device": "cpu"}]},
            {"kind": "straggler", "run": run_id, "rank": 1, "worker": "tcp://b:2", "host": "b",
             "cause": "<script>alert(4)</script>", "time": time.time(), "message": HOSTILE_MESSAGE}]


def html_tags(text: str) -> set[str]:
    """The elements a browser would make of ``text`` as HTML."""
    from html.parser import HTMLParser

    class Tags(HTMLParser):
        found: set = set()

        def handle_starttag(self, tag, attrs):
            self.found.add(tag)

    parser = Tags()
    parser.feed(text)
    return parser.found


def test_the_page_shows_names_and_messages_as_text_never_as_html():
    """The Div's HTML escapes what jobs send; the tables render their cells as text (StringFormatter), so they
    hold it as sent."""
    from bokeh.models import DataTable, Div, StringFormatter

    from dask_ddp.dashboard.page import DDPPage

    page = DDPPage(hostile_state())
    page.update()
    html = [div.text for div in page.root.select({"type": Div})]
    assert any("&lt;img src=x onerror=alert(1)&gt;" in h for h in html), html
    assert any("&lt;script&gt;alert(2)&lt;/script&gt; rank 1 is slow &lt;img" in h for h in html), html
    assert set().union(*map(html_tags, html)) <= {"h3", "h4", "p", "small", "b"}, html
    tables = list(page.root.select({"type": DataTable}))
    assert tables and all(type(c.formatter) is StringFormatter for t in tables for c in t.columns)
    assert page.jobs.data["name"] == [HOSTILE_NAME]
    assert page.ranks.data["worker"] == ["<b>tcp://a:1</b>", "tcp://b:2"]
    assert page.ranks.data["straggler"] == ["", "yes (<script>alert(4)</script>)"]


def test_state_ignores_other_topics_malformed_messages_and_late_ones():
    state = DashboardState()
    assert not state.feed("all", {"action": "remove-worker"})
    assert not state.feed("dask-ddp-x-0a1b2c3d", {"items": "not a list"})
    assert not state.feed(JOBS_TOPIC, {"kind": "job", "run": 5})
    assert not state.feed(JOBS_TOPIC, {"kind": "straggler", "run": "x", "rank": "one"})
    state.feed(JOBS_TOPIC, {"kind": "job", "run": "x", "name": "x", "state": "FINISHED", "attempt": 0, "time": 5.0})
    assert not state.feed(JOBS_TOPIC, {"kind": "job", "run": "x", "name": "x", "state": "RUNNING", "time": 4.0})
    assert state.jobs["x"].state == "FINISHED"


def test_a_restart_replaces_the_ranks_and_late_batches_of_the_old_attempt_are_dropped():
    state = DashboardState()
    state.feed(*batch("r-0a1b2c3d", 0, telemetry(0, 3, 0.2), telemetry(0, 4, 0.2)))
    state.feed(JOBS_TOPIC, {"kind": "straggler", "run": "r-0a1b2c3d", "rank": 0, "worker": "w", "host": "h",
                            "cause": "compute", "time": time.time(), "message": "rank 0 is slow"})
    assert rank_rows(state.jobs["r-0a1b2c3d"])["straggler"] == ["compute"]
    state.feed(*batch("r-0a1b2c3d", 1, telemetry(1, 0, 0.3, attempt=1), attempt=1))
    assert not state.feed(*batch("r-0a1b2c3d", 0, telemetry(0, 5, 0.2)))
    job = state.jobs["r-0a1b2c3d"]
    assert (job.attempt, sorted(job.ranks), rank_rows(job)["straggler"]) == (1, [1], [None])


def test_state_keeps_the_last_jobs_and_drops_ended_ones_first():
    state = DashboardState(keep_jobs=2)
    for i, st in enumerate(["RUNNING", "FINISHED", "RUNNING"]):
        state.feed(JOBS_TOPIC, {"kind": "job", "run": f"j{i}", "name": "j", "state": st, "time": float(i)})
    assert list(state.jobs) == ["j0", "j2"]


def test_the_sweeps_table_shows_what_a_sweep_sends_as_text():
    """A sweep's name and state (a dask-ddp-jobs message anyone can log) are text in the sweeps table's HTML."""
    from dask_ddp.dashboard.page import DDPPage, sweeps_html

    state = DashboardState()
    assert state.feed(JOBS_TOPIC, {"kind": "sweep", "sweep": HOSTILE_NAME, "state": "<script>alert(5)</script>",
                                   "time": time.time(), "n_trials": 4, "trials": {"RUNNING": 1}, "busy": 1, "room": 2,
                                   "occupancy": 0.5})
    html = sweeps_html(list(state.sweeps.values()))
    assert html_tags(html) <= {"h4", "table", "tr", "th", "td"}, html
    assert "&lt;script&gt;alert(5)&lt;/script&gt;" in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    page = DDPPage(state)
    page.update()
    assert page.sweeps.text == html


def test_the_page_keeps_only_the_ranks_of_a_jobs_plan_and_counts_the_others():
    """Rank code can send items with any rank number: the page keeps the ranks of the job's plan (the controller's
    message lists them), at most MAX_UNPLANNED before a plan was heard and MAX_RANKS whatever a message says."""
    from dask_ddp.dashboard.page import DDPPage
    from dask_ddp.dashboard.state import MAX_RANKS, MAX_UNPLANNED

    state = DashboardState()
    run_id = "fit-0a1b2c3d"
    assert state.feed(JOBS_TOPIC, {"kind": "job", "run": run_id, "name": "fit", "state": "RUNNING", "attempt": 0,
                                   "time": time.time(), "ranks": [{"rank": 0}, {"rank": 1}]})
    forged = [telemetry(r, 1, 0.1) for r in range(5000)] + [{"kind": "metric", "rank": 4999, "step": 3}]
    state.feed(*batch(run_id, 1, *forged, {"kind": "dropped", "rank": -3, "count": 7}))
    state.feed(JOBS_TOPIC, {"kind": "straggler", "run": run_id, "rank": 77, "cause": "compute", "time": time.time()})
    job = state.jobs[run_id]
    assert sorted(job.ranks) == [0, 1] and job.world == 2
    assert job.ignored == 4998 + 1 + 1 + 1 and job.dropped == 0
    page = DDPPage(state)
    page.update()
    assert "5001 items about ranks outside the job's plan (2 ranks) were ignored" in page.detail.text

    unplanned = "odd-0a1b2c3d"  # no plan heard (yet): a bound of its own
    state.feed(*batch(unplanned, 0, *[telemetry(r, 1, 0.1) for r in range(1000)]))
    assert len(state.jobs[unplanned].ranks) == MAX_UNPLANNED
    state.feed(JOBS_TOPIC, {"kind": "job", "run": unplanned, "name": "odd", "state": "RUNNING", "attempt": 0,
                            "time": time.time(), "ranks": [{"rank": r} for r in range(3)]})
    assert sorted(state.jobs[unplanned].ranks) == [0, 1, 2]  # the plan came: the others go
    huge = "huge-0a1b2c3d"  # a message that lists more ranks than any job has
    state.feed(JOBS_TOPIC, {"kind": "job", "run": huge, "name": "huge", "state": "RUNNING", "attempt": 0,
                            "time": time.time(), "ranks": [{"rank": r} for r in range(MAX_RANKS + 5000)]})
    assert len(state.jobs[huge].ranks) == MAX_RANKS


def test_publish_never_raises_and_needs_a_running_client():
    class Closed:
        status = "closed"

    class Broken:
        status = "running"
        loop = None  # add_callback on None raises

    publish(None, {"kind": "job"})
    publish(Closed(), {"kind": "job"})
    publish(Broken(), {"kind": "job"})


def test_the_controller_tells_the_scheduler_every_transition_with_its_attempt_and_ranks():
    """Stepped against test_controller's fake cluster; its client only records what would go to the scheduler."""
    from test_controller import Clock, FakeCluster, run_until_ended

    from dask_ddp.client.controller import Controller
    from dask_ddp.client.record import JobRecord
    from dask_ddp.wire.plan import make_plan, workers_from_scheduler_info
    from dask_ddp.wire.spec import LaunchSpec

    class Loop:
        sent: list = []

        def add_callback(self, fn, client, msg):
            self.sent.append(msg)

    class Client:
        status, loop = "running", Loop()

    cluster = FakeCluster(2)
    cluster.client = Client()
    plan = make_plan(workers_from_scheduler_info({"workers": cluster.scheduler_workers}), None)
    spec = LaunchSpec(call=b"", fn_name="train", run_id="job-1", first_plan=plan, workers=None, echo_logs=False,
                      worker_timeout=None, max_restarts=1, backend="gloo")
    ctl = Controller(spec, "job-1", cluster, JobRecord("job-1"), owner="JOB", clock=Clock())
    ctl.start()
    cluster.end(0, "died")
    cluster.end(1, "aborted")
    ctl.step(0)
    cluster.end(0, "ok", value=1)
    cluster.end(1, "ok", value=2)
    run_until_ended(ctl)
    sent = Loop.sent
    assert [(m["state"], m["attempt"]) for m in sent] == [("PENDING", 0), ("RUNNING", 0), ("RESTARTING", 0),
                                                          ("RUNNING", 1), ("FINISHED", 1)]
    assert all(m["kind"] == "job" and m["run"] == "job-1" and m["name"] == "train" for m in sent)
    assert sent[-1]["ranks"] == [{"rank": r.rank, "worker": r.address, "host": r.host, "device": "cpu"}
                                 for r in plan.ranks]
    state = DashboardState()
    for m in sent:
        state.feed(JOBS_TOPIC, m)
    assert (state.jobs["job-1"].state, state.jobs["job-1"].attempt) == ("FINISHED", 1)


# ---- a real scheduler ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_nothing_of_dask_ddp_is_on_a_scheduler_before_its_first_job():
    with local_client(1) as client:
        url = base_url(client)
        assert NAME not in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))
        assert get(url + "/ddp")[0] == 404
        assert "individual-ddp" not in get(url + "/individual-plots.json")[1]
        assert "dask_ddp_" not in get(url + "/metrics")[1]
        with dask.config.set({"ddp.dashboard.enabled": False}):  # the opt-out
            assert run(client, one_step).result(timeout=120) == [0]
        assert NAME not in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))
        assert run(client, one_step).result(timeout=120) == [0]
        assert NAME in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))
        assert get(url + "/ddp")[0] == 200
        plots = json.loads(get(url + "/individual-plots.json")[1])
        assert plots.get("Individual Ddp") == "/individual-ddp", plots
        assert 'href="ddp"' in get(url + "/workers")[1]  # a tab in the top bar of Dask's own pages
        run(client, one_step).result(timeout=120)  # a second job: installed once, one tab
        assert get(url + "/workers")[1].count('href="ddp"') == 1


def _pull(client, name: str) -> dict:
    from bokeh.client import pull_session

    with pull_session(url=base_url(client) + "/ddp") as session:
        return dict(session.document.select_one({"name": name}).source.data)


def _step_ms(text: str) -> float:
    return float(text.removesuffix(" ms"))


@pytest.mark.slow
def test_the_page_and_metrics_follow_a_running_job(client, tmp_path):
    """A real 2-rank job's own telemetry (nothing fed by hand) reaches /metrics and the page, and the straggler the
    controller names (rank 1, its compute; the window shortened to 3 s) is flagged on both."""
    stop = str(tmp_path / "stop")
    with dask.config.set({"ddp.telemetry.straggler-window": 3}):
        job = run(client, train_until, stop, name="watched")
    try:
        got = wait_until(lambda: len(per_rank(scrape(client).get("dask_ddp_step_time_seconds", []), job.run_id)) == 2
                         and scrape(client), timeout=180, what="both ranks' step times on /metrics")
        step_times = per_rank(got["dask_ddp_step_time_seconds"], job.run_id)
        assert all(0.07 < t < 2.0 for t in step_times.values()), step_times  # lockstep: the slow rank's pace
        assert all(v > 50 * 2**20 for v in per_rank(got["dask_ddp_rss_bytes"], job.run_id).values())
        assert min(per_rank(got["dask_ddp_step"], job.run_id).values()) >= 0
        workers = {int(lb["rank"]): lb["worker"] for lb, _ in got["dask_ddp_rank_info"] if lb["job"] == job.run_id}
        assert workers == dict(enumerate(job.plan.addresses))
        assert [(lb["name"], lb["state"], lb["attempt"]) for lb, _ in got["dask_ddp_job_info"]
                if lb["job"] == job.run_id] == [("watched", "RUNNING", "1")]
        assert "dask_ddp_gpu_utilization_percent" not in got  # no GPU: no series rather than zeros
        shares = per_rank(got["dask_ddp_goodput_ratio"], job.run_id)
        assert set(shares) == {0, 1} and all(0 <= v <= 1 for v in shares.values()), shares
        spent = {(lb["rank"], lb["category"]) for lb, v in got["dask_ddp_goodput_seconds"] if lb["job"] == job.run_id}
        assert spent == {(r, c) for r in "01" for c in RANK_CATEGORIES}, spent

        wait_until(lambda: per_rank([(lb, v) for lb, v in scrape(client).get("dask_ddp_straggler", [])
                                     if lb["cause"] == "compute"], job.run_id) == {1: 1.0}, timeout=120,
                   what="the controller's straggler (rank 1, compute) on /metrics")
        ranks = _pull(client, "ddp-ranks")
        assert ranks["rank"] == ["0", "1"] and ranks["worker"] == job.plan.addresses
        assert all(70 < _step_ms(t) < 2000 for t in ranks["step_time"]), ranks["step_time"]
        assert ranks["straggler"] == ["", "yes (compute)"], ranks["straggler"]
        assert all(m.endswith("MiB") for m in ranks["memory"]), ranks["memory"]
        assert all(g.endswith(" %") for g in ranks["goodput"]), ranks["goodput"]
        jobs = _pull(client, "ddp-jobs")
        assert job.run_id in jobs["run"] and jobs["state"][jobs["run"].index(job.run_id)] == "RUNNING"
        assert jobs["goodput"][jobs["run"].index(job.run_id)].endswith(" %"), jobs["goodput"]
        assert any("straggler: rank 1" in h[3] for h in job.history), job.history
    finally:
        open(stop, "w").close()
    job.result(timeout=120)
    wait_until(lambda: job.run_id not in str(scrape(client).get("dask_ddp_step", [])), timeout=60,
               what="an ended job's series to go")
    states = client.run_on_scheduler(lambda dask_scheduler: {
        run_id: j.state for run_id, j in dask_scheduler.plugins[NAME].state.jobs.items()})
    assert states[job.run_id] == "FINISHED"


DIES = """
import sys, time
from dask.distributed import Client
import dask_ddp

def forever():
    for step in range(1_000_000):
        dask_ddp.report(loss=1.0, step=step)
        time.sleep(0.05)

if __name__ == "__main__":
    client = Client(sys.argv[1])
    job = dask_ddp.dispatch.run(client, forever, name="orphan", progress=False)
    while not len(job.metrics):
        time.sleep(0.05)
    print(job.run_id, flush=True)
    time.sleep(3600)
"""


@pytest.mark.slow
def test_a_killed_clients_job_topic_leaves_the_scheduler(client, tmp_path):
    """A notebook killed while its job runs never drops its job's event topic: the scheduler's dashboard plugin
    drops it when the scheduler removes the client (no other client follows it), and shows the job ended."""
    import subprocess
    import sys

    from _cluster import no_running_ranks

    def topics(dask_scheduler=None):
        return [t for t in dask_scheduler._broker._topics if t.startswith("dask-ddp-") and t != "dask-ddp-jobs"]

    def state_of(run_id, dask_scheduler=None):
        job = dask_scheduler.plugins["dask-ddp-dashboard"].state.jobs.get(run_id)
        return None if job is None else job.state

    script = tmp_path / "notebook.py"
    script.write_text(DIES)
    proc = subprocess.Popen([sys.executable, str(script), client.scheduler.address], stdout=subprocess.PIPE,
                            text=True)
    try:
        run_id = proc.stdout.readline().strip()
        assert run_id.startswith("orphan-"), run_id
        assert f"dask-ddp-{run_id}" in client.run_on_scheduler(topics)
        assert client.run_on_scheduler(state_of, run_id) == "RUNNING"
        proc.kill()
        proc.wait(30)
        wait_until(lambda: f"dask-ddp-{run_id}" not in client.run_on_scheduler(topics), 30,
                   what="the killed client's job topic to leave the scheduler")
        assert client.run_on_scheduler(state_of, run_id) == "CANCELLED"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        wait_until(lambda: no_running_ranks(client), 60, what="the killed client's ranks to stop")


# ---- in a browser --------------------------------------------------------------------------------------------
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")

# every text of the page, shadow roots included (Bokeh 3 renders its widgets inside them)
PAGE_TEXT = """
function texts(root) {
  let out = [];
  for (const el of root.querySelectorAll('*')) {
    if (el.shadowRoot) out = out.concat(texts(el.shadowRoot));
    if (el.children.length === 0 && el.textContent) out.push(el.textContent.trim());
  }
  return out;
}
return texts(document).join('\\n');
"""


def _browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    if not (CHROMIUM and DRIVER):
        pytest.skip("Chromium is not installed: apt-get install -y chromium chromium-driver (as .ci/run does)")
    import tempfile

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="ddp-chromium-")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1500,1100", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=DRIVER), options=options)
    return driver, profile


@pytest.mark.slow
def test_the_ddp_page_in_a_real_browser_lists_both_ranks_with_their_step_times(client, tmp_path):
    driver, profile = _browser()
    stop = str(tmp_path / "stop")
    job = run(client, train_until, stop, name="browser")
    try:
        wait_until(lambda: len(per_rank(scrape(client).get("dask_ddp_step_time_seconds", []), job.run_id)) == 2,
                   timeout=180, what="both ranks' telemetry at the scheduler")
        driver.get(base_url(client) + "/status")
        from selenium.webdriver.common.by import By

        link = wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, 'a[href="ddp"]'), timeout=60,
                          what="the DDP tab in the dashboard's top bar")[0]
        link.click()
        text = wait_until(lambda: (lambda t: job.run_id in t and len(re.findall(r"\d+\.\d ms", t)) >= 2 and t)(
            driver.execute_script(PAGE_TEXT)), timeout=90, what="the DDP page with both ranks' step times")
        assert driver.current_url.endswith("/ddp")
        for address in job.plan.addresses:
            assert address in text, (address, text[-2000:])
        assert len(re.findall(r"\d+\.\d ms", text)) >= 2, text[-2000:]
        if os.environ.get("DDP_SCREENSHOT"):  # the README's picture: a few more points on the step-time chart
            time.sleep(3)  # (the test's own screenshot, in tmp_path, is only checked to be a PNG)
        shot = os.environ.get("DDP_SCREENSHOT") or str(tmp_path / "ddp-dashboard.png")  # the README's: set it to
        assert driver.save_screenshot(shot)  # docs/img/ddp-dashboard.png (a run in CI leaves the tree as it was)
        with open(shot, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    finally:
        open(stop, "w").close()
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
    job.result(timeout=120)


# every element of the page with an onerror attribute, every script that alerts, and all its text (each text
# node), shadow roots included
PAGE_ELEMENTS = """
function found(root) {
  let out = {elements: [], text: []};
  for (const el of root.querySelectorAll('*')) {
    if (el.shadowRoot) {
      const inner = found(el.shadowRoot);
      out.elements.push(...inner.elements);
      out.text.push(...inner.text);
    }
    if (el.hasAttribute('onerror') || (el.tagName === 'SCRIPT' && el.textContent.includes('alert'))) {
      out.elements.push(el.outerHTML);
    }
    for (const node of el.childNodes) if (node.nodeType === Node.TEXT_NODE) out.text.push(node.data);
  }
  return out;
}
const all = found(document);
return {elements: all.elements, text: all.text.join('\\n')};
"""


@pytest.mark.slow
def test_a_job_named_like_html_shows_as_text_in_a_real_browser(client):
    """A job's name, its ranks' workers, a straggler's cause and message, sent as the controller sends them
    (``dask-ddp-jobs``), show as the text they are: no element of theirs in the DOM, nothing of theirs runs (no
    alert)."""
    from dask_ddp.dashboard import install

    driver, profile = _browser()
    run_id = "xss-1a2b3c4d"
    try:
        assert install(client)
        for msg in hostile_messages(run_id):
            client.log_event(JOBS_TOPIC, msg)
        wait_until(lambda: client.run_on_scheduler(lambda dask_scheduler: run_id in getattr(
            dask_scheduler.plugins[NAME].state, "jobs", {})), timeout=30, what="the messages at the scheduler")
        # alert() records its calls instead of opening a dialog (which would fail every later call of the driver)
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {
            "source": "window.alerts = []; window.alert = (m) => window.alerts.push(String(m));"})
        driver.get(base_url(client) + "/ddp")
        page = wait_until(lambda: (lambda p: "rank 1 is slow" in p["text"] and "tcp://b:2" in p["text"] and p)(
            driver.execute_script(PAGE_ELEMENTS)), timeout=90, what="the DDP page with the job's heading and ranks")
        time.sleep(1)  # an img's onerror runs once its (missing) source failed to load
        assert driver.execute_script("return window.alerts") == [], "the page ran a job's text as HTML"
        for shown in (HOSTILE_NAME, HOSTILE_MESSAGE, "<b>tcp://a:1</b>", "yes (<script>alert(4)</script>)"):
            assert shown in page["text"], (shown, page["text"][-2000:])
        assert page["elements"] == []
        assert driver.title == "Dask: DDP"
    finally:
        client.log_event(JOBS_TOPIC, hostile_messages(run_id)[0] | {"state": "FINISHED", "time": time.time()})
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)

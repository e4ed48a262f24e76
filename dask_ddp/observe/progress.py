"""The progress bars of :meth:`Job.wait` / :meth:`Job.result` and of ``Sweep.wait`` (tqdm's auto flavour).

Runs in: the client.

A widget in Jupyter, text in a terminal. A job's bar follows the highest ``step`` any
rank has reported (``total=`` on ``run`` gives the bar its end) and shows
the latest metrics of rank 0 in its postfix. A sweep's bar counts its ended trials and
shows how many run, were pruned or failed, and the best value so far.
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


class Progress:
    """One bar over a job's reported steps; ``update()`` is cheap and called from the waiting thread."""

    def __init__(self, job, total: int | None = None):
        self.job = job
        self.bar = tqdm(total=total, desc=job.run_id, unit="step", dynamic_ncols=True, leave=True)
        self._seen = 0
        self.table = None  # in Jupyter, the per-rank table under the bar (a widget, as the bar is)
        telemetry = job.spec.telemetry_interval  # None: the job runs without telemetry
        notebook = sys.modules.get("tqdm.notebook")  # imported by tqdm.auto in Jupyter only
        if notebook is not None and isinstance(self.bar, notebook.tqdm_notebook) and telemetry is not None:
            from dask_ddp.observe.display import LiveTable

            self.table = LiveTable(job)

    def update(self) -> None:
        if self.table is not None:
            self.table.update()
        record = self.job._record
        with record.cond:
            if record.n_metrics == self._seen:
                return
            self._seen, top, latest = record.n_metrics, record.top_step + 1, dict(record.latest)
        if top > self.bar.n:
            self.bar.update(top - self.bar.n)
        last0 = latest.get(0) or latest[max(latest)]
        post = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in last0.items()
                if k not in ("kind", "rank", "attempt", "time", "step")}
        self.bar.set_postfix(post, refresh=False)

    def close(self) -> None:
        self.update()
        if self.table is not None:
            self.table.update(force=True)
        self.bar.set_description(f"{self.job.run_id} {self.job.state}")
        self.bar.close()

    @staticmethod
    def write(line: str, to_stderr: bool = False) -> None:
        """Print a line without breaking an active bar."""
        tqdm.write(line, file=sys.stderr if to_stderr else sys.stdout)


class SweepProgress:
    """One bar over a sweep's trials (``sweep.counts()``, ``sweep.best``); ``update()`` is cheap."""

    ENDED = ("COMPLETE", "PRUNED", "FAILED", "CANCELLED")

    def __init__(self, sweep):
        self.sweep = sweep
        self.bar = tqdm(total=sweep.spec.n_trials, desc=sweep.name, unit="trial", dynamic_ncols=True, leave=True)

    def update(self) -> None:
        counts = self.sweep.counts()
        ended = sum(counts[s] for s in self.ENDED)
        if ended > self.bar.n:
            self.bar.update(ended - self.bar.n)
        post = {s.lower(): n for s, n in counts.items() if n and s in ("RUNNING", "PRUNED", "FAILED")}
        if counts["COMPLETE"]:
            post["best"] = f"{self.sweep.best['value']:.4g}"
        self.bar.set_postfix(post, refresh=False)

    def close(self) -> None:
        self.update()
        self.bar.set_description(f"{self.sweep.name} {self.sweep.state}")
        self.bar.close()

"""A sweep in MLflow: one parent run for the sweep, one child run per trial under it.

Runs in: the client (the sweep's driver thread; for a detached sweep, the scheduler's process).

``sweep(..., mlflow=MLflowSink(tracking_uri, experiment=...))`` takes the sink as a template: the sweep's
parent run is made in its experiment when the sweep starts (named after the sweep; parameters: ``metric``,
``mode``, ``n_trials`` and the space; tag ``dask_ddp.sweep``), and each trial's job gets a sink of its own
(:class:`~dask_ddp.observe.mlflow_sink.MLflowSink`, the same tracking store and experiment) whose run is the
trial's: named ``<sweep>-trial<n>``, tagged ``mlflow.parentRunId`` (MLflow shows it under the parent),
``dask_ddp.sweep`` and ``dask_ddp.trial``, with the trial's parameters and every metric of every rank. When a
trial ends the child gets the tag ``dask_ddp.trial_state`` (COMPLETE, PRUNED, FAILED, CANCELLED) and the
parent the metrics ``trial_value`` and ``best_value`` at step ``<trial number>``; the parent ends with the
sweep (FINISHED, FAILED or KILLED). A failing tracking store is logged once and the sweep goes on without it.
"""

from __future__ import annotations

import logging
from typing import Any

from dask_ddp.observe.mlflow_sink import MLflowSink, mask_text, shown

__all__ = ["SweepRuns"]

logger = logging.getLogger("dask_ddp")


class SweepRuns:
    """The MLflow runs of one sweep, made through the template ``sink``'s tracking store and experiment."""

    def __init__(self, sink: MLflowSink, name: str) -> None:
        self.sink, self.name = sink, name
        self.parent: str | None = None
        self.children: dict[int, str] = {}  # trial number -> its MLflow run id, once its sink made it
        self._sinks: dict[int, MLflowSink] = {}
        self._client: Any = None
        self.failed = False

    def start(self, params: dict) -> None:
        """Make the parent run (in the driver's thread, before the first trial)."""
        def make():
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self.sink.tracking_uri)
            found = self._client.get_experiment_by_name(self.sink.experiment)
            experiment = found.experiment_id if found else self._client.create_experiment(self.sink.experiment)
            run = self._client.create_run(experiment, run_name=mask_text(self.name),
                                          tags={"dask_ddp.sweep": mask_text(self.name)})
            self.parent = run.info.run_id
            from mlflow.entities import Param

            self._client.log_batch(self.parent, params=[Param(k, v) for k, v in shown(params).items()][:100])
        self._guard(make)

    def trial_sink(self, number: int, params: dict) -> MLflowSink | None:
        """The sink of trial ``number``'s job (a child run of the parent); None once MLflow has failed."""
        if self.failed or self.parent is None:
            return None
        sink = MLflowSink(self.sink.tracking_uri, experiment=self.sink.experiment,
                          run_name=f"{self.name}-trial{number}", params={**self.sink.params, **params,
                                                                          "trial": number},
                          tags={**self.sink.tags, "mlflow.parentRunId": self.parent, "dask_ddp.sweep": self.name,
                                "dask_ddp.trial": str(number)}, flush_interval=self.sink.flush_interval)
        self._sinks[number] = sink
        return sink

    def trial_ended(self, number: int, state: str, value: float | None, best: float | None) -> None:
        """Tag the child with the trial's end, and log its value and the best so far on the parent."""
        sink = self._sinks.pop(number, None)

        def log():
            if sink is not None and sink.last_run_id is not None:
                self.children[number] = sink.last_run_id
                self._client.set_tag(sink.last_run_id, "dask_ddp.trial_state", state)
            if value is not None:
                self._client.log_metric(self.parent, "trial_value", float(value), step=number)
            if best is not None:
                self._client.log_metric(self.parent, "best_value", float(best), step=number)
        if self.parent is not None:
            self._guard(log)

    def finish(self, state: str) -> None:
        """End the parent run with the sweep's end (FINISHED, FAILED, or KILLED for a cancelled sweep)."""
        if self.parent is not None:
            status = {"FINISHED": "FINISHED", "CANCELLED": "KILLED"}.get(state, "FAILED")
            self._guard(lambda: self._client.set_terminated(self.parent, status=status))

    def _guard(self, fn) -> None:
        if self.failed:
            return
        try:
            fn()
        except Exception:  # noqa: BLE001 - MLflow is never a reason for a sweep to fail
            self.failed = True
            logger.warning("dask-ddp sweep %s: MLflow failed; the sweep goes on without it", self.name,
                           exc_info=True)

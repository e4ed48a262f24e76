"""MLflowSink against a real local MLflow tracking store (a folder), read back through MLflow's own client.

Real parts: a 2-rank gloo job on the module's LocalCluster that fails once and restarts (max_restarts=1), the
sink as its callback on the client, MLflow's file store in a temporary folder (one test of metric names uses a
stand-in for MLflow's client instead). Skipped only without MLflow (``pip install 'dask-ddp[mlflow]'``; the test
extra brings it).
"""

from __future__ import annotations

import time

import pytest
from _cluster import run, wait_until

import dask_ddp

mlflow = pytest.importorskip("mlflow", reason="MLflow is not installed: pip install 'dask-ddp[mlflow]'")

STEPS = 5


def train(steps, lr):
    """Report ``loss`` = 100 * attempt + 10 * rank + step; rank 1 raises at step 3 of the first attempt."""
    ctx = dask_ddp.get_context()
    for step in range(steps):
        if ctx.restart_count == 0 and ctx.rank == 1 and step == 3:
            raise RuntimeError("rank 1 fails once")
        dask_ddp.report(loss=100 * ctx.restart_count + 10 * ctx.rank + step, lr=lr, step=step)
    return ctx.rank


@pytest.fixture
def store(tmp_path, monkeypatch):
    # MLflow 3 keeps its folder store in maintenance mode and asks for this to use it; SQLite needs the full
    # mlflow (SQLAlchemy, alembic), which the test extra does not install
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


@pytest.mark.slow
def test_one_mlflow_run_per_job_with_its_params_once_and_every_metric_per_rank_and_step(client, store):
    sink = dask_ddp.MLflowSink(store, experiment="ddp-test", params={"dataset": "digits"})
    job = run(client, train, STEPS, lr=0.1, max_restarts=1, callbacks=[sink], name="mlflow-job")
    assert job.result(timeout=300) == [0, 1]
    assert [new for _, _, new, _ in job.history].count("RESTARTING") == 1

    reader = mlflow.MlflowClient(tracking_uri=store)
    experiment = reader.get_experiment_by_name("ddp-test")
    runs = reader.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "one MLflow run per job, restarts included"
    found = runs[0]
    assert found.info.status == "FINISHED" and found.info.run_name == "mlflow-job"
    assert found.data.tags["dask_ddp.run_id"] == job.run_id and found.data.tags["dask_ddp.attempts"] == "2"
    assert found.data.params == {"arg0": str(STEPS), "lr": "0.1", "world_size": "2", "backend": job.spec.backend,
                                 "max_restarts": "1", "name": "mlflow-job", "dataset": "digits"}

    rows = job.metrics
    for rank in (0, 1):
        history = reader.get_metric_history(found.info.run_id, f"loss/rank{rank}")
        got = sorted((m.step, m.value, m.timestamp) for m in history)
        mine = rows[rows["rank"] == rank]
        want = sorted((int(s), float(v), 1000 * t.timestamp())  # job.metrics' time: a UTC Timestamp
                      for s, v, t in zip(mine["step"], mine["loss"], mine["time"]))
        # every report of the rank, at its step and time (ms; the Timestamp's float round trip may move it 1 ms)
        assert [g[:2] for g in got] == [w[:2] for w in want]  # from both attempts
        assert all(abs(g[2] - w[2]) <= 1 for g, w in zip(got, want)), (got, want)
        assert {v for s, v, _ in got if v >= 100} == {100 + 10 * rank + s for s in range(STEPS)}  # attempt 2, whole
    assert len(reader.get_metric_history(found.info.run_id, "lr/rank1")) == len(rows[rows["rank"] == 1])

    assert sink.run_id is None  # ready for another job


def test_a_cancelled_job_ends_its_mlflow_run_killed(client, store):
    def slow():
        for step in range(10_000):
            dask_ddp.report(loss=float(step))
            time.sleep(0.05)

    sink = dask_ddp.MLflowSink(store, experiment="cancelled")
    job = run(client, slow, callbacks=[sink])
    wait_until(lambda: len(job.metrics) > 0, timeout=120, what="a first report")
    job.cancel()
    reader = mlflow.MlflowClient(tracking_uri=store)
    (found,) = reader.search_runs([reader.get_experiment_by_name("cancelled").experiment_id])
    assert found.info.status == "KILLED"
    assert len(reader.get_metric_history(found.info.run_id, "loss/rank0")) == len(
        job.metrics[job.metrics["rank"] == 0])


KEY, SECRET = "AKIAEXAMPLE", "SECRETKEY"
URL = f"s3://{KEY}:{SECRET}@bucket/x"


def read_data(data, storage_options, loaders=(), **more):
    """What a training function over S3 takes: a URL and its storage options (reports once, opens nothing)."""
    dask_ddp.report(loss=1.0)
    return dask_ddp.get_context().rank


@pytest.mark.slow
def test_credentials_in_a_jobs_arguments_and_options_never_reach_mlflow(client, store):
    """Through the masking the logs use (dask_ddp.storage): URL userinfo, secret-looking options (in dicts,
    in lists), a secret-looking argument, and each such value wherever else it appears."""
    options = {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    sink = dask_ddp.MLflowSink(store, experiment="secrets", params={"source": URL, "token": "tok-12345"},
                               tags={"data": URL})
    import argparse

    presigned = f"https://bucket.s3.amazonaws.com/x?X-Amz-Credential={KEY}%2F20250101&X-Amz-Signature=sig{SECRET}"
    job = run(client, read_data, URL, storage_options=options, loaders=[{"password": SECRET}], callbacks=[sink],
              checkpoint_dir=f"s3://{KEY}:{SECRET}@bucket/ckpt", checkpoint_options={"key": KEY, "secret": SECRET},
              name="secrets", cli=argparse.Namespace(aws_secret_access_key=f"ns{SECRET}", epochs=2),
              environment=f"AWS_SECRET_ACCESS_KEY=env{SECRET} AWS_REGION=x", shard=presigned, hub="hf_" + "Ab3" * 10)
    assert job.result(timeout=300) == [0, 1]

    reader = mlflow.MlflowClient(tracking_uri=store)
    (found,) = reader.search_runs([reader.get_experiment_by_name("secrets").experiment_id])
    logged = {**found.data.params, **found.data.tags, "run name": found.info.run_name}
    assert not [(k, v) for k, v in logged.items() if KEY in v or SECRET in v or "12345" in v], logged
    assert found.data.params["arg0"] == "s3://***@bucket/x" and found.data.params["source"] == "s3://***@bucket/x"
    assert found.data.params["storage_options"] == repr(
        {"key": "***", "secret": "***", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}})
    assert (found.data.params["token"], found.data.tags["data"]) == ("***", "s3://***@bucket/x")
    assert found.data.params["loaders"] == "[{'password': '***'}]"
    assert found.data.params["name"] == "secrets"
    assert found.data.params["cli"] == "Namespace(aws_secret_access_key='***', epochs=2)"
    assert found.data.params["environment"] == "AWS_SECRET_ACCESS_KEY=*** AWS_REGION=x"
    assert found.data.params["shard"] == "https://bucket.s3.amazonaws.com/x?X-Amz-Credential=***&X-Amz-Signature=***"
    assert found.data.params["hub"] == "***"


def test_a_metric_named_with_credentials_is_sent_masked():
    """No tracking server: the sink's MLflow client is a stand-in that keeps what it is given."""
    class Keeper:
        def __init__(self):
            self.metrics = []

        def log_batch(self, run_id, metrics=()):
            self.metrics.extend(metrics)

    sink = dask_ddp.MLflowSink(flush_interval=0)
    sink._client, sink.run_id = Keeper(), "run"
    sink.on_metrics({"kind": "metric", "rank": 1, "step": 2, "time": time.time(), f"read {URL}": 1.0, "loss": 0.5})
    assert sorted(m.key for m in sink._client.metrics) == ["loss/rank1", "read s3://***@bucket/x/rank1"]


def test_secrets_in_config_objects_urls_assignments_and_tokens_are_masked():
    """What the masking of the logs did not catch: a dataclass's, a ``Namespace``'s (and ``SimpleNamespace``'s,
    a named tuple's) secret-looking fields, presigned URLs' signatures and credentials, ``KEY=value`` texts,
    and tokens known by their form; through the sink's own parameters, tags, run and metric names."""
    import argparse
    import dataclasses
    from types import SimpleNamespace
    from typing import NamedTuple

    from dask_ddp.observe.mlflow_sink import shown

    @dataclasses.dataclass
    class Config:
        lr: float = 0.1
        hf_token: str = "cfg-token-4242"
        store: dict = dataclasses.field(default_factory=lambda: {"password": "cfg-password-4242"})

    class Pair(NamedTuple):
        secret: str
        size: int

    presigned = ("https://bucket.s3.amazonaws.com/x.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256"
                 "&X-Amz-Credential=AKIAPRESIGNED4242%2F20250101%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date=20250101T000000Z"
                 "&X-Amz-Expires=3600&X-Amz-Security-Token=FwoGZXIvYXdzEPRESIGNED4242"
                 "&X-Amz-Signature=fe5f80f77d5fa3beca038a248ff027d0445342fe2855ddc963176630326f4242")
    tokens = {"github": "ghp_" + "a1B2" * 9, "hugging face": "hf_" + "Zx9" * 11, "openai": "sk-proj-" + "Q7w" * 8,
              "aws key id": "AKIAIOSFODNN74242XYZ",
              "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiI0MjQyIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THs4242"}
    secrets = ["cfg-token-4242", "cfg-password-4242", "ns-secret-4242", "simple-key-4242", "pair-secret-4242",
               "AKIAPRESIGNED4242", "EPRESIGNED4242", "630326f4242", "azure-sig-4242", "v2-signature-4242",
               "env-secret-4242", "flag-key-4242", *tokens.values()]
    values = {
        "config": Config(), "args": argparse.Namespace(aws_secret_access_key="ns-secret-4242", epochs=3),
        "simple": SimpleNamespace(api_key="simple-key-4242"), "pair": [Pair("pair-secret-4242", 2)],
        "shard_url": presigned, "azure": "https://a.blob.core.windows.net/c/x?sv=2022&sp=r&sig=azure-sig-4242",
        "v2": "https://s3.amazonaws.com/b/x?AWSAccessKeyId=AKIAV2&Expires=9&Signature=v2-signature-4242",
        "env": "AWS_SECRET_ACCESS_KEY=env-secret-4242 AWS_REGION=eu-west-1",
        "command": "train.py --api-key flag-key-4242 --epochs 3", **{f"{k} token": v for k, v in tokens.items()},
        "note": "tokenizer=gpt2 max_tokens=512 lr=0.1",
    }
    logged = shown(values)
    assert not [(k, v) for k, v in logged.items() for s in secrets if s in v or s in k], logged
    assert logged["config"] == "test_secrets_in_config_objects_urls_assignments_and_tokens_are_masked.<locals>." \
        "Config(lr=0.1, hf_token='***', store={'password': '***'})"
    assert logged["args"] == "Namespace(aws_secret_access_key='***', epochs=3)"
    assert "X-Amz-Credential=***" in logged["shard_url"] and "X-Amz-Signature=***" in logged["shard_url"]
    assert "X-Amz-Expires=3600" in logged["shard_url"]  # what is not secret stays readable
    assert logged["env"] == "AWS_SECRET_ACCESS_KEY=*** AWS_REGION=eu-west-1"
    assert logged["command"] == "train.py --api-key *** --epochs 3"
    assert logged["note"] == "tokenizer=gpt2 max_tokens=512 lr=0.1"  # words that only contain "token"

    class Keeper:
        def __init__(self):
            self.metrics = []

        def log_batch(self, run_id, metrics=()):
            self.metrics.extend(metrics)

    sink = dask_ddp.MLflowSink(flush_interval=0)
    sink._client, sink.run_id = Keeper(), "run"
    sink.on_metrics({"kind": "metric", "rank": 0, "step": 1, "time": time.time(), f"read {presigned}": 1.0,
                     f"with {tokens['github']}": 2.0})
    names = [m.key for m in sink._client.metrics]
    assert not [n for n in names for s in secrets if s in n], names

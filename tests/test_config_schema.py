"""dask-ddp's settings in Dask's schema style: ``dask_ddp/ddp-schema.yaml`` describes every setting of
``ddp.yaml`` (as distributed ships ``distributed-schema.yaml``), the defaults validate against it, and bad
values do not. Also the ecosystem's other conventions: a warning category of our own, a named logger."""

from __future__ import annotations

import copy
import logging
import warnings

import jsonschema
import pytest
import yaml

import dask_ddp
from dask_ddp import config
from dask_ddp.client.record import JobRecord


def load(path: str) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


SCHEMA = load(config.SCHEMA)
DEFAULTS = load(config._fn)


def leaves(node: dict, prefix: str = "") -> set[str]:
    return {name for key, value in node.items()
            for name in (leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"})}


def schema_leaves(node: dict, prefix: str = "") -> dict[str, dict]:
    out = {}
    for key, value in node["properties"].items():
        if value.get("type") == "object":
            out.update(schema_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_every_setting_has_a_described_entry_and_every_entry_a_setting():
    described = schema_leaves(SCHEMA)
    assert set(described) == leaves(DEFAULTS), set(described) ^ leaves(DEFAULTS)
    assert all(len(entry.get("description", "")) > 10 for entry in described.values()), [
        name for name, entry in described.items() if len(entry.get("description", "")) <= 10]


def test_the_defaults_and_the_live_config_validate():
    jsonschema.validate(DEFAULTS, SCHEMA)
    import dask

    jsonschema.validate({"ddp": dask.config.get("ddp")}, SCHEMA)  # what this process runs with


@pytest.mark.parametrize("path, value", [
    (("backend",), "mpi"), (("events", "flush-interval"), "fast"), (("events", "max-rows"), 0),
    (("timeout",), -1), (("preemption", "grow"), "yes"), (("events", "per-host"), "sometimes"),
    (("evnets",), {}),  # a misspelt section
])
def test_bad_values_are_refused(path, value):
    bad = copy.deepcopy(DEFAULTS)
    node = bad["ddp"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA)


def test_advice_is_a_warning_of_our_own_and_events_go_to_the_named_logger(caplog):
    assert issubclass(dask_ddp.DaskDDPWarning, UserWarning)
    record = JobRecord("r-0a1b2c3d", max_rows=10)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="dask_ddp"):
        warnings.simplefilter("always")
        record.add([{"kind": "metric", "rank": 0, "attempt": 0, "step": s, "time": 0.0, "x": 1.0}
                    for s in range(11)])
        record.add([{"kind": "dropped", "rank": 0, "attempt": 0, "time": 0.0, "what": "report", "reason": "keys",
                     "count": 3}])
        record.transition("RUNNING", "started")
    ours = [w for w in caught if issubclass(w.category, dask_ddp.DaskDDPWarning)]
    assert len(ours) == 2 and "ddp.events.max-rows" in str(ours[0].message)
    assert "max-report-keys" in str(ours[1].message)
    assert any(r.name == "dask_ddp" and "PENDING -> RUNNING" in r.getMessage() for r in caplog.records)

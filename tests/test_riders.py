"""checkpoint.riders: what else rides in every save, registered by its owner (the checkpoints import none)."""

import pytest

from dask_ddp.checkpoint import riders


@pytest.fixture(autouse=True)
def own_registry(monkeypatch):
    """The riders registered here leave with the test: the registry is process-wide, and a rider left in it
    would ride in every later save of this xdist worker (a streaming loader left alive did that to
    test_sharded_telemetry's byte count)."""
    monkeypatch.setattr(riders, "_RIDERS", dict(riders._RIDERS))
    monkeypatch.setattr(riders, "_HELD", dict(riders._HELD))


def test_a_rider_rides_along_is_taken_out_on_load_and_a_value_loaded_first_waits_for_its_rider():
    got = []
    riders.register("__dask_ddp_test_a__", lambda: {"pos": 3}, got.append)
    saved = riders.with_riders({"model": 1})
    assert saved == {"model": 1, "__dask_ddp_test_a__": {"pos": 3}}
    assert riders.with_riders({"model": 1, "__dask_ddp_test_a__": "mine"})["__dask_ddp_test_a__"] == "mine"
    loaded = riders.take({**saved, "__dask_ddp_test_b__": {"pos": 7}, "__not_ours__": 0})
    assert loaded == {"model": 1, "__not_ours__": 0} and got == [{"pos": 3}]  # the user's keys stay
    later = []
    riders.register("__dask_ddp_test_b__", dict, later.append)  # imported after the load: handed over now
    assert later == [{"pos": 7}]


def test_a_rider_key_must_be_reserved_so_no_users_key_is_ever_taken():
    with pytest.raises(ValueError, match="__dask_ddp_<name>__"):
        riders.register("model", dict, print)

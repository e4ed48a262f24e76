"""No value a user can report, log or print may break a worker: property-based fuzzing (hypothesis).

Dask's ``log_event`` accepts any int and any str, but msgpack then fails on ints outside [-2**63, 2**64 - 1]
and on text with lone surrogates (``os.listdir``'s non-UTF-8 names) inside the worker's batched stream, and
the scheduler drops the worker. The pure tests run thousands of generated cases through ``report()``, the
logging handler and the worker's relay; the cluster test ships thousands more to real ranks and checks that
every worker is still there afterwards.
"""

from __future__ import annotations

import logging

import dask
import msgpack
import pytest
from _cluster import run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dask_ddp
from dask_ddp.client.cluster import scheduler_workers
from dask_ddp.rank import reporting
from dask_ddp.wire.events import MAX_LINE, EventLimits, escaped, items_of, wire_safe
from dask_ddp.worker.relay import Relay

SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
TEXT = st.one_of(
    st.text(st.one_of(st.characters(), SURROGATES), max_size=40),
    st.binary(max_size=40).map(lambda b: b.decode("utf-8", "surrogateescape")),  # what os.listdir returns
)
NUMBERS = st.one_of(st.integers(), st.floats(), st.booleans(), st.integers(-(2**70), 2**70))
LONG_TEXT = st.one_of(TEXT, st.integers(9_990, 30_000).map(lambda n: "é" * n))


def encodes(msg) -> bool:
    try:
        msgpack.packb(msg, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return False
    return True


@pytest.fixture
def buffer():
    buf = reporting.EventBuffer(rank=0, attempt=0, limits=EventLimits(interval_bytes=1 << 40))  # what, not how much
    saved, reporting._BUFFER = reporting._BUFFER, buf
    yield buf
    reporting._BUFFER = saved


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=TEXT, value=NUMBERS)
@pytest.mark.slow
def test_report_takes_what_can_travel_and_names_the_key_of_what_cannot(buffer, key, value):
    buffer.drain()
    try:
        dask_ddp.report(**{"m": 0.0}) if not key else dask_ddp.report({key: value})
    except ValueError as exc:
        reserved = key in reporting.RESERVED_KEYS
        assert reserved or (type(value) is int and not reporting.INT_MIN <= value <= reporting.INT_MAX), exc
        assert reserved or "[-2**63, 2**64 - 1]" in str(exc)
        return
    [item] = buffer.items
    assert encodes(item), item


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(message=LONG_TEXT, arg=TEXT, name=TEXT)
@pytest.mark.slow
def test_log_records_always_encode_and_are_cut(buffer, message, arg, name):
    buffer.drain()
    handler = reporting._LogHandler(buffer)
    for msg, args in ((message, ()), ("skipping %s", (arg,))):  # logging.warning(text), and with an argument
        handler.emit(logging.LogRecord(name or "x", logging.WARNING, __file__, 1, msg, args, None))
    assert len(buffer.items) == 2 and all(encodes(item) for item in buffer.items)
    assert all(len(item["line"]) <= 4 * (MAX_LINE + 100) for item in buffer.items)  # escapes grow it


class FakeWorker:
    def __init__(self):
        self.sent = []

    def log_event(self, topic, msg):
        self.sent.append(msg)


@settings(max_examples=1000, deadline=None)
@given(lines=st.lists(LONG_TEXT, max_size=5),
       items=st.lists(st.dictionaries(TEXT, st.one_of(NUMBERS, TEXT, st.none()), max_size=4), max_size=5))
@pytest.mark.slow
def test_the_relay_never_publishes_what_msgpack_refuses(lines, items):
    """The worker-side guard: whatever reaches the relay (say, from a rank of another dask-ddp version)."""
    worker = FakeWorker()
    relay = Relay(worker, "t", 0, 0, "run-0", interval=1.0)
    for line in lines:
        relay.log("stdout", line)
    relay.extend([dict(it, kind="metric") for it in items], now=True)
    relay.flush()
    assert all(encodes(msg) for msg in worker.sent)
    assert all(encodes(item) for msg in worker.sent for item in items_of(msg))  # unpacked on the client too
    assert sum(len(items_of(m)) for m in worker.sent) == len(lines) + len(items)  # nothing lost


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 10**30])
def test_escaped_keeps_big_ints_as_floats(value):
    assert not wire_safe({"x": value}) and escaped({"x": value}) == {"x": float(value)}


# ---- on a real cluster ---------------------------------------------------------------------------------------

def noisy_rank(reports, lines):
    """Reports, logs and prints every generated case; returns how each report() call ended."""
    import logging as log

    ends = []
    lines = [*lines, "é" * 12_000, "\udcff" * 20_000]  # two long ones: cut with a marker
    for key, value in reports:
        try:
            dask_ddp.report({key or "empty": value})
            ends.append("ok")
        except (ValueError, TypeError) as exc:
            ends.append(type(exc).__name__)
    for line in lines:
        log.getLogger("user").warning("skipping %s", line)
        print(line, flush=True)
    return ends


def generated_cases(n_examples: int) -> tuple[list, list]:
    """Reports and lines drawn by hypothesis: ``n_examples`` examples of up to 12 of each, gathered in lists.

    (One list of thousands drawn at once takes hypothesis minutes; many small examples take seconds.)
    """
    reports, lines = [], []

    @settings(max_examples=n_examples, deadline=None, database=None)
    @given(st.lists(st.tuples(TEXT, NUMBERS), max_size=12), st.lists(TEXT, max_size=12))
    def gather(rs, ls):
        reports.extend(rs)
        lines.extend(ls)

    gather()
    return reports, lines


@pytest.mark.slow
def test_thousands_of_generated_reports_and_lines_leave_every_worker_in_place(client):
    reports, lines = generated_cases(400)
    assert len(reports) > 1000 and len(lines) > 1000
    workers = sorted(scheduler_workers(client))
    # what may travel, not how much (tests/test_limits.py): no limit in the way
    with dask.config.set({"ddp.echo-logs": False, "ddp.events.max-bytes-per-interval": 64 << 20}):
        job = run(client, noisy_rank, reports, lines)
    ends = job.result(timeout=300)
    assert sorted(scheduler_workers(client)) == workers, "a worker was lost"
    assert job.dropped == {}
    accepted = sum(e == "ok" for e in ends[0]) + sum(e == "ok" for e in ends[1])
    assert len(job.metrics) == accepted
    refused = [(k, v) for (k, v), e in zip(reports, ends[0]) if e != "ok"]
    assert all(type(v) is int and not -(2**63) <= v <= 2**64 - 1 or (k or "empty") in reporting.RESERVED_KEYS
               for k, v in refused), refused
    warnings = [line for line in job.logs if "WARNING user: skipping" in line]
    assert len(warnings) == 2 * (len(lines) + 2)
    assert sum("characters cut]" in line for line in job.logs) == 8  # 2 long lines, logged and printed, 2 ranks
    print(f"{len(reports)} reports and {len(lines)} lines per rank, {len(refused)} refused at report(); "
          f"workers lost: 0")

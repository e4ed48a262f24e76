"""The rank supervisor's small units alone: its output pump (real pipes, real threads) and its stop rule.

The stop rule's abort flag is a Dask ``Event`` on the scheduler; here it is a small stand-in with the same two
methods, so that an unreachable scheduler and the poll interval can be driven step by step. The supervisor
with both, on a real cluster, is exercised by every job of the suite.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from dask_ddp.wire.notices import Notice
from dask_ddp.worker.pump import OutputPump, lines
from dask_ddp.worker.stopping import ORPHANED, StopRule

STORE_WARNING = ["[W1125 TCPStore.cpp:125] [c10d] recvValue failed: Connection was likely closed by the peer",
                 "Exception raised from recvBytes at ../torch/csrc/distributed/c10d/Utils.hpp:670 (most recent call "
                 "first):", "frame #0: c10::Error::Error + 0x98", "<omitting python frames>", ""]


def pumped(stdout: list[str], stderr: list[str], stopping: bool) -> tuple[list[tuple[str, str]], OutputPump]:
    logged, lock = [], threading.Lock()

    def log(name, line):
        with lock:
            logged.append((name, line))

    pipes = {name: os.pipe() for name in ("stdout", "stderr")}
    streams = {name: os.fdopen(r, "rb") for name, (r, _) in pipes.items()}
    pump = OutputPump(streams, log, lambda wait: stopping, rank=3).start()
    for name, text in (("stdout", stdout), ("stderr", stderr)):
        with os.fdopen(pipes[name][1], "wb") as w:
            w.write("".join(f"{ln}\n" for ln in text).encode())
    pump.join(10)
    assert all(s.closed for s in streams.values()), "a pump closes its stream at end of file"
    return logged, pump


@pytest.mark.parametrize("stopping", [False, True])
def test_the_pump_relays_every_line_in_order_and_leaves_out_a_store_warning_only_during_a_stop(stopping):
    stderr = ["before"] + STORE_WARNING + ["after", "bad bytes \udcff".encode("utf-8", "surrogateescape")
                                           .decode("utf-8", "replace")]
    logged, pump = pumped(["a", "b", "c"], stderr, stopping)
    assert [line for name, line in logged if name == "stdout"] == ["a", "b", "c"]
    err = [line for name, line in logged if name == "stderr"]
    expected = ["before"] + ([] if stopping else STORE_WARNING) + ["after", stderr[-1]]
    assert err == expected
    assert pump.tail().splitlines()[-1] == stderr[-1]


def test_the_pump_keeps_the_last_30_stderr_lines():
    _, pump = pumped([], [f"line {i}" for i in range(100)], stopping=False)
    assert pump.tail().splitlines() == [f"line {i}" for i in range(70, 100)]


class Flag:
    """The two methods of the attempt's abort ``Event`` the rule uses; ``broken``: the scheduler is unreachable."""

    def __init__(self):
        self.value, self.broken, self.reads = False, False, 0

    def is_set(self):
        self.reads += 1
        if self.broken:
            raise OSError("scheduler unreachable")
        return self.value

    def set(self):
        if self.broken:
            raise OSError("scheduler unreachable")
        self.value = True


def rule(poll=1.0, orphaned=False, notice=None, alone=False):
    now = [100.0]
    flag = Flag()
    cancel = Flag()
    r = StopRule(flag, cancel, poll, lambda: orphaned, lambda: notice, clock=lambda: now[0], alone=alone)
    r.cancel_flag = cancel
    return r, flag, now


def test_the_rule_reads_the_flag_once_per_poll_interval():
    r, flag, now = rule(poll=1.0)
    assert not r.aborted() and flag.reads == 1
    now[0] += 0.5
    assert not r.aborted() and flag.reads == 1  # within the interval: no read
    flag.value = True
    assert not r.aborted()
    now[0] += 0.6
    assert r.aborted() and r.abort_seen and r.reason is None


def test_a_stop_wins_at_once_and_names_its_reason():
    r, flag, _ = rule()
    r.stop("the worker closes")
    assert r.aborted() and r.reason == "the worker closes" and flag.reads == 0
    assert r.stopping_within(0)


def test_an_orphaned_rank_stops_and_stops_the_others_even_during_a_preemption():
    r, flag, _ = rule(orphaned=True)
    assert r.aborted() and r.reason == ORPHANED and flag.value
    r, flag, _ = rule(orphaned=True, notice=Notice(time.time() + 60, "leaving"))
    assert r.aborted() and r.reason == ORPHANED


def test_an_orphaned_live_rank_stops_alone():
    """A live job's rank (not 0) whose task the controller cancelled (it went on without it): the rank stops,
    the others keep training (a worker back from a cut must not stop the group that left its rank behind)."""
    r, flag, _ = rule(orphaned=True, alone=True)
    assert r.aborted() and r.reason == ORPHANED and not flag.value


def test_a_preemption_in_progress_holds_the_abort_until_its_deadline_but_not_a_cancel():
    r, flag, now = rule(notice=Notice(time.time() + 60, "leaving"))
    flag.value = True
    assert not r.aborted() and flag.reads == 0
    now[0] += 1.1
    r.cancel_flag.value = True  # cancel() sets both flags
    assert r.aborted()
    r2, flag2, _ = rule(notice=Notice(time.time() - 2, "leaving"))
    flag2.value = True
    assert r2.aborted()


def test_an_unreachable_scheduler_counts_as_set():
    r, flag, _ = rule()
    flag.broken = True
    assert r.aborted() and r.flag() and r.stopping_within(0)
    r.set_abort()  # best effort: never raises


def test_stopping_within_waits_for_the_flag():
    flag = Flag()
    r = StopRule(flag, Flag(), 1.0, lambda: False, lambda: None)
    assert not r.stopping_within(0.15)
    threading.Timer(0.1, lambda: setattr(flag, "value", True)).start()
    assert r.stopping_within(5)


def test_a_line_without_a_newline_is_read_in_bounded_pieces():
    """A rank that printed 300 MiB without a newline grew its worker by ~560 MiB: the pump held the line."""
    huge = 20 * 1024 * 1024
    logged, _ = pumped([], ["x" * huge + "", "next"], stopping=False)
    first, second = (line for _, line in logged)
    assert len(first) < 70 * 1024 and first.endswith(f"[{huge - 64 * 1024} more bytes of this line dropped]")
    assert second == "next"


def test_lines_holds_at_most_its_limit():
    import io

    got = list(lines(io.BytesIO(b"a" * 10 + b"\n" + b"b" * 25 + b"\nc"), limit=8))
    assert got == [(b"a" * 8, 2, False), (b"b" * 8, 17, False), (b"c", 0, False)]


class _Chunks:
    """A stream that returns its chunks one read at a time, as a pipe does when the writer writes in pieces."""

    def __init__(self, chunks):
        self.chunks = list(chunks)

    def read1(self, n):
        return self.chunks.pop(0) if self.chunks else b""


def test_lines_ends_a_progress_bars_redraw_at_a_lone_carriage_return_and_keeps_crlf_one_line():
    got = list(lines(_Chunks([b"\r 0%|", b"\r50%|#", b"\r100%|##\n", b"dos\r", b"\nnext\n"])))
    assert got == [(b"", 0, True), (b" 0%|", 0, True), (b"50%|#", 0, True), (b"100%|##", 0, False),
                   (b"dos", 0, False), (b"next", 0, False)]


def test_the_pump_relays_a_progress_bar_while_it_moves_at_most_two_redraws_a_second():
    logged: list = []
    r, w = os.pipe()
    pump = OutputPump({"stderr": os.fdopen(r, "rb")}, lambda name, line: logged.append((time.monotonic(), line)),
                      lambda wait: False, rank=0).start()
    started = time.monotonic()
    with os.fdopen(w, "wb", buffering=0) as out:
        for i in range(30):  # a bar redrawn every 0.1 s for 3 s
            out.write(f"\r{i}/30".encode())
            time.sleep(0.1)
        out.write(b"\rdone\n")
    pump.join(10)
    lines_seen = [line for _, line in logged]
    assert lines_seen[-1] == "done"
    early = [line for t, line in logged if t - started < 2.0 and line]
    assert early, f"no redraw relayed before the bar ended: {lines_seen}"
    assert 3 <= len(lines_seen) <= 8, lines_seen  # 30 redraws in 3 s, relayed at most one a 0.5 s (+ the last)


# ---- the supervisor's watch over a rank that sends its result and exits at once --------------------------------

class _LatePipe:
    """A real pipe end whose first timed ``poll`` misses what is already there, as when the rank writes its
    result just after the supervisor's look and exits before the next one (seen once in 100 jobs under load)."""

    def __init__(self, conn):
        self.conn, self.missed = conn, False

    def poll(self, timeout=0.0):
        if timeout and not self.missed:
            self.missed = True
            return False
        return self.conn.poll(timeout)

    def recv(self):
        return self.conn.recv()


def test_a_result_sent_just_before_the_rank_exits_is_not_taken_for_a_death():
    import multiprocessing
    from types import SimpleNamespace

    from dask_ddp.wire.messages import Result
    from dask_ddp.worker.supervisor import Supervisor

    reader, writer = multiprocessing.Pipe(duplex=False)
    writer.send(Result(b"value"))
    writer.close()  # the rank has exited: its end of the pipe is closed
    watcher = SimpleNamespace(
        child=SimpleNamespace(conn=_LatePipe(reader), alive=lambda: False), rank=0, address="tcp://127.0.0.1:1",
        rule=SimpleNamespace(aborted=lambda: False, set_abort=lambda: None, reason=None),
        _died=lambda: "died without a result", _handle=lambda msg: None)
    outcome = Supervisor._watch(watcher)
    assert outcome != "died without a result" and outcome.value == b"value"

"""A preemption notice cannot be forged by whoever reaches a job's rendezvous store (issue 40, finding 3).

torch's ``TCPStore.list_keys()`` hands the attempt's store prefix to anyone who connects to rank 0's store; a
local user wrote notices there and forced restarts (a job with ``max_restarts=0`` failed "restart impossible").
Now every value of the preemption protocol is signed with the attempt's random key (given to the ranks inside
their Dask task, never written to the store) and checked on read: what fails is ignored, counted and shown in
``job.history``, and a genuine notice still gets through.

The end-to-end test is a real 2-rank gloo job on a LocalCluster; the forger is a separate process that has
torch but not the key (as root: a process of another uid), finds the store at rank 0's MASTER_ADDR and
MASTER_PORT, lists its keys for the prefix and writes forged notices, steps and counts.
"""

from __future__ import annotations

import json
import os
import pathlib
import pwd
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from _cluster import leftover_processes, local_client, run, wait_until

import dask_ddp
from dask_ddp.rank.notice_board import KEY, Forgeries, NoticeBoard
from dask_ddp.wire.notices import Notice, Seal, forged_note

FORGER = "ddp-forger"  # the other local user, made on demand when the tests run as root


# ---- the signature and the board, alone ----------------------------------------------------------------------
def test_a_seal_opens_only_what_its_key_signed_for_that_name():
    seal, other = Seal(b"k" * 32), Seal(b"x" * 32)
    signed = seal.sign("q/1", '{"deadline": 1}')
    assert seal.open("q/1", signed) == '{"deadline": 1}' and seal.open("q/1", signed.encode()) == '{"deadline": 1}'
    assert seal.open("q/0", signed) is None  # a genuine value copied under another rank's name
    assert other.open("q/1", signed) is None  # another key (another attempt's)
    for bad in ('{"deadline": 1}', "0" * 64 + ' {"deadline": 1}', signed[:-1], signed + " ", "", "\udcff x",
                b"\xff\xfe " + b"a" * 10, signed.replace("1}", "2}")):
        assert seal.open("q/1", bad) is None, bad
    assert seal.open("q/1", seal.sign("q/1", "a" * 70_000)) is None  # past MAX_VALUE: never hashed
    assert "k" * 16 not in repr(seal)
    with pytest.raises(ValueError, match="16 random bytes"):
        Seal(b"short")


@pytest.fixture
def store():
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10))
    yield master
    del master


def _outsider(master):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))


def _landed(client) -> None:
    """Wait until the store has done what ``client`` sent: its set and queue_push are not answered, so another
    connection's later write could land first (one round trip on the same connection comes after them)."""
    client.num_keys()


def test_a_forged_first_notice_holds_no_genuine_one_back_and_is_counted(store):
    """The first genuine notice fans out to every rank's queue; a forged one in the first-notice key, or in a
    queue, is skipped and counted, and the watcher still gets the genuine notice."""
    sent: list = []
    seal, forger = Seal(os.urandom(32)), _outsider(store)
    boards = [NoticeBoard(store, seal, r, 2, Forgeries(r, 0, sent.append)) for r in (0, 1)]
    forged = Notice(time.time() + 3600, "forged", "", "leave").to_json()
    forger.set(KEY + "notice", forged)
    forger.queue_push(KEY + "q/1", forged)
    forger.queue_push(KEY + "q/1", Seal(os.urandom(32)).sign("q/1", forged))  # signed, with another key
    forger.queue_push(KEY + "q/1", seal.sign("q/0", forged).replace("q/0", "q/1"))  # not the name it was signed for
    _landed(forger)
    genuine = Notice(time.time() + 5, "worker w leaves", "w", "leave")
    boards[0].publish(genuine)
    got: list = []
    watcher = threading.Thread(target=lambda: got.append(boards[1].next_notice()))
    watcher.start()
    watcher.join(10)
    assert got == [genuine]
    assert boards[0].forgeries.total == 1 and boards[1].forgeries.total == 3
    assert boards[0].next_notice() == genuine  # the writer's own queue has it too: its watcher returns
    boards[1].publish(Notice(time.time() + 5, "a later notice", "", "grow"))  # a genuine one is there: it wins
    assert store.queue_len(KEY + "q/1") == 0
    forger.queue_push(KEY + "q/1", "end")  # a forged end would send the watcher away for good
    _landed(forger)
    boards[1].end()
    assert boards[1].next_notice() is None and boards[1].forgeries.total == 4
    items = [it for msg in sent for it in msg.items]
    assert items[0]["kind"] == "forged" and items[0]["count"] == 1  # the first at once, the rest later
    for b in boards:
        b.forgeries.flush()
    items = [it for msg in sent for it in msg.items]
    assert sum(it["count"] for it in items if it["rank"] == 1) == 4, items
    assert "rank 1 (attempt 1) ignored a preemption notice that failed its signature check" in forged_note(items[1])


def test_forged_steps_and_counts_do_not_decide_the_agreed_step(store):
    """A forged huge step would hold the stop forever, a forged count would end the commit barrier early."""
    seal, forger = Seal(os.urandom(32)), _outsider(store)
    boards = [NoticeBoard(store, seal, r, 2, Forgeries(r, 0, lambda m: None)) for r in (0, 1)]
    forger.set(KEY + "seen/1", "0" * 64 + " 999999999")
    forger.add(KEY + "seen", 5)
    forger.add(KEY + "stopped", 5)
    boards[0].post("seen", 12)
    assert boards[0].posted("seen") is None  # rank 1's step is forged: none yet
    assert boards[0].posted("seen") is None and boards[0].forgeries.total == 1  # read again: counted once
    boards[1].post("seen", 13)
    assert boards[0].posted("seen") == ["12", "13"] == boards[1].posted("seen")
    boards[0].post("stopped", 1)
    assert boards[0].posted("stopped") is None  # the count says 6 of 2, but rank 1 has not stopped
    boards[1].post("stopped", 1)
    assert boards[0].posted("stopped") == ["1", "1"]


# ---- a real job ----------------------------------------------------------------------------------------------
def train_until_told(port_file, stop_file, pause=0.05):
    """Reports every step (one all_reduce a step, which also agrees on when to stop: once ``stop_file``
    exists) and saves its step when preempted; rank 0 writes its store's address to ``port_file``."""
    import torch
    import torch.distributed as dist

    ctx = dask_ddp.get_context()
    if ctx.rank == 0:
        pathlib.Path(port_file).write_text(json.dumps([ctx.master_addr, ctx.master_port, ctx.restart_count]))
    state = dask_ddp.load_checkpoint()
    step = state["step"] + 1 if state is not None else 0
    done = {"step": step - 1}
    dask_ddp.on_preemption(lambda: dict(done))
    while True:
        flag = torch.tensor([1.0 if os.path.exists(stop_file) else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            return {"attempt": ctx.restart_count, "step": step}
        done["step"] = step
        dask_ddp.report(step=step)
        step += 1
        time.sleep(pause)


FORGER_SCRIPT = r"""
import json, sys, time
from datetime import timedelta
import torch.distributed as dist

host, port = sys.argv[1], int(sys.argv[2])
store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
keys = store.list_keys()
prefix = next(k[:-len("dask_ddp/joined")] for k in keys if k.endswith("/dask_ddp/joined"))
pre = prefix + "dask_ddp/pre/"
notice = json.dumps({"deadline": time.time() + 3600, "cause": "forged by another user", "worker": "",
                     "kind": "leave"})
store.set(pre + "notice", notice)  # the old protocol's notice key; now the first-notice key
for r in (0, 1):
    store.queue_push(pre + f"q/{r}", notice)
    store.queue_push(pre + f"q/{r}", "0" * 64 + " " + notice)  # a made-up MAC
    store.set(pre + f"seen/{r}", "0" * 64 + " 999999999")  # a huge step: the ranks would never reach it
store.add(pre + "seen", 2)
store.add(pre + "stopped", 2)
print("forged under", prefix, "of", len(keys), "keys", flush=True)
"""


def _forger_command() -> tuple[list[str], str]:
    """How to run the forger: as another local user when the tests run as root (made if missing), else as a
    process of this user (the key, not the uid, is what it lacks); and who it runs as."""
    if os.geteuid() != 0:
        return [], "this user (not root: no other user to run as)"
    try:
        pwd.getpwnam(FORGER)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", FORGER], check=False,
                       capture_output=True)
    entry = pwd.getpwnam(FORGER)
    return ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups"], f"uid {entry.pw_uid}"


def _forge(host: str, port: int) -> str:
    prefix, who = _forger_command()
    out = subprocess.run([*prefix, sys.executable, "-c", FORGER_SCRIPT, host, str(port)], capture_output=True,
                         text=True, timeout=180, cwd="/", env={**os.environ, "HOME": "/tmp"})
    assert out.returncode == 0, out.stderr[-3000:]
    print(f"forger ({who}):", out.stdout.strip())
    return out.stdout


def _forged_lines(job, rank: int) -> list[str]:
    return [h[3] for h in job.history if h[3].startswith(f"rank {rank} (attempt 1) ignored")]


@pytest.mark.slow
def test_notices_forged_by_a_store_client_without_the_key_are_ignored_and_a_genuine_one_works(tmp_path):
    port_file, stop_file, ckpt = tmp_path / "port", tmp_path / "stop", tmp_path / "ckpt"
    with local_client(2) as c:
        job = run(c, train_until_told, str(port_file), str(stop_file), checkpoint_dir=str(ckpt), workers=(1, 2),
                  max_restarts=0)
        try:
            wait_until(lambda: port_file.exists() and len(job.metrics) >= 10, 120, what="the job running")
            host, port, _ = json.loads(port_file.read_text())
            _forge(host, port)
            top = int(job.metrics["step"].max())
            wait_until(lambda: int(job.metrics["step"].max()) > top + 20, 60, what="20 more steps after the forgery")
            assert [h[2] for h in job.history if h[1] != h[2]] == ["RUNNING"], job.history  # no restart
            assert not ckpt.exists() or not any(ckpt.iterdir()), "a forged notice made the ranks save"
            # each rank's watcher popped the forged notices from its queue, ignored and reported them
            wait_until(lambda: _forged_lines(job, 0) and _forged_lines(job, 1), 60, what="the forgeries reported")
            assert "signature check" in _forged_lines(job, 1)[0], job.history

            # a genuine preemption still works: the first-notice key and the counts hold forged values
            victim = job.plan.addresses[1]
            c.retire_workers([victim])
            wait_until(lambda: json.loads(port_file.read_text())[2] == 1, 180, what="the restart on one worker")
            wait_until(lambda: len(job.metrics[job.metrics["attempt"] == 1]) >= 5, 120, what="5 steps resumed")
            stop_file.touch()
            values = job.result(timeout=180)
        finally:
            job.cancel()
        for line in job.history:
            print("history:", line[1:])
        states = [h[2] for h in job.history if h[1] != h[2]]
        assert states == ["RUNNING", "RESTARTING", "RUNNING", "FINISHED"], job.history
        cause = next(h[3] for h in job.history if h[2] == "RESTARTING")
        assert cause.startswith("preempted:") and victim in cause and "0 steps lost" in cause, cause
        assert len(values) == 1 and values[0]["attempt"] == 1, values
        steps = sorted(job.metrics[job.metrics["rank"] == 0]["step"])
        assert steps == list(range(len(steps))), "steps were lost or repeated across the genuine preemption"
        assert leftover_processes(c) == []

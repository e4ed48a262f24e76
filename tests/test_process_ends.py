"""How a rank's processes and files end: private temp folders, the store's listening socket, signals that
never name a reused pid, and clean ends on a cancel (SIGTERM, a grace, SIGKILL).

The temp-folder tests act as another user (uid 65534, through ``user=``): they need root (these machines
give it) and are skipped elsewhere. Every folder, link, job and process a test makes is removed on its way out.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
from _cluster import leftover_processes, local_client, rank_process_pids, run, wait_until

import dask_ddp
from dask_ddp.worker import process, tmpdirs
from dask_ddp.worker import zygote as worker_zygote

NOBODY = 65534  # another local user
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acts as another user (uid 65534): needs root")


def _remove(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)


def _foreign_folder(path: str) -> None:
    """What another user does first: ``path`` as an empty folder of theirs that anyone may write to."""
    os.mkdir(path)
    os.chmod(path, 0o777)
    os.chown(path, NOBODY, NOBODY)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# ---- private temporary folders ------------------------------------------------------------------------------

@as_root
@pytest.mark.parametrize("planted", ["foreign folder", "symlink", "symlink to own folder"])
def test_a_planted_root_is_not_used(tmp_path, planted, caplog):
    """``<tmp>/ddp-w<pid>`` has a name anyone can guess: what another user put there first is never used."""
    name = "ddp-w4242"
    path, elsewhere = str(tmp_path / name), str(tmp_path / "elsewhere")
    if planted == "foreign folder":
        _foreign_folder(path)
    else:
        os.mkdir(elsewhere, 0o700)
        if planted == "symlink":
            os.chown(elsewhere, NOBODY, NOBODY)
        os.symlink(elsewhere, path)
    with caplog.at_level("WARNING", logger="dask_ddp"):
        root = tmpdirs.private_folder(str(tmp_path), name)
    st = os.lstat(root)
    said = caplog.text
    assert path in said and root in said and ("symbolic link" in said or f"uid {NOBODY}" in said), said
    assert root != path and os.path.dirname(root) == str(tmp_path) and os.path.basename(root).startswith(name + "-")
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700
    assert os.path.islink(path) or os.lstat(path).st_uid == NOBODY, "the other user's folder is left as it was"
    assert not os.listdir(path if planted == "foreign folder" else elsewhere), "nothing of ours went into it"


def test_an_own_root_with_a_loose_mode_is_made_private(tmp_path):
    """A root made by an earlier version (``os.makedirs``: 0755) is this user's: it is kept and made 0700."""
    path = tmp_path / "ddp-w4243"
    path.mkdir(mode=0o755)
    path.chmod(0o755)
    assert tmpdirs.private_folder(str(tmp_path), "ddp-w4243") == str(path)
    assert os.lstat(path).st_mode & 0o777 == 0o700
    fresh = tmpdirs.private_folder(str(tmp_path), "ddp-w4244")
    assert fresh == str(tmp_path / "ddp-w4244") and os.lstat(fresh).st_mode & 0o777 == 0o700


@as_root
def test_the_sweep_removes_only_this_users_folders_of_dead_workers():
    """The sweep runs as the worker's user (root here): it must not remove what another user made, nor follow a
    link; a private root that replaced a planted one (``ddp-w<pid>-XXXX``) is swept like the plain one."""
    base, pid = tempfile.gettempdir(), _dead_pid()
    foreign, link, target = (os.path.join(base, f"ddp-w{pid}"), os.path.join(base, f"ddp-w{pid + 100000}"),
                             tempfile.mkdtemp(prefix="ddp-test-target-"))
    mine = tempfile.mkdtemp(prefix=f"ddp-w{pid}-")
    try:
        _foreign_folder(foreign)
        os.symlink(target, link)
        with open(os.path.join(target, "keep"), "w") as f:
            f.write("x")
        tmpdirs.sweep_tmp_roots()
        assert os.path.isdir(foreign) and os.lstat(foreign).st_uid == NOBODY, "another user's folder was removed"
        assert os.path.islink(link) and os.path.exists(os.path.join(target, "keep"))
        assert not os.path.exists(mine), "this user's root of a dead worker was left"
    finally:
        for path in (foreign, link, target, mine):
            _remove(path)


def _write_a_secret_after_an_attack(secret):
    """In the rank (root): another user (uid 65534) moves the rank's TMPDIR away and puts a folder of theirs in
    its place, then the rank writes a file there, then that user reads it."""
    import os
    import subprocess
    import tempfile

    tmp = tempfile.gettempdir()
    swap = subprocess.run(["sh", "-c", f'mv "{tmp}" "{tmp}.moved" && mkdir -m 777 "{tmp}"'], user=65534,
                          group=65534, capture_output=True, text=True)
    path = os.path.join(tmp, "secret.txt")
    with open(path, "w") as f:
        f.write(secret)
    read = subprocess.run(["cat", path], user=65534, group=65534, capture_output=True, text=True)
    root = os.path.dirname(tmp)
    st = os.lstat(root)
    return {"tmp": tmp, "root": root, "swapped": swap.returncode == 0, "read": read.stdout,
            "root_uid": st.st_uid, "root_mode": st.st_mode & 0o7777, "root_is_dir": stat.S_ISDIR(st.st_mode)}


@as_root
@pytest.mark.slow
@pytest.mark.parametrize("planted", ["foreign folder", "symlink"])
def test_another_user_who_made_the_root_first_cannot_read_a_ranks_files(planted):
    """Seen: ``/tmp/ddp-w<pid>`` made first by another user was used as it was, and that user read a rank's
    file. Now dask-ddp uses another private folder (and says so); the other user can neither swap the rank's
    TMPDIR nor read what the rank writes."""
    base = tempfile.gettempdir()
    target = tempfile.mkdtemp(prefix="ddp-test-evil-")
    made: list[str] = [target]
    with local_client(1) as c:
        [pid] = c.run(os.getpid).values()
        planted_at = os.path.join(base, f"ddp-w{pid}")
        try:
            assert not os.path.lexists(planted_at), f"{planted_at} exists already"
            made.append(planted_at)
            if planted == "foreign folder":
                _foreign_folder(planted_at)
            else:
                os.chmod(target, 0o777)
                os.chown(target, NOBODY, NOBODY)
                os.symlink(target, planted_at)
            job = run(c, _write_a_secret_after_an_attack, "the rank's secret", workers=1)
            try:
                [got] = job.result(timeout=120)
            finally:
                job.cancel()
            made += [got["tmp"] + ".moved", got["root"]]
            print(got)
            assert not got["swapped"], f"uid {NOBODY} moved the rank's TMPDIR {got['tmp']} away"
            assert got["read"] == "", f"uid {NOBODY} read the rank's file in {got['tmp']}"
            assert got["root"] != planted_at and os.path.realpath(got["root"]) == got["root"]
            assert (got["root_uid"], got["root_mode"], got["root_is_dir"]) == (os.getuid(), 0o700, True)
            inside = planted_at if planted == "foreign folder" else target
            assert not os.listdir(inside), "nothing of the rank went into the other user's folder"
        finally:
            for path in made:
                with contextlib.suppress(OSError):
                    _remove(path)
    for name in os.listdir(base):  # the worker's own roots, whatever the test's outcome
        if name == f"ddp-w{pid}" or name.startswith(f"ddp-w{pid}-"):
            _remove(os.path.join(base, name))


# ---- the store's listening socket stays in rank 0 -----------------------------------------------------------

def _children_of_rank_0_and_the_store():
    """On rank 0 (the store's host): which of the processes it starts hold a listening socket on the store's
    port: a subprocess (as Popen starts it, and with close_fds=False, as os.system does) and a forked
    DataLoader worker."""
    from torch.utils.data import DataLoader

    ctx = dask_ddp.get_context()
    if ctx.rank != 0:
        return None
    kids = {"Popen": subprocess.Popen(["sleep", "30"]),
            "Popen(close_fds=False)": subprocess.Popen(["sleep", "30"], close_fds=False)}
    pids = {name: p.pid for name, p in kids.items()}
    loader = iter(DataLoader(_Pid(), num_workers=1, batch_size=None))
    pids["DataLoader worker"] = int(next(loader))
    try:
        held = {name: sorted({c.laddr.port for c in psutil.Process(pid).net_connections("tcp")
                              if c.status == psutil.CONN_LISTEN}) for name, pid in pids.items()}
        own = sorted({c.laddr.port for c in psutil.Process().net_connections("tcp")
                      if c.status == psutil.CONN_LISTEN})
    finally:
        for p in kids.values():
            p.kill()
            p.wait()
        del loader
    return {"port": ctx.master_port, "rank 0": own, **held}


class _Pid:
    def __len__(self):
        return 1

    def __getitem__(self, i):
        return os.getpid()


@pytest.mark.slow
def test_the_stores_listening_socket_stays_in_rank_0(client):
    """What rank 0 starts must not hold the store's listening socket: a helper that outlives rank 0 would keep
    the port open, and ranks would connect to a store that never answers."""
    got = run(client, _children_of_rank_0_and_the_store).result(timeout=120)[0]
    print(got)
    port = got.pop("port")
    assert port in got.pop("rank 0")
    assert {name: port in ports for name, ports in got.items()} == dict.fromkeys(got, False), got


# ---- signals never name a pid that may have been reused -----------------------------------------------------

def _record_signals(monkeypatch) -> list:
    sent = []
    for name in ("kill", "killpg"):
        monkeypatch.setattr(os, name, lambda pid, sig, name=name: sent.append((name, pid, sig)))
    return sent


def test_a_reaped_rank_process_is_never_signalled_by_its_pid(monkeypatch):
    """Once a rank process has been reaped its pid may belong to another process (or group) at once: ending it
    must not signal that pid. A spawned rank, killed and reaped before the supervisor ends it."""
    rank = process.RankProcess()
    rank.proc.kill()
    rank.proc.wait()
    sent = _record_signals(monkeypatch)
    rank.kill()
    assert [s for s in sent if s[1] in (rank.pid, -rank.pid)] == []


@pytest.mark.slow
def test_a_rank_forked_ahead_serves_the_next_job_and_is_dropped_with_its_zygote():
    """A job's end forks the next job's rank ahead (Launcher.refill(ahead=True)): the next take() hands it out
    without a fork; once its zygote has died it is killed and a rank of a new zygote is handed out instead (the
    orphan would end itself within half a second, under the job)."""
    from dask_ddp.worker.plugin import Launcher

    launcher = Launcher()
    try:
        launcher.refill(force=True)
        assert launcher.wait_ready(120), "the zygote did not import torch"
        launcher.refill(force=True, ahead=True)
        zygote_pid, ahead = wait_until(lambda: (lambda p: p if len(p) == 2 else None)(launcher.pids()), 30,
                                       what="the rank forked ahead")
        rank = launcher.take()
        assert rank.pid == ahead and launcher.pids() == [zygote_pid], "the next job must take the rank forked ahead"
        rank.kill()
        launcher.refill(force=True, ahead=True)
        _, orphan = wait_until(lambda: (lambda p: p if len(p) == 2 else None)(launcher.pids()), 30,
                               what="a second rank forked ahead")
        os.kill(zygote_pid, signal.SIGKILL)
        wait_until(lambda: zygote_pid not in launcher.pids(), 30, what="the zygote's death seen")
        rank = launcher.take(timeout=120)
        try:
            assert rank.pid != orphan and rank.zygote.pid != zygote_pid, "a job must not start in an orphan"
            wait_until(lambda: not psutil.pid_exists(orphan) or psutil.Process(orphan).status() ==
                       psutil.STATUS_ZOMBIE, 30, what="the orphan's end")
        finally:
            rank.kill()
    finally:
        launcher.close()


def test_a_forked_rank_reaped_by_its_zygote_is_never_signalled_by_its_pid(monkeypatch):
    """The zygote reaps the ranks it forks; once it has, the worker must not signal the rank's pid."""
    zygote = worker_zygote.Zygote()
    try:
        assert zygote.wait_ready(120), "the zygote did not start"
        rank = zygote.fork()
        os.kill(rank.pid, signal.SIGKILL)  # an unreaped child of the zygote: its pid is still its own
        assert rank.wait(10) == -signal.SIGKILL
        sent = _record_signals(monkeypatch)
        rank.kill()
        monkeypatch.undo()
        assert [s for s in sent if s[1] in (rank.pid, -rank.pid)] == []
    finally:
        monkeypatch.undo()
        zygote.close()


# ---- clean process ends -------------------------------------------------------------------------------------

SHM = "/dev/shm"


def _rank_group(client) -> list[psutil.Process]:
    """Every process of the running ranks: each rank and what it started (DataLoader workers, the resource
    tracker, helpers)."""
    procs = []
    for got in rank_process_pids(client).values():
        for pid in got["running"]:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank = psutil.Process(pid)
                procs += [rank] + rank.children(recursive=True)
    return procs


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def _cancel_and_time(job, procs: list[psutil.Process], bound: float) -> float:
    """Cancel ``job``; the seconds until every process in ``procs`` has ended (fails past ``bound``)."""
    t0 = time.monotonic()
    job.cancel()
    wait_until(lambda: not _running(procs), bound, interval=0.02, what="every rank process ended")
    return time.monotonic() - t0


class _Forever:
    """An endless map-style dataset of small tensors (its items cross from DataLoader workers to the rank)."""

    def __len__(self):
        return 10**9

    def __getitem__(self, i):
        import torch

        return torch.full((64,), float(i))


def _hold_shared_memory(folder):
    """Two shared memory segments and two named semaphores (as a spawn-context DataLoader's queues use), both
    tracked by the rank's resource tracker; then a DataLoader with 2 workers, until cancelled."""
    import multiprocessing as mp
    from multiprocessing import shared_memory

    from torch.utils.data import DataLoader

    from dask_ddp.checkpoint.folder import atomic_write

    rank = dask_ddp.get_context().rank
    segments = [shared_memory.SharedMemory(create=True, size=4096) for _ in range(2)]
    semaphores = [mp.get_context("spawn").Semaphore() for _ in range(2)]
    names = [s.name for s in segments] + ["sem." + s._semlock.name.lstrip("/") for s in semaphores]
    atomic_write(os.path.join(folder, f"rank{rank}.json"), json.dumps(names).encode())  # whole: the test globs
    for step, _ in enumerate(DataLoader(_Forever(), num_workers=2, batch_size=None)):
        dask_ddp.report(step=step)
        time.sleep(0.02)


@pytest.mark.slow
def test_a_cancelled_rank_leaves_no_shared_memory(client, tmp_path):
    """Seen: 2 segments and 2 semaphores left in /dev/shm after a cancel (the whole group was SIGKILLed, the
    resource tracker too). Now the group gets SIGTERM first: the tracker (which ignores it) outlives the rank
    and its DataLoader workers and removes what they held."""
    job = run(client, _hold_shared_memory, str(tmp_path))
    names: list[str] = []
    try:
        wait_until(lambda: len(list(tmp_path.glob("rank*.json"))) == 2 and not job.metrics.empty
                   and job.metrics["rank"].nunique() == 2, 120, what="both ranks in their DataLoader loop")
        names = [n for f in sorted(tmp_path.glob("rank*.json")) for n in json.loads(f.read_text())]
        assert len(names) == 8 and all(os.path.exists(os.path.join(SHM, n)) for n in names), names
        procs = _rank_group(client)
        assert len(procs) >= 2 * 4, [p.cmdline() for p in procs]  # rank, 2 loader workers, tracker: per rank
        took = _cancel_and_time(job, procs, process.STOP_GRACE + 5)
        print(f"cancel() to every rank process ended: {took:.2f} s ({len(procs)} processes)")
        assert job.state == "CANCELLED"
        left = [n for n in names if os.path.exists(os.path.join(SHM, n))]
        assert not left, f"left in {SHM} after the cancel: {left}"
        assert leftover_processes(client) == []
    finally:
        job.cancel()
        for n in names:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM, n))


def _deaf_to_sigterm(helper_code):
    """A rank (and a helper it started) that ignore SIGTERM: only SIGKILL ends them."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", helper_code])
    step = 0
    while True:
        dask_ddp.report(step=step)
        step += 1
        time.sleep(0.05)


DEAF_HELPER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"


@pytest.mark.slow
def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace(client):
    job = run(client, _deaf_to_sigterm, DEAF_HELPER)
    try:
        wait_until(lambda: len(_rank_group(client)) >= 4, 120, what="both ranks and their helpers running")
        procs = _rank_group(client)
        took = _cancel_and_time(job, procs, process.STOP_GRACE + 5)
        print(f"cancel() to every process of ranks deaf to SIGTERM ended: {took:.2f} s")
        assert job.state == "CANCELLED" and leftover_processes(client) == []
    finally:
        job.cancel()


def _saves_when_preempted():
    import torch

    state = {"w": torch.zeros(4)}
    dask_ddp.on_preemption(lambda: state)  # this rank takes part in preemption: SIGTERM would be a notice
    step = 0
    while True:
        dask_ddp.report(step=step)
        step += 1
        time.sleep(0.05)


@pytest.mark.slow
def test_a_cancel_is_no_preemption(client, tmp_path):
    """The supervisor stops a rank on purpose: its SIGTERM must not start the preemption protocol (a save at an
    agreed step, a restart): the rank ends at once and nothing is saved."""
    job = run(client, _saves_when_preempted, checkpoint_dir=str(tmp_path), max_restarts=2)
    try:
        wait_until(lambda: not job.metrics.empty and job.metrics["rank"].nunique() == 2, 120,
                   what="both ranks reporting")
        procs = _rank_group(client)
        took = _cancel_and_time(job, procs, process.STOP_GRACE + 5)
        print(f"cancel() of ranks that can save to every rank process ended: {took:.2f} s")
        assert job.state == "CANCELLED"
        assert not list(tmp_path.rglob("*")), f"a cancel saved: {list(tmp_path.rglob('*'))}"
        said = " ".join(cause for *_, cause in job.history) + " ".join(job.logs)
        assert "SIGTERM" not in said and "preempt" not in said.lower(), said[-2000:]
        assert leftover_processes(client) == []
    finally:
        job.cancel()


def _waits_in_cpp():
    """A rank that can save (its SIGTERM handler is dask-ddp's), its main thread in C++ for good: a Python
    signal handler cannot run there."""
    from datetime import timedelta

    import torch.distributed as dist

    ctx = dask_ddp.get_context()
    dask_ddp.on_preemption(lambda: {})
    dask_ddp.report(step=0)
    store = dist.TCPStore(ctx.master_addr, ctx.master_port, is_master=False, timeout=timedelta(seconds=600))
    store.wait(["never set"])


@pytest.mark.slow
def test_a_rank_waiting_in_cpp_ends_at_once_on_a_cancel(client):
    """The usual reason to cancel: a rank waits in a collective (or store) forever. It ends at once, not after
    the grace: a stop gives SIGTERM its default action, which needs no Python."""
    job = run(client, _waits_in_cpp)
    try:
        wait_until(lambda: not job.metrics.empty and job.metrics["rank"].nunique() == 2, 120,
                   what="both ranks waiting")
        time.sleep(0.5)
        procs = _rank_group(client)
        took = _cancel_and_time(job, procs, process.STOP_GRACE + 5)
        print(f"cancel() of ranks waiting in C++ to every rank process ended: {took:.2f} s")
        assert took < process.STOP_GRACE, "the ranks were SIGKILLed after the grace: SIGTERM did not end them"
        assert job.state == "CANCELLED" and leftover_processes(client) == []
    finally:
        job.cancel()


def _slow_group_teardown():
    """A 2-rank job whose process group would take a minute to destroy (as an nccl communicator's teardown
    takes 0.5 s on a GPU, and a comm hook once deadlocked gloo's): a rank's end must not wait for it."""
    import torch
    import torch.distributed as dist

    dist.destroy_process_group = lambda *a, **k: time.sleep(60)
    t = torch.ones(2)
    dist.all_reduce(t)  # the group's connections exist
    return float(t[0]), time.time()


def test_a_finished_rank_exits_without_destroying_its_process_group(client):
    """The path from a trial's end to the next trial's start: once a rank's outcome is sent its process exits;
    the group's teardown is the exit's (before, the rank destroyed it first and its supervisor waited up to
    10 s for the exit)."""
    job = run(client, _slow_group_teardown)
    try:
        results = job.result(timeout=120)
        took = time.time() - max(end for _, end in results)
        print(f"the function's end -> the job's result, a group that takes a minute to destroy: {took:.2f} s")
        assert [value for value, _ in results] == [2.0, 2.0]
        assert took < 8, f"the job waited {took:.1f} s for its ranks to exit: the group was destroyed first"
        assert leftover_processes(client) == []
    finally:
        job.cancel()


SIGTERM_SCRIPT = """
import os, signal, sys, time
from datetime import timedelta
import torch.distributed as dist
from dask_ddp.rank import preemption
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10))
preemption.on_preemption(lambda: {})  # this rank can save: a SIGTERM from outside is a preemption notice
preemption.start(store, "127.0.0.1", store.port, 0, 1, lambda message: None, 5.0, "w",
                 ending=lambda: sys.argv[1] == "ending")
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(1)
print("notice:", store.get(preemption.KEY + "notice").decode(), flush=True)
"""


@pytest.mark.parametrize("ending", [True, False])
def test_a_rank_that_is_ending_takes_sigterm_as_the_end_not_as_a_notice(ending):
    """The SIGTERM handler's contract: a rank being ended on purpose dies of it at once; otherwise (the pod
    is being stopped) it is a preemption notice."""
    out = subprocess.run([sys.executable, "-c", SIGTERM_SCRIPT, "ending" if ending else "notice"],
                         capture_output=True, text=True, timeout=120)
    if ending:
        assert out.returncode == -signal.SIGTERM and "notice:" not in out.stdout, out.stdout + out.stderr[-2000:]
    else:
        assert out.returncode == 0 and "received SIGTERM" in out.stdout, out.stdout + out.stderr[-2000:]


def test_a_rank_knows_its_supervisor_hung_up_even_with_a_message_unread():
    """The hang-up is what tells the rank's SIGTERM handler that a stop is on purpose: it must be seen at once
    and whatever thread reads the socket (the supervisor hangs up before it signals)."""
    import socket
    from multiprocessing.connection import Connection

    from dask_ddp.rank.main import _Channel

    ours, theirs = socket.socketpair()
    chan, sup = _Channel(Connection(theirs.detach())), Connection(ours.detach())
    try:
        assert not chan.ending()
        sup.send("a message the rank has not read yet")
        assert not chan.ending()
        with socket.socket(fileno=os.dup(sup.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
        assert chan.ending()
        chan.send("dropped: nobody reads any more")  # no BrokenPipeError into the job's code
    finally:
        chan.conn.close()
        sup.close()

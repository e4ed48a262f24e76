"""The zygote host (``ddp.zygote-host``): one warm interpreter per host forks each worker's zygote.

Real worker processes (LocalCluster / SpecCluster with Nannies), real zygote hosts and zygotes, real ranks
(gloo). Each test gives its workers an environment variable of its own, so that its workers get a host of their
own (the host's name covers the environment) and the tests never share one with the rest of the suite.
"""

from __future__ import annotations

import os
import signal
import socket
import uuid

import dask
import psutil
import pytest
from _cluster import leftover_processes, rank_process_pids, run, wait_until
from dask.distributed import Client, LocalCluster, Nanny, Scheduler, SpecCluster

import dask_ddp
from dask_ddp.worker import zygote as worker_zygote
from dask_ddp.worker import zygote_host

HOST = "dask_ddp.rank.zygote_host"


def _spec(env: dict[str, str]) -> dict:
    return {"cls": Nanny, "options": {"nthreads": 1, "env": env, "host": "127.0.0.1", "dashboard": False}}


def _cluster(*envs: dict[str, str]) -> SpecCluster:
    """Workers with these environments (``scale`` adds more like the first)."""
    return SpecCluster(workers={f"w{i}": _spec(env) for i, env in enumerate(envs)}, worker=_spec(envs[0]),
                       scheduler={"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": ":0"}})


def _what_ranks_see():
    import psutil as ps

    zygote = ps.Process(os.getppid())
    return {"rank": dask_ddp.get_context().rank, "zygote": zygote.pid, "host": zygote.ppid(),
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "mark": os.environ.get("ZYGOTE_HOST_TEST"),
            "cwd": os.getcwd()}


def _host_of(pid: int) -> psutil.Process:
    host = psutil.Process(pid)
    assert HOST in " ".join(host.cmdline()), f"the zygote's parent is not a zygote host: {host.cmdline()}"
    return host


def test_workers_that_differ_only_in_their_gpu_share_one_host_and_each_zygote_takes_its_worker_env():
    """As dask-cuda's workers (each its own CUDA_VISIBLE_DEVICES): one host forks both zygotes, neither a child
    of a worker, and each rank sees its own worker's variables."""
    mark = uuid.uuid4().hex
    with _cluster({"ZYGOTE_HOST_TEST": mark, "CUDA_VISIBLE_DEVICES": "0"},
                  {"ZYGOTE_HOST_TEST": mark, "CUDA_VISIBLE_DEVICES": "1"}) as cluster, Client(cluster) as client:
        got = sorted(run(client, _what_ranks_see).result(timeout=180), key=lambda r: r["rank"])
        assert [g["mark"] for g in got] == [mark, mark]
        assert sorted(g["cuda"] for g in got) == ["0", "1"], got
        assert got[0]["zygote"] != got[1]["zygote"] and got[0]["host"] == got[1]["host"], got
        host = _host_of(got[0]["host"])
        workers = set(client.run(os.getpid).values())
        assert host.pid not in workers and not workers & {p.pid for p in host.parents()}, \
            "the host must not be a worker's child (it detaches)"
        assert {g["zygote"] for g in got} == {pids["zygote"] for pids in rank_process_pids(client).values()}
        assert got[0]["cwd"] == os.getcwd()
        assert leftover_processes(client) == []


def test_workers_whose_environment_differs_get_hosts_of_their_own():
    """A variable that ``import torch`` could read (anything but the per-worker ones) names another host."""
    a, b = uuid.uuid4().hex, uuid.uuid4().hex
    with _cluster({"ZYGOTE_HOST_TEST": a}, {"ZYGOTE_HOST_TEST": b}) as cluster, Client(cluster) as client:
        got = run(client, _what_ranks_see).result(timeout=180)
        assert {g["mark"] for g in got} == {a, b}
        assert got[0]["host"] != got[1]["host"], got
        for g in got:
            _host_of(g["host"])


def test_a_host_killed_leaves_its_zygotes_working_and_the_next_zygote_gets_a_new_host():
    """SIGKILL of the host: the zygotes it forked go on forking ranks; a zygote asked for later starts a new
    host (the dead one's socket is replaced), and it exits once idle (``ddp.zygote-host-idle``)."""
    env = {"ZYGOTE_HOST_TEST": uuid.uuid4().hex, "DASK_DDP__ZYGOTE_HOST_IDLE": "2"}
    with _cluster(env, env) as cluster, Client(cluster) as client:
        first = run(client, _what_ranks_see).result(timeout=180)
        old = first[0]["host"]
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE, 30,
                   what="the host's end")
        again = run(client, _what_ranks_see).result(timeout=180)
        assert {g["zygote"] for g in again} == {g["zygote"] for g in first}, "the zygotes must live on"
        stale = zygote_host.socket_dir() / f"zygote-stale-{uuid.uuid4().hex[:8]}.sock"
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as dead:  # as a host SIGKILLed in a netns leaves
            dead.bind(str(stale))
        cluster.scale(3)
        client.wait_for_workers(3, timeout=120)
        third = run(client, _what_ranks_see, workers=3).result(timeout=180)
        new = [g for g in third if g["zygote"] not in {f["zygote"] for f in first}]
        assert len(new) == 1, third
        host = _host_of(new[0]["host"])
        assert host.pid != old
        path = next(c.laddr for c in _unix_listeners(host.pid) if c.laddr)
        assert os.path.exists(path)
        assert not stale.exists(), "a new host's start removes the sockets nothing answers on"
    wait_until(lambda: not host.is_running() or host.status() == psutil.STATUS_ZOMBIE, 60,
               what="the idle host's exit")
    assert not os.path.exists(path), "an idle host removes its socket"


def test_sigterm_ends_the_host_which_removes_its_socket_and_its_zygotes_live_on(monkeypatch):
    """``scancel`` or a pod's end signal every process: the host leaves its name free; its zygotes serve on."""
    monkeypatch.setenv("ZYGOTE_HOST_TEST", uuid.uuid4().hex)  # a host of this test's own
    monkeypatch.setattr(worker_zygote, "_HOST_FAILED", False)
    zygote = worker_zygote.Zygote()
    try:
        assert zygote.wait_ready(120)
        host = psutil.Process(psutil.Process(zygote.pid).ppid())
        path = next(c.laddr for c in _unix_listeners(host.pid) if c.laddr)
        host.send_signal(signal.SIGTERM)
        wait_until(lambda: not host.is_running() or host.status() == psutil.STATUS_ZOMBIE, 30, what="its end")
        assert not os.path.exists(path)
        rank = zygote.fork()
        try:
            assert rank.alive()
        finally:
            rank.kill()
    finally:
        zygote.close()


def test_with_the_host_off_each_zygote_is_its_workers_child():
    """``ddp.zygote-host: false``: the zygote is started by its worker, as before the host existed."""
    with dask.config.set({"ddp.zygote-host": False}), \
            LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        got = run(client, _what_ranks_see).result(timeout=180)
        workers = set(client.run(os.getpid).values())
        assert {g["host"] for g in got} == workers, "each zygote's parent must be its worker"


def test_the_socket_directory_must_be_the_users_alone(tmp_path, monkeypatch):
    """A directory others may enter (or another user's) is refused: the worker starts its zygote itself."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    theirs = tmp_path / f"dask-ddp-{os.getuid()}"
    theirs.mkdir(mode=0o777)
    theirs.chmod(0o777)
    with pytest.raises(OSError, match="not a directory of this user's alone"):
        zygote_host.socket_dir()
    monkeypatch.setattr(worker_zygote, "_HOST_FAILED", False)
    zygote = worker_zygote.Zygote()
    try:
        assert not zygote.wait_ready(60) and "zygote host" in zygote._error
        assert worker_zygote._HOST_FAILED, "the next zygote must be the worker's own"
        own = worker_zygote.Zygote()
        try:
            assert own.wait_ready(120) and own.proc is not None and psutil.Process(own.pid).ppid() == os.getpid()
        finally:
            own.close()
    finally:
        zygote.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to connect as another user")
def test_another_user_is_never_served(tmp_path, monkeypatch):
    """The host answers its own user only (SO_PEERCRED), even where its directory is opened up."""
    monkeypatch.setattr(worker_zygote, "_HOST_FAILED", False)
    with dask.config.set({"ddp.spawn-timeout": 120}):
        zygote = worker_zygote.Zygote()
    try:
        assert zygote.wait_ready(120)
        host = psutil.Process(zygote.pid).ppid()
        path = next(c.laddr for c in _unix_listeners(host) if c.laddr)
        directory = os.path.dirname(path)
        os.chmod(directory, 0o711)
        os.chmod(path, 0o777)
        try:
            child = os.fork()
            if child == 0:  # as nobody: ask for a zygote on our own socket; exit 0 if the host hangs up
                code = 3
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    sock.connect(path)
                    code = 2
                    ours, theirs = socket.socketpair()
                    socket.send_fds(sock, [b'{"env": {}, "cwd": "/", "umask": 18}'], [theirs.fileno(), 1, 2])
                    sock.settimeout(30)
                    code = 0 if sock.recv(64) == b"" else 1
                except (ConnectionResetError, BrokenPipeError):  # hung up before or after our request
                    code = 0 if code == 2 else code
                finally:
                    os._exit(code)
            _, status = os.waitpid(child, 0)
            code = os.waitstatus_to_exitcode(status)
            assert code != 3, "nobody could not connect: the test opened the wrong doors"
            assert code == 0, "the host must hang up on another user"
        finally:
            os.chmod(directory, 0o700)
            os.chmod(path, 0o755)
    finally:
        zygote.close()


def _unix_listeners(pid: int):
    return [c for c in psutil.Process(pid).net_connections(kind="unix")]


@pytest.mark.parametrize("host", [True, False], ids=["host", "no-host"])
def test_the_early_preload_starts_the_zygote_with_the_worker_and_the_first_job_takes_it(host):
    """``--preload dask_ddp.worker.early`` (``dask-ddp run``'s local clusters): each worker's zygote is running
    before any job, and the first job's ranks are forked from it, not from a zygote started by the job."""
    env = {"ZYGOTE_HOST_TEST": uuid.uuid4().hex}
    with dask.config.set({"ddp.zygote-host": host}), \
            LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0", host="127.0.0.1",
                         preload=["dask_ddp.worker.early"], env=env) as cluster, Client(cluster) as client:
        workers = client.run(os.getpid)

        def zygotes() -> set[int]:
            found = set()
            for pid in workers.values():
                for child in psutil.Process(pid).children(recursive=False):
                    found.add(child.pid)
            for proc in psutil.process_iter(["cmdline", "environ"]):
                try:
                    if HOST in " ".join(proc.info["cmdline"] or ()) and (proc.info["environ"] or {}).get(
                            "ZYGOTE_HOST_TEST") == env["ZYGOTE_HOST_TEST"]:
                        found.update(c.pid for c in proc.children())
                except psutil.Error:
                    pass
            return found

        wait_until(lambda: len(zygotes()) >= 2, timeout=60, what="a zygote per worker before any job")
        before = zygotes()
        got = run(client, _what_ranks_see).result(timeout=180)
        assert {g["zygote"] for g in got} <= before, (got, before)
        assert len({g["zygote"] for g in got}) == 2

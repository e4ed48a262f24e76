"""The ``dask-ddp`` command, run as users run it: a subprocess of the installed entry point.

Every run carries a marker in its environment; afterwards no process with that
marker may be left (workers, rank processes, spares, DataLoader workers).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest
from _cluster import leftover_processes
from dask.distributed import Client, LocalCluster

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN_SCRIPT = ROOT / "examples" / "torchrun_script.py"
ENTRY = Path(sys.executable).parent / "dask-ddp"
COMMAND = [str(ENTRY)] if ENTRY.exists() else [sys.executable, "-m", "dask_ddp.cli"]
MARK = "DASK_DDP_TEST_MARK"


def marked_processes(token: str) -> list:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARK) == token and proc.status() != psutil.STATUS_ZOMBIE:
                found.append((proc.pid, " ".join(proc.cmdline())))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_none_marked(token: str, wait: float = 15.0) -> list:
    deadline = time.monotonic() + wait
    while (left := marked_processes(token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def cli_env(token: str) -> dict:
    """The command's environment: the marker, unbuffered output, and this checkout first on PYTHONPATH.

    The entry point runs this checkout's code even when another checkout is the
    installed one (a git worktree beside an editable install), and so do the
    workers of the local cluster it starts, which import ``dask_ddp.cli``.
    """
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, **{MARK: token, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path})


def run_cli(*args, timeout: float = 180, cwd=None) -> subprocess.CompletedProcess:
    """Run ``dask-ddp ARGS``; check that it left no process behind; return the completed process."""
    token = uuid.uuid4().hex
    env = cli_env(token)
    started = time.monotonic()
    out = subprocess.run([*COMMAND, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env,
                         cwd=cwd or ROOT)
    out.seconds = time.monotonic() - started
    assert wait_none_marked(token) == [], f"processes left behind by dask-ddp {args}"
    return out


def write(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory):
    """A scheduler and 3 `dask worker` processes started as a site starts them, each in its own working directory
    (not this checkout, not the script's folder); yields the address, a client and the workers' folder.

    One cluster for every test of this file that runs against a scheduler (``cluster`` below): each leaves it as
    it found it (its job ended, no rank process left: ``leftover_processes``), and starting it costs 3 worker
    processes and their nannies, once."""
    cwd = tmp_path_factory.mktemp("worker-cwd")
    token = uuid.uuid4().hex
    with LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address="127.0.0.1:0") as c, Client(c) as client:
        procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", c.scheduler_address,
                                   "--name", f"w{i}", "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"],
                                  cwd=cwd, env=cli_env(token), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True) for i in range(3)]
        try:
            client.wait_for_workers(3, timeout=120)
            yield c.scheduler_address, client, cwd
        finally:
            for proc in procs:
                proc.terminate()  # SIGTERM: the worker leaves gracefully, as a pod stopped
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    assert wait_none_marked(token) == [], "processes left behind by the dask worker processes"


@pytest.fixture
def cluster(elsewhere):
    """A cluster of 3 workers on 127.0.0.1, as if started by someone else; the CLI gets its address."""
    address, client, _ = elsewhere
    yield address, client


# ---- help and usage ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_help_explains_itself():
    top = run_cli("--help", timeout=60)
    assert top.returncode == 0
    for text in ("dask-ddp run", "dask-ddp demo", "examples:", "exit codes"):
        assert text in top.stdout
    run = run_cli("run", "--help", timeout=60)
    assert run.returncode == 0
    for text in ("torchrun", "RANK", "MASTER_PORT", "--scheduler", "--workers", "examples:", "cuda:LOCAL_RANK",
                 "--ship-limit", "the rank's working directory"):
        assert text in run.stdout
    demo = run_cli("demo", "--help", timeout=60)
    assert demo.returncode == 0 and "--epochs" in demo.stdout and "examples:" in demo.stdout


@pytest.mark.parametrize("args, message", [
    ((), "required"),
    (("run",), "required"),
    (("run", "--workers", "0", "x.py"), "at least 1"),
    (("run", "--workers", "two", "x.py"), "whole number"),
    (("run", "no/such/script.py"), "no such script"),
    (("run", "--max-restarts", "-1", str(TORCHRUN_SCRIPT)), "argument --max-restarts: expected at least 0"),
    (("demo", "--epochs", "0"), "--epochs must be >= 1"),
    (("demo", "--data", "/local/path"), "s3:// URL"),
    (("frobnicate",), "invalid choice"),
])
def test_usage_errors_exit_2(args, message):
    out = run_cli(*args, timeout=60)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_a_script_that_does_not_compile_is_a_usage_error(tmp_path):
    bad = write(tmp_path, "bad.py", "def f(:\n    pass\n")
    out = run_cli("run", bad, timeout=60)
    assert out.returncode == 2
    assert "SyntaxError" in out.stderr and "bad.py" in out.stderr


def test_unreachable_scheduler_exits_1():
    with socket.socket() as holder:  # a port that is ours and refuses connections (bound, not listening)
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        out = run_cli("run", "--scheduler", f"tcp://127.0.0.1:{port}", "--connect-timeout", "2", TORCHRUN_SCRIPT,
                      timeout=60)
    assert out.returncode == 1
    assert f"cannot reach the Dask scheduler at tcp://127.0.0.1:{port}" in out.stderr


# ---- on a local cluster that the command starts --------------------------------------------------------------

@pytest.mark.slow
def test_run_torchrun_script_on_a_local_cluster():
    out = run_cli("run", "--workers", "2", TORCHRUN_SCRIPT, "--steps", "20")
    assert out.returncode == 0, out.stderr
    assert "[rank 0] step 0: loss" in out.stdout
    assert "[rank 0] done: world size 2" in out.stdout and "ranks agree: True" in out.stdout
    assert "[rank 1]" not in out.stdout  # the script prints on rank 0 only
    assert "starting a local LocalCluster with 2 workers" in out.stderr
    assert "Traceback" not in out.stderr  # the scheduler's polling noise is filtered


@pytest.mark.slow
def test_ctrl_c_cancels_the_job_and_exits_130(tmp_path):
    script = write(tmp_path, "forever.py", """
        import time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        print("started", flush=True)
        time.sleep(600)
    """)
    token = uuid.uuid4().hex
    proc = subprocess.Popen([*COMMAND, "run", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=ROOT, env=cli_env(token))
    try:
        started = 0
        for line in proc.stdout:  # both ranks are inside the script
            started += "started" in line
            if started == 2:
                break
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
        t = time.monotonic()
        _, err = proc.communicate(timeout=90)
        stopped_in = time.monotonic() - t
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted; cancelling job" in err
    assert stopped_in < 45
    assert wait_none_marked(token) == []


# ---- against a running scheduler -----------------------------------------------------------------------------

ENV_SCRIPT = """
    import os, sys
    import torch.distributed as dist
    dist.init_process_group("gloo")
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"]
    print("env", " ".join(f"{k}={os.environ[k]}" for k in keys), flush=True)
    print("argv", sys.argv[1:], "name", __name__, "file", os.path.basename(__file__), flush=True)
    print("dir", os.path.dirname(os.path.abspath(__file__)), flush=True)
    print("group", dist.get_rank(), dist.get_world_size(), dist.get_backend(), flush=True)
    dist.barrier()  # as any training has collectives: a rank leaving at once races another's connectFullMesh
    dist.destroy_process_group()
"""


@pytest.mark.slow
def test_run_against_a_scheduler_with_args_for_the_script(cluster, tmp_path):
    address, client = cluster
    script = write(tmp_path, "show_env.py", ENV_SCRIPT)
    out = run_cli("run", "--scheduler", address, "--workers", "2", script, "--lr", "0.1", "--help", "--", "x")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for rank in (0, 1):
        env = next(line for line in lines if line.startswith(f"[rank {rank}] env"))
        assert f"RANK={rank}" in env and "WORLD_SIZE=2" in env and "MASTER_ADDR=127.0.0.1" in env
        assert "TORCHELASTIC_RESTART_COUNT=0" in env
        assert f"[rank {rank}] argv ['--lr', '0.1', '--help', '--', 'x'] name __main__ file show_env.py" in lines
        assert f"[rank {rank}] group {rank} 2 gloo" in lines
        where = next(line for line in lines if line.startswith(f"[rank {rank}] dir "))
        assert where.split(" ", 3)[3] != str(tmp_path)  # shipped by value: the ranks run a private copy
    assert leftover_processes(client) == []


@pytest.mark.slow
def test_every_worker_by_default_and_too_many_workers(cluster, tmp_path):
    address, client = cluster
    script = write(tmp_path, "show_env.py", ENV_SCRIPT)
    out = run_cli("run", "--scheduler", address, script)
    assert out.returncode == 0, out.stderr
    assert "[rank 2] group 2 3 gloo" in out.stdout
    too_many = run_cli("run", "--scheduler", address, "--workers", "5", script)
    assert too_many.returncode == 2
    assert "asked for 5 workers, the cluster has 3" in too_many.stderr


@pytest.mark.slow
def test_a_failing_rank_exits_1_with_the_root_cause(cluster, tmp_path):
    address, client = cluster
    script = write(tmp_path, "fails.py", """
        import time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        print("hello", flush=True)

        def check(rank):
            if rank == 1:
                raise ValueError(f"bad batch on rank {rank}")

        check(dist.get_rank())
        dist.barrier()
        time.sleep(120)
    """)
    out = run_cli("run", "--scheduler", address, "--workers", "2", script)
    assert out.returncode == 1
    err = out.stderr
    assert "fails.py failed: ValueError: bad batch on rank 1" in err
    assert 'raise ValueError(f"bad batch on rank {rank}")' in err  # the script's own line, from the client's file
    assert "raised on rank 1, worker tcp://127.0.0.1:" in err
    assert "other ranks: rank 0" in err
    assert "dask_ddp/client/job.py" not in err  # the traceback starts in the user's code
    assert out.seconds < 100  # rank 0 sleeps for 120 s: it was stopped
    assert leftover_processes(client) == []


@pytest.mark.slow
def test_sys_exit_codes(cluster, tmp_path):
    address, client = cluster
    script = write(tmp_path, "exits.py", """
        import os, sys
        if os.environ["RANK"] == "1":
            sys.exit(int(sys.argv[1]))
        sys.exit(0)
    """)
    assert run_cli("run", "--scheduler", address, "--workers", "2", script, "0").returncode == 0
    out = run_cli("run", "--scheduler", address, "--workers", "2", script, "3")
    assert out.returncode == 1
    assert "exits.py failed on rank 1: ScriptExitError: exits.py called sys.exit with code 3 on rank 1" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_max_restarts(cluster, tmp_path):
    address, client = cluster
    script = write(tmp_path, "flaky.py", """
        import os
        import torch.distributed as dist
        dist.init_process_group("gloo")
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if attempt == 0 and dist.get_rank() == 1:
            raise RuntimeError("first attempt fails")
        dist.barrier()
        print("attempt", attempt, "ok", flush=True)
    """)
    out = run_cli("run", "--scheduler", address, "--workers", "2", "--max-restarts", "1", script)
    assert out.returncode == 0, out.stderr
    assert "[rank 0, attempt 2] attempt 1 ok" in out.stdout and "[rank 1, attempt 2] attempt 1 ok" in out.stdout


# ---- the script's folder: its sibling modules, and where relative paths land ---------------------------------

SIBLINGS_SCRIPT = """
    import os, sys
    import torch.distributed as dist
    import helpers
    from datautils import batch_size
    from helpers.maths import double
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    here = os.path.dirname(os.path.abspath(__file__))
    print("siblings", batch_size(), double(21), helpers.NAME, flush=True)
    print("imported from here", os.path.dirname(sys.modules["datautils"].__file__) == here, sys.path[0] == here,
          flush=True)
    shipped = sorted(os.path.relpath(os.path.join(d, f), here) for d, dirs, files in os.walk(here)
                     if "__pycache__" not in d for f in files)
    print("folder", here, "holds", " ".join(shipped), flush=True)
    with open(f"out-rank-{rank}.txt", "w") as f:  # a relative path: the rank's working directory
        f.write(str(rank))
    print("cwd", os.getcwd(), flush=True)
    dist.barrier()  # as any training has collectives: a rank leaving at once races the other's connectFullMesh
    dist.destroy_process_group()
"""


def project(tmp_path: Path) -> Path:
    """A script's folder as people have them: sibling modules, a package, data, a venv, caches, hidden files."""
    root = tmp_path / "project"
    (root / "helpers").mkdir(parents=True)
    write(root, "train.py", SIBLINGS_SCRIPT)
    write(root, "datautils.py", "def batch_size():\n    return 32\n")
    write(root / "helpers", "__init__.py", "NAME = 'helpers'\n")
    write(root / "helpers", "maths.py", "def double(x):\n    return 2 * x\n")
    write(root, "data.csv", "a,b\n1,2\n")
    write(root, "not-importable.py", "x = 1\n")
    for skipped in (".venv", "venv", "__pycache__", ".git", "fastext"):
        (root / skipped).mkdir()
        write(root / skipped, "mod.py", "x = 1\n")
    write(root / "venv", "pyvenv.cfg", "home = /usr/bin\n")
    write(root / "fastext", "__init__.py", "")
    (root / "fastext" / "_impl.so").write_bytes(b"\x7fELF")  # a compiled extension: must come from the workers
    return root


@pytest.mark.slow
def test_a_scripts_sibling_modules_ship_to_a_cluster_started_elsewhere(elsewhere, tmp_path):
    address, client, worker_cwd = elsewhere
    root = project(tmp_path)
    shell = tmp_path / "shell"  # where the user runs dask-ddp
    shell.mkdir()
    out = run_cli("run", "--scheduler", address, "--workers", "2", root / "train.py", cwd=shell)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for rank in (0, 1):
        assert f"[rank {rank}] siblings 32 42 helpers" in lines
        assert f"[rank {rank}] imported from here True True" in lines
        held = next(line for line in lines if line.startswith(f"[rank {rank}] folder "))
        folder, files = held.split(" ", 3)[3].split(" holds ")
        assert folder != str(root)  # a private copy: the workers need not see this machine's files
        assert files.split() == ["datautils.py", "helpers/__init__.py", "helpers/maths.py", "train.py"]
        assert f"[rank {rank}] cwd {worker_cwd}" in lines  # the dask worker's working directory
        assert (worker_cwd / f"out-rank-{rank}.txt").read_text() == str(rank)
    assert "fastext/ (compiled extension modules): install it on the workers" in out.stderr
    assert not list(shell.iterdir()) and not list(root.glob("out-rank-*"))
    assert leftover_processes(client) == []


@pytest.mark.slow
def test_a_scripts_sibling_modules_on_the_local_cluster(tmp_path):
    root = project(tmp_path)
    shell = tmp_path / "shell"
    shell.mkdir()
    out = run_cli("run", "--workers", "2", root / "train.py", cwd=shell)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for rank in (0, 1):
        assert f"[rank {rank}] siblings 32 42 helpers" in lines
        assert f"[rank {rank}] imported from here True True" in lines
        assert next(line for line in lines if line.startswith(f"[rank {rank}] folder ")).startswith(
            f"[rank {rank}] folder {root} holds ")  # the workers see the folder itself, as `python train.py` would
        assert f"[rank {rank}] cwd {shell}" in lines  # the local cluster's workers run where dask-ddp was run
        assert (shell / f"out-rank-{rank}.txt").read_text() == str(rank)
    assert "not shipped" not in out.stderr  # nothing ships to the local cluster


def test_the_bound_on_what_ships_is_a_usage_error(tmp_path):
    root = project(tmp_path)
    write(root, "big.py", "x = 1\n" * 400)
    out = run_cli("run", "--scheduler", "tcp://127.0.0.1:1", "--ship-limit", "0.001", root / "train.py", timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"the script's folder {root} holds 2." in out.stderr and " KiB of Python modules to ship" in out.stderr
    assert "over the bound of 1.0 KiB (the largest: big.py 2.3 KiB" in out.stderr
    assert "raise the bound with --ship-limit MIB" in out.stderr
    assert "Traceback" not in out.stderr and "cannot reach" not in out.stderr  # before anything is contacted


def test_what_ships_from_the_scripts_folder(tmp_path):
    from dask_ddp.cli.script import load_script

    root = project(tmp_path)
    os.symlink(root / "helpers", root / "linked")  # a linked package ships; a loop back to the folder does not
    os.symlink(root, root / "helpers" / "loop")
    script = load_script(root / "train.py", ship_limit=1 << 20)
    assert [rel for rel, _ in script.siblings] == ["datautils.py", "helpers/__init__.py", "helpers/maths.py",
                                                   "linked/__init__.py", "linked/maths.py"]
    assert dict(script.siblings)["datautils.py"] == (root / "datautils.py").read_bytes()
    assert script.not_shipped == ("fastext",)
    assert load_script(root / "train.py").siblings is None  # the local cluster's workers see the folder
    with pytest.raises(ValueError, match=r"holds .* over the bound of 100 bytes .*--ship-limit.*run the script from"):
        load_script(root / "train.py", ship_limit=100)


# ---- pure parts ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("workers, dask_cuda, gpus, kind", [
    (None, True, 0, "LocalCluster with 2 workers (TLS)"),
    (3, True, 0, "LocalCluster with 3 workers (TLS)"),
    (None, False, 4, "LocalCluster with 4 workers (TLS)"),
    (1, False, 4, "LocalCluster with 1 workers (TLS)"),
])
def test_local_cluster_choice(workers, dask_cuda, gpus, kind):
    from dask_ddp.cli.common import _local_cluster_kind

    assert _local_cluster_kind(workers, dask_cuda, gpus)[0] == kind


@pytest.mark.slow
def test_the_clis_local_cluster_speaks_tls_with_credentials_of_its_own():
    """dask-ddp run/demo started a plain-TCP cluster any local user could submit code to."""
    from dask.distributed import Client

    from dask_ddp.cli.common import _local_cluster_kind

    _, make = _local_cluster_kind(1, False, 0)
    with make() as cluster:
        assert cluster.scheduler_address.startswith("tls://"), cluster.scheduler_address
        with pytest.raises(Exception):  # noqa: B017 - without the credentials: refused (TLS handshake or type)
            Client(cluster.scheduler_address, timeout=5)
        with Client(cluster) as client:
            assert client.submit(lambda: 41 + 1).result(timeout=60) == 42


def test_local_cuda_cluster_choice_with_dask_cuda(monkeypatch):
    import importlib.util

    from dask_ddp.cli import common

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "dask_cuda" else None)
    assert common._local_cluster_kind(None, True, 2)[0] == "LocalCUDACluster with 2 workers (one GPU each; TLS)"


def test_load_script_errors(tmp_path):
    from dask_ddp.cli.script import load_script

    with pytest.raises(FileNotFoundError, match="no such script"):
        load_script(tmp_path / "missing.py")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        load_script(tmp_path)
    (tmp_path / "latin1.py").write_bytes(b"# \xe9\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_script(tmp_path / "latin1.py")
    (tmp_path / "ok.py").write_text("print('hi')\n")
    script = load_script(tmp_path / "ok.py", ["--a", 1])
    assert script.argv == ("--a", "1") and script.name == "ok.py" and os.path.isabs(script.path)


def test_run_script_outside_a_rank(tmp_path):
    from dask_ddp import NotInRankError
    from dask_ddp.cli.script import load_script, run_script

    (tmp_path / "ok.py").write_text("print('hi')\n")
    with pytest.raises(NotInRankError):
        run_script(load_script(tmp_path / "ok.py"))


def test_script_exit_error_pickles():
    import pickle

    from dask_ddp import RankFailedError
    from dask_ddp.cli.script import ScriptExitError

    err = pickle.loads(pickle.dumps(ScriptExitError("x.py called sys.exit with code 3", code=3, rank=1, worker="w")))
    assert isinstance(err, RankFailedError) and (err.code, err.rank, err.worker) == (3, 1, "w")

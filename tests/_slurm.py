"""A real single-node SLURM on this machine for the tests: munged, slurmctld and slurmd, all on 127.0.0.1.

Debian's ``slurm-wlm`` and ``munge`` packages (``.ci/run`` installs them when it runs as root). Everything
lives in one folder: the generated ``slurm.conf``, a munge key, the daemons' state, sockets, pid and log
files. The daemons run as root in the foreground of their own processes (``-D``), so stopping them is a
signal to a pid we hold. Client commands (``sbatch``, ``squeue``, ``scancel``) find the cluster through
``SLURM_CONF``, which :meth:`LocalSlurm.env` gives.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import psutil

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scancel", "sinfo", "scontrol")
NODE = "localhost"
CPUS = 8  # more than the 2 cores here (config_overrides): 3 worker jobs of 2 CPUs fit, none waits for a core


def why_not() -> str | None:
    """Why a local SLURM cannot start here, or None when it can."""
    if os.geteuid() != 0:
        return "starting slurmctld/slurmd/munged needs root"
    for name in DAEMONS + CLIENTS:
        if shutil.which(name) is None and not Path("/usr/sbin", name).exists():
            return f"{name} is not installed (apt-get install slurm-wlm munge; .ci/run does it as root)"
    return None


def free_port() -> int:
    """A port free now on 127.0.0.1: slurmctld and slurmd take theirs from slurm.conf, not from a bound socket."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


SLURM_CONF = """\
ClusterName=daskddp
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait={kill_wait}
MinJobAge=10
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
Waittime=0
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=16000 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class LocalSlurm:
    """munged, slurmctld and slurmd for one test session, in folder ``root``; :meth:`stop` ends all three."""

    def __init__(self, root: Path, kill_wait: int = 30):
        self.root = Path(root)
        self.kill_wait = kill_wait
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60.0) -> "LocalSlurm":
        """Write the configuration, start the three daemons and wait until the node takes jobs.

        Raises RuntimeError naming the daemon and the tail of its log when one does not come up.
        """
        for sub in ("state", "spool", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o755)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.conf.write_text(SLURM_CONF.format(node=NODE, root=self.root, ctld_port=free_port(),
                                               slurmd_port=free_port(), munge_socket=self.munge_socket,
                                               kill_wait=self.kill_wait, cpus=CPUS))
        m = self.root / "munge"
        self._spawn("munged", [_exe("munged"), "--foreground", "--force", f"--key-file={key}",
                               f"--socket={self.munge_socket}", f"--pid-file={m}/munged.pid",
                               f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"])
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged", m / "munged.log")
        self._spawn("slurmctld", [_exe("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self._ok(["scontrol", "ping"], "UP"), timeout, "slurmctld", self.root / "slurmctld.log")
        self._spawn("slurmd", [_exe("slurmd"), "-D", "-N", NODE, "-f", str(self.conf)])
        self._wait(lambda: self._ok(["sinfo", "-h", "-N", "-o", "%T"], "idle"), timeout, "slurmd",
                   self.root / "slurmd.log")
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                            start_new_session=True)
        log.close()

    def _ok(self, argv: list[str], wanted: str) -> bool:
        out = subprocess.run(argv, capture_output=True, text=True, env=self.env(), timeout=10)
        return out.returncode == 0 and wanted in out.stdout

    def _wait(self, ready, timeout: float, name: str, log: Path) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                break
            if ready():
                return
            time.sleep(0.2)
        tail = "".join(p.read_text(errors="replace")[-1500:] for p in (log, self.root / f"{name}.out") if p.exists())
        raise RuntimeError(f"{name} did not come up within {timeout:.0f} s (exit {self.procs[name].poll()}):\n{tail}")

    def run(self, *argv: str, check: bool = True) -> str:
        """Run a SLURM client command against this cluster; return its stdout."""
        out = subprocess.run(list(argv), capture_output=True, text=True, env=self.env(), timeout=30)
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
        return out.stdout

    def jobs(self) -> dict[str, str]:
        """Job id -> state (PENDING, RUNNING, ...) of the jobs slurmctld still lists."""
        out = self.run("squeue", "-h", "-o", "%i %T", check=False)
        return dict(line.split() for line in out.splitlines() if line.strip())

    def minutes_run(self, job_id: str) -> int:
        """Whole minutes job ``job_id`` has run (its ``RunTime``, rounded down)."""
        out = self.run("scontrol", "show", "job", job_id)
        run_time = dict(f.split("=", 1) for f in out.split() if "=" in f)["RunTime"]  # [D-]HH:MM:SS
        days, _, hms = run_time.rpartition("-")
        h, m, _ = (int(x) for x in hms.split(":"))
        return (int(days or 0) * 24 + h) * 60 + m

    def wait_job(self, job_id: str, timeout: float) -> tuple[str, str]:
        """Wait until job ``job_id`` has ended; return its state and exit code (``("COMPLETED", "0:0")``).

        Raises AssertionError naming the job's last state when it has not ended within ``timeout`` s.
        """
        deadline = time.monotonic() + timeout
        state = exit_code = "?"
        while time.monotonic() < deadline:
            out = self.run("scontrol", "show", "job", job_id, check=False)
            fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
            state, exit_code = fields.get("JobState", "?"), fields.get("ExitCode", "?")
            if state not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "?"):
                return state, exit_code
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} did not end within {timeout:.0f} s (last state {state})")

    def stop(self) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged (SIGTERM, then SIGKILL after 10 s)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--signal=KILL", "-u", "root"], env=self.env(),
                           capture_output=True, timeout=30)
            subprocess.run(["scancel", "-u", "root"], env=self.env(), capture_output=True, timeout=30)
            deadline = time.monotonic() + 15
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.2)
        for name in reversed(DAEMONS):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for proc in self.leftovers():  # a job step slurmd left running (slurmstepd outlives slurmd)
            with contextlib.suppress(psutil.Error):
                proc.kill()

    def leftovers(self) -> list:
        """Processes this SLURM started (slurmstepd, jobs: they inherit its ``SLURM_CONF``), this one excepted."""
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if proc.pid != os.getpid() and proc.environ().get("SLURM_CONF") == str(self.conf):
                    found.append(proc)
        return found


# ---- stand-ins: `dask-ddp slurm` without a SLURM ------------------------------------------------------------

STAND_IN_SRUN = r'''#!{python}
"""Stand-in srun: run the command --ntasks times here (SLURM_PROCID set), SIGTERM/SIGINT passed on to each."""
import os, signal, subprocess, sys
args, ntasks = sys.argv[1:], 1
while args and args[0].startswith("-"):
    opt = args.pop(0)
    if opt.startswith("--ntasks="):
        ntasks = int(opt.split("=", 1)[1])
procs = [subprocess.Popen(args, env={**os.environ, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)})
         for i in range(ntasks)]
def forward(sig, _):
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
sys.exit(max(abs(p.wait()) for p in procs))
'''

STAND_IN_SCONTROL = r'''#!{python}
"""Stand-in scontrol: only `scontrol show hostnames LIST` (a comma-separated list, no ranges)."""
import sys
if sys.argv[1:3] != ["show", "hostnames"]:
    sys.exit(f"stand-in scontrol: {sys.argv[1:]} is not supported")
print("\n".join(n for n in sys.argv[3].split(",") if n))
'''


def stand_in_slurm(folder: Path, python: str, nodes: list[str], tasks: int) -> dict[str, str]:
    """Stand-in ``srun`` and ``scontrol`` in ``folder`` and the environment of a batch step that runs on the first
    of ``nodes`` (``SLURMD_NODENAME``) with ``tasks`` tasks: ``dask-ddp slurm`` runs in it as in a SLURM job,
    its workers all on this machine."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", STAND_IN_SRUN), ("scontrol", STAND_IN_SCONTROL)):
        path = folder / name
        path.write_text(text.replace("{python}", python))
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    return {**env, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
            "SLURM_NTASKS": str(tasks), "SLURM_CPUS_PER_TASK": "1", "SLURM_JOB_NODELIST": ",".join(nodes),
            "SLURMD_NODENAME": nodes[0]}


def routed_address() -> str | None:
    """An IPv4 address of this machine other than loopback (the kind a node's scheduler listens on), or None."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None

"""Simulated hosts on one machine: a network namespace per host on a private bridge, a Dask scheduler and workers.

Layout (``T`` a random tag, ``X`` a free octet, both per :class:`SimulatedHosts`)::

    root namespace (the test, i.e. the client)
      ddp-T-c 10.214.X.1/30 ---- veth ---- up0 10.214.X.2/30 ----+
                                                                   | ddp-T-sched: dask scheduler on 10.213.X.1:8786
      ddp-T-sw: bridge br0 <---- veth ----- veth-s 10.213.X.1/24 --+
          h1 <---- veth ---- veth-h1 10.213.X.11/24   ddp-T-h1: dask workers h1-w0, h1-w1, ...
          h2 <---- veth ---- veth-h2 10.213.X.12/24   ddp-T-h2: ...

The root namespace routes 10.213.X.0/24 through its link to the scheduler's
namespace, which does not forward: the client reaches the scheduler and
nothing else (a notebook outside the cluster's network). Nothing else of the
machine's network changes; everything is removed by :meth:`SimulatedHosts.close`
(processes killed by process group and by namespace, namespaces, the root link,
``/etc/netns/<ns>``), from a fixture's ``finally``, from ``atexit``, and by the
next run when a run was killed (:func:`sweep_stale`).

Cut a host off with :meth:`SimulatedHosts.cut` (its switch port goes down: as
a pulled cable, the host keeps its address and its processes hear nothing).
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

ROOT = Path(__file__).resolve().parents[1]  # the checkout the workers import (PYTHONPATH)
STATE = Path("/run/ddp-hosts")  # <tag>.pid: the owner of live namespaces, for sweep_stale
NETNS_ETC = Path("/etc/netns")
SCHEDULER_PORT = 8786  # inside a namespace of our own: nothing else can hold it
_TAG = re.compile(r"\bddp-([0-9a-f]{6})-")
_LIVE: set["SimulatedHosts"] = set()


def ip(*args: str, check: bool = True) -> str:
    """Run ``ip ARGS``; return its stdout. Raises RuntimeError with ip's message when ``check`` and it fails."""
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def unavailable() -> str | None:
    """Why simulated hosts cannot be made here (a skip reason), or None."""
    if os.geteuid() != 0:
        return f"simulated hosts need root for network namespaces (running as uid {os.geteuid()})"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"simulated hosts need the '{tool}' command, not found on PATH"
    probe = f"ddp-{uuid.uuid4().hex[:6]}-probe"
    try:
        ip("netns", "add", probe)
    except RuntimeError as exc:
        return f"network namespaces are not available here: {exc}"
    ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One simulated host: its namespace, its address on the bridge, its interface and its workers' names."""

    index: int  # 0-based, the node_rank its workers get (hosts are ordered by address)
    ns: str
    address: str
    ifname: str  # the host's end of its veth (what GLOO_SOCKET_IFNAME must name)
    port: str  # the switch's end: down = the host is cut off
    workers: list[str]
    hostname: str | None = None  # its own name (unshare --uts) resolving to its address, or the machine's


@dataclass
class SimulatedHosts:
    """N hosts with ``workers_per_host[i]`` Dask workers each, and a scheduler host; see the module docstring.

    ``host_names=True`` gives host i the name ``h<i+1>``, which its ``/etc/hosts`` maps to its address;
    otherwise every host has the machine's name, which /etc/hosts maps to loopback. ``worker_env`` is
    added to the workers' environment, ``env`` to the scheduler's and the workers' (e.g. a Dask setting
    as ``DASK_DISTRIBUTED__...``, for the whole simulated cluster).
    """

    workers_per_host: Sequence[int]
    host_names: bool = False
    worker_env: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])

    def __post_init__(self):
        self.prefix = f"ddp-{self.tag}"
        self.octet = _free_octet()
        self.subnet = ipaddress.ip_network(f"10.213.{self.octet}.0/24")
        self.switch_ns, self.scheduler_ns = f"{self.prefix}-sw", f"{self.prefix}-sched"
        self.scheduler_address = f"10.213.{self.octet}.1"
        self.client_link = f"{self.prefix}-c"
        self.client_side, self.scheduler_side = f"10.214.{self.octet}.1", f"10.214.{self.octet}.2"
        self.hosts = [Host(i, f"{self.prefix}-h{i + 1}", f"10.213.{self.octet}.{11 + i}", f"veth-h{i + 1}",
                           f"h{i + 1}", [f"h{i + 1}-w{j}" for j in range(n)], f"h{i + 1}" if self.host_names else None)
                      for i, n in enumerate(self.workers_per_host)]
        self.namespaces: list[str] = []  # created, in order
        self.procs: list[subprocess.Popen] = []
        self.host_procs: dict[int, list[subprocess.Popen]] = {h.index: [] for h in self.hosts}  # dask worker processes
        self.logs = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        self.client = None
        self._made_netns_etc = False

    __hash__ = object.__hash__

    @property
    def scheduler_url(self) -> str:
        return f"tcp://{self.scheduler_address}:{SCHEDULER_PORT}"

    @property
    def n_workers(self) -> int:
        return sum(self.workers_per_host)

    # ---- start -----------------------------------------------------------------------------------------------
    def start(self, timeout: float = 240) -> "SimulatedHosts":
        from distributed import Client

        from dask_ddp.client.cluster import scheduler_workers

        _LIVE.add(self)
        _on_sigterm_clean_up()
        self._write_state()
        self._network()
        self.spawn(self.scheduler_ns, ["-m", "distributed.cli.dask_scheduler", "--host", self.scheduler_address,
                                       "--port", str(SCHEDULER_PORT), "--no-dashboard"], "scheduler", env=self.env)
        self._wait_for_scheduler(60)
        for host in self.hosts:
            self.start_workers(host)
        self.client = Client(f"tcp://{self.scheduler_address}:{SCHEDULER_PORT}", timeout=60)
        try:
            self.client.wait_for_workers(self.n_workers, timeout=timeout)
        except Exception as exc:
            raise RuntimeError(f"{len(scheduler_workers(self.client))} of {self.n_workers} "
                               f"workers joined ({exc!r}):\n{self.log_tails()}") from None
        return self

    def _network(self) -> None:
        self._add_ns(self.switch_ns)
        ip("-n", self.switch_ns, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch_ns, "link", "set", "br0", "up")
        self._add_ns(self.scheduler_ns)
        self._plug(self.scheduler_ns, "veth-s", "sched", self.scheduler_address)
        # the client's link: its root end is the only thing of ours outside our namespaces
        ip("link", "add", self.client_link, "type", "veth", "peer", "name", "up0", "netns", self.scheduler_ns)
        ip("addr", "add", f"{self.client_side}/30", "dev", self.client_link)
        ip("link", "set", self.client_link, "up")
        ip("-n", self.scheduler_ns, "addr", "add", f"{self.scheduler_side}/30", "dev", "up0")
        ip("-n", self.scheduler_ns, "link", "set", "up0", "up")
        ip("route", "add", str(self.subnet), "via", self.scheduler_side, "dev", self.client_link)
        for host in self.hosts:
            self._add_ns(host.ns)
            self._plug(host.ns, host.ifname, host.port, host.address)
            if host.hostname:
                self._hosts_file(host)

    def _add_ns(self, ns: str) -> None:
        ip("netns", "add", ns)
        self.namespaces.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")
        # forwarding stays off (the default of a new namespace): the scheduler's namespace must not route
        out = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/sys/net/ipv4/ip_forward"],
                             capture_output=True, text=True)
        if out.stdout.strip() not in ("0", ""):
            raise RuntimeError(f"namespace {ns} forwards IPv4 ({out.stdout.strip()}): refusing to go on")

    def _plug(self, ns: str, ifname: str, port: str, address: str) -> None:
        """A veth from ``ns`` (named ``ifname``, holding ``address``) to the bridge (named ``port`` there)."""
        ip("-n", self.switch_ns, "link", "add", port, "type", "veth", "peer", "name", ifname, "netns", ns)
        ip("-n", self.switch_ns, "link", "set", port, "master", "br0")
        ip("-n", self.switch_ns, "link", "set", port, "up")
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", ifname)
        ip("-n", ns, "link", "set", ifname, "up")

    def _hosts_file(self, host: Host) -> None:
        """``ip netns exec`` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts: the host's name is its address."""
        if not NETNS_ETC.exists():
            NETNS_ETC.mkdir()
            self._made_netns_etc = True
            self._write_state()
        (NETNS_ETC / host.ns).mkdir()
        others = "".join(f"{h.address} {h.hostname}\n" for h in self.hosts if h is not host)
        (NETNS_ETC / host.ns / "hosts").write_text(f"127.0.0.1 localhost\n{host.address} {host.hostname}\n{others}")

    def _write_state(self) -> None:
        """Who owns this run's namespaces (and whether it made /etc/netns), for :func:`sweep_stale`."""
        STATE.mkdir(parents=True, exist_ok=True)
        (STATE / f"{self.tag}.pid").write_text(f"{os.getpid()} {int(self._made_netns_etc)}")

    def spawn(self, ns: str, args: list[str], log: str, hostname: str | None = None,
              env: dict | None = None) -> subprocess.Popen:
        """Start ``python ARGS`` in namespace ``ns`` (optionally with its own host name), in a session of its own."""
        cmd = ["ip", "netns", "exec", ns]
        if hostname:
            cmd += ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname]
        full_env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
        full_env.update(PYTHONPATH=str(ROOT), **(env or {}))
        with open(self.logs / f"{log}.log", "ab") as out:
            proc = subprocess.Popen(cmd + [sys.executable, *args], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=full_env, cwd=self.logs, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start_workers(self, host: Host) -> None:
        """Start (again) one ``dask worker`` process per worker name of ``host``."""
        for name in host.workers:
            self.host_procs[host.index] = [p for p in self.host_procs[host.index] if p.poll() is None]
            self.host_procs[host.index].append(self.spawn(host.ns, ["-m", "distributed.cli.dask_worker", self.scheduler_url, "--nworkers", "1",
                                 "--nthreads", "1", "--host", host.address, "--name", name, "--no-dashboard",
                                 "--local-directory", str(self.logs / name)], name, host.hostname,
                                 {**self.env, **self.worker_env}))

    def _wait_for_scheduler(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[0].poll() is not None:
                break
            with socket.socket() as s:
                s.settimeout(1)
                if s.connect_ex((self.scheduler_address, SCHEDULER_PORT)) == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the scheduler did not listen on {self.scheduler_url}:\n{self.log_tails()}")

    # ---- acting on hosts --------------------------------------------------------------------------------------
    def cut(self, host: Host) -> None:
        ip("-n", self.switch_ns, "link", "set", host.port, "down")

    def restore(self, host: Host) -> None:
        ip("-n", self.switch_ns, "link", "set", host.port, "up")

    def workers_of(self, host: Host) -> list[str]:
        """Addresses of ``host``'s workers the scheduler knows now."""
        from dask_ddp.client.cluster import scheduler_workers

        return sorted(a for a in scheduler_workers(self.client)
                      if a.startswith(f"tcp://{host.address}:"))

    def host_of(self, address: str) -> Host:
        return next(h for h in self.hosts if address.startswith(f"tcp://{h.address}:"))

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for path in sorted(self.logs.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    # ---- teardown ---------------------------------------------------------------------------------------------
    def close(self) -> list[str]:
        """Kill every process, delete every namespace, link and file made; return what is still left (nothing)."""
        _LIVE.discard(self)
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close(timeout=5)
        _kill_groups(self.procs)
        # the client's link first, here, synchronously: a namespace's deletion destroys its links later, in the
        # kernel's own time, and the link in the root namespace (with its address and route) went with them
        # only after leftovers() had looked (CI: "route ... dev ddp-T-c", the link itself already unlisted)
        if self.client_link in ip("-o", "link", check=False):
            ip("link", "del", self.client_link, check=False)
        for ns in reversed(self.namespaces):
            _kill_namespace(ns)
            ip("netns", "del", ns, check=False)
        for host in self.hosts:
            shutil.rmtree(NETNS_ETC / host.ns, ignore_errors=True)
        if self._made_netns_etc:
            with contextlib.suppress(OSError):
                NETNS_ETC.rmdir()
        shutil.rmtree(self.logs, ignore_errors=True)
        with contextlib.suppress(OSError):
            (STATE / f"{self.tag}.pid").unlink()
        with contextlib.suppress(OSError):
            STATE.rmdir()  # when no other run holds namespaces
        deadline = time.monotonic() + 10  # what a deleted namespace held goes asynchronously (a kernel work queue)
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def leftovers(self) -> list[str]:
        """Anything of this run still on the machine: namespaces, links, routes, addresses, hosts files."""
        left = [f"netns {line}" for line in ip("netns", "list").splitlines() if self.prefix in line]
        left += [f"link {line.split(':')[1].strip()}" for line in ip("-o", "link").splitlines() if self.prefix in line]
        net = f"10.21[34].{self.octet}."
        left += [f"route {r}" for r in ip("route").splitlines() if re.search(net, r)]
        left += [f"addr {a}" for a in ip("-o", "addr").splitlines() if re.search(net, a)]
        left += [f"file {p}" for p in NETNS_ETC.glob(f"{self.prefix}-*")] if NETNS_ETC.exists() else []
        return left


def _kill_groups(procs: list[subprocess.Popen], grace: float = 3.0) -> None:
    """SIGTERM every process group started, SIGKILL what is left after ``grace`` s, reap them all."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


def _kill_namespace(ns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in ``ns`` (rank processes live in sessions of their own) until none is left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [int(p) for p in ip("netns", "pids", ns, check=False).split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _free_octet() -> int:
    """A third octet X with neither 10.213.X.0/24 nor 10.214.X.0/30 in any route or address of the machine."""
    used = ip("route") + ip("-o", "addr")
    free = [x for x in range(256) if f"10.213.{x}." not in used and f"10.214.{x}." not in used]
    if not free:
        raise RuntimeError("no free 10.213.X.0/24 left")
    return random.choice(free)


def sweep_stale() -> list[str]:
    """Remove what a killed earlier run left: namespaces ``ddp-<tag>-*`` and links whose owner process is gone."""
    live = {hosts.tag for hosts in _LIVE}  # this process's own, in use (a module's hosts while a test starts more)
    tags = set(_TAG.findall(ip("netns", "list") + ip("-o", "link"))) - live
    removed = []
    for tag in tags:
        owner, made_etc = STATE / f"{tag}.pid", False
        with contextlib.suppress(OSError, ValueError):
            pid, made = map(int, owner.read_text().split())
            if pid != os.getpid() and _alive(pid):
                continue  # another run's, alive
            made_etc = bool(made)
        for line in ip("netns", "list").splitlines():
            ns = line.split()[0]
            if ns.startswith(f"ddp-{tag}-"):
                _kill_namespace(ns)
                ip("netns", "del", ns, check=False)
                shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
                removed.append(ns)
        if f"ddp-{tag}-c" in ip("-o", "link"):
            ip("link", "del", f"ddp-{tag}-c", check=False)
            removed.append(f"ddp-{tag}-c")
        with contextlib.suppress(OSError):
            owner.unlink()
        if made_etc:
            with contextlib.suppress(OSError):
                NETNS_ETC.rmdir()  # only when empty
    with contextlib.suppress(OSError):
        STATE.rmdir()
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@atexit.register
def _close_all() -> None:
    """The safety net: a run that ends without its fixtures' finally (an interrupt at a bad moment) still cleans up."""
    for hosts in list(_LIVE):
        with contextlib.suppress(Exception):
            hosts.close()


def _on_sigterm_clean_up() -> None:
    """A SIGTERM (a CI job cancelled, a timeout's kill) skips atexit: clean up first, then die of it."""
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return

    def handler(signum, frame):
        _close_all()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)


@contextlib.contextmanager
def simulated_hosts(workers_per_host: Sequence[int], **kw) -> Iterator[SimulatedHosts]:
    """Start :class:`SimulatedHosts`; close them however the block ends, and fail if anything was left behind."""
    sweep_stale()
    hosts = SimulatedHosts(workers_per_host, **kw)
    left = None
    try:
        hosts.start()
        yield hosts
    finally:
        left = hosts.close()
    if left:
        raise AssertionError(f"simulated hosts left things behind: {left}")

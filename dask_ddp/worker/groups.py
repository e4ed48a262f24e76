"""A rank's process group, signalled and watched without ever naming a pid that may have been reused.

Runs in: the Dask worker (for each rank process and the zygote, see :mod:`dask_ddp.worker.process`).

A rank runs in a process group of its own (the DataLoader workers, the resource tracker and the helpers it
starts are in it too). Once the rank has been reaped (by the worker, or by the zygote for a forked rank), its
pid, which is also the group's id, may be given to another process: ``os.killpg(pid, ...)`` could then
signal a stranger. So the group is held by a *pidfd* of its leader, opened while the leader was surely ours
(an unreaped child, or a pidfd the rank sent of itself), and signalled with ``pidfd_send_signal(...,
PIDFD_SIGNAL_PROCESS_GROUP)`` (Linux 6.9): the kernel resolves the group from the leader's own ``struct
pid``, which no new process can have. Without that flag (Linux 5.3-6.8) the group is signalled by its id only
while the pidfd shows the leader has not exited (its id is then still the group's); without pidfds at all,
only while the exit is not known yet (``exited``). Where neither holds, nothing is sent: what is left of the
group is found by the rank's token instead (:func:`dask_ddp.worker.process.stop_marked`).

:meth:`ProcessGroup.signal_members` signals the members one by one, each through a pidfd of its own, sparing some
(the resource tracker, see :meth:`dask_ddp.worker.process.RankBase.kill`).

Whether a member still *runs* is read from ``/proc`` (zombies do not run: an orphaned member's zombie
may wait seconds for init to reap it).
"""

from __future__ import annotations

import errno
import os
import select
import signal
import threading
import time
from typing import Callable

__all__ = ["ProcessGroup", "open_pidfd"]

PIDFD_SIGNAL_PROCESS_GROUP = 4  # linux/pidfd.h (Linux 6.9+)


def open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (call only while ``pid`` is surely the process meant), or None where there are none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class ProcessGroup:
    """The process group led by ``pid`` (a process started in a session of its own).

    ``pidfd``: a pidfd of the leader (owned by this object from now on), or None; ``exited()``: whether the
    leader's exit is known (the fallback without pidfds). Thread-safe; :meth:`close` once done.
    """

    def __init__(self, pid: int, pidfd: int | None, exited: Callable[[], bool]):
        self.pid, self._fd, self._exited = pid, pidfd, exited
        self._lock = threading.Lock()
        self._group_flag = pidfd is not None  # whether the kernel takes PIDFD_SIGNAL_PROCESS_GROUP

    def signal(self, sig: int) -> None:
        """Send ``sig`` to every process of the group (what can be reached without naming a reused pid)."""
        with self._lock:
            if self._fd is not None and self._group_flag:
                try:
                    signal.pidfd_send_signal(self._fd, sig, None, PIDFD_SIGNAL_PROCESS_GROUP)
                    return
                except ProcessLookupError:  # nobody is left in the group
                    return
                except OSError as exc:
                    if exc.errno != errno.EINVAL:  # EPERM: not ours to signal
                        return
                    self._group_flag = False  # an older kernel: by the group's id, while it surely is ours
            if not self._leader_exited():
                try:
                    os.killpg(self.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def signal_leader(self, sig: int) -> None:
        """Send ``sig`` to the leader only (no-op once it has exited)."""
        with self._lock:
            if self._fd is not None:
                try:
                    signal.pidfd_send_signal(self._fd, sig)
                except OSError:  # exited (and reaped), or not ours
                    pass
            elif not self._exited():
                try:
                    os.kill(self.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def signal_members(self, sig: int, spare: Callable[[bytes], bool]) -> list[int] | None:
        """Send ``sig`` to each running member of the group but those whose command line (``/proc/<pid>/cmdline``,
        NUL-separated) ``spare`` accepts; return the pids spared. None where it cannot be done safely (no pidfds;
        before Linux 6.9, once the leader has exited, the group cannot be told from another that took its id):
        the members not reached yet were not signalled, and the caller signals the group or its leader instead.

        Each member is signalled through a pidfd of its own, opened *before* its group and command line are read,
        and only if, after that read, the pidfd shows it still runs and the group is still this one (the kernel
        says the leader's group has members, or the leader has not exited): the process checked is the process
        signalled, never one that took the pid of a member that ended, nor a member of a group that took this
        group's id. A member forked after the look at ``/proc`` is not seen: call again.
        """
        with self._lock:
            if self._fd is None or not hasattr(os, "pidfd_open"):
                return None
            spared: list[int] = []
            for pid in self.running():
                try:
                    fd = os.pidfd_open(pid)
                except OSError as exc:
                    if exc.errno == errno.ENOSYS:  # no pidfds on this kernel
                        return None
                    continue  # ended meanwhile
                try:
                    member, cmdline = _member_of(pid, self.pid)
                    if not member or select.select([fd], [], [], 0)[0]:  # another group's, or it ended meanwhile
                        continue
                    if not self._group_is_ours():  # gone (the kernel says so), or unknown: the leader exited
                        return spared if self._group_flag else None
                    if spare(cmdline):
                        spared.append(pid)
                    else:
                        signal.pidfd_send_signal(fd, sig)
                except OSError:  # ended meanwhile, or not ours to signal
                    continue
                finally:
                    os.close(fd)
            return spared

    def _group_is_ours(self) -> bool:
        """Whether the group's id is still this group's: it has members (asked of the kernel through the
        leader's pidfd, Linux 6.9+), or else the leader has not exited (its pid, the id, is then surely its own)."""
        if self._fd is not None and self._group_flag:
            try:
                signal.pidfd_send_signal(self._fd, 0, None, PIDFD_SIGNAL_PROCESS_GROUP)  # 0: sends nothing
                return True
            except ProcessLookupError:
                return False
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    return False
                self._group_flag = False
        return not self._leader_exited()

    def _leader_exited(self) -> bool:
        if self._fd is not None:  # readable once the leader has exited (a zombie or reaped)
            return bool(select.select([self._fd], [], [], 0)[0])
        return self._exited()

    def leader_exited(self) -> bool:
        """Whether the leader has exited (ended, reaped or not)."""
        with self._lock:
            return self._leader_exited()

    def running(self) -> list[int]:
        """The pids of the group's members that still run (zombies do not)."""
        found = []
        try:
            names = os.listdir("/proc")
        except OSError:
            return [] if self.leader_exited() else [self.pid]
        for name in names:
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue  # ended meanwhile
            if len(fields) > 2 and int(fields[2]) == self.pid and fields[0] not in (b"Z", b"X"):
                found.append(int(name))
        return found

    def wait(self, timeout: float, interval: float = 0.05) -> bool:
        """Wait up to ``timeout`` s until no member runs; True if none does.

        Looks after 5 ms, then twice as long each time up to ``interval`` (a rank that is ending takes a few
        ms); while the leader is the only member left, its pidfd wakes the wait as soon as it exits.
        """
        deadline, nap = time.monotonic() + timeout, min(0.005, interval)
        while members := self.running():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            fd = self._fd
            try:
                if members == [self.pid] and fd is not None:  # readable once it has exited
                    select.select([fd], [], [], min(nap, left))
                else:
                    time.sleep(min(nap, left))
            except (OSError, ValueError):  # closed meanwhile
                time.sleep(min(nap, left))
            nap = min(2 * nap, interval)
        return True

    def close(self) -> None:
        """Let go of the pidfd (signals after this go by the known exit only)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _member_of(pid: int, group: int) -> tuple[bool, bytes]:
    """Whether process ``pid`` is in process group ``group``, and its command line (b"" if unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except (OSError, IndexError):
        return False, b""
    return len(fields) > 2 and int(fields[2]) == group, cmdline

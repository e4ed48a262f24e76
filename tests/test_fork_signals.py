"""A SIGTERM that reaches a rank's forked child before the child's fork hooks ran is kept, then ends the child.

Seen (tests/test_fork_pools.py, the 12th job of a probe, twice): a Pool worker forked by a rank was alive with
SIGTERM at its default action and nothing pending, blocked on the task queue's lock that ``Pool.terminate()``
holds, while the rank joined it forever. ``Pool.terminate()`` had SIGTERMed it before it ran: a signal that
arrives between ``fork()`` and the child's own signal set-up is caught by the inherited Python handler's trampoline
and then cleared by CPython's after-fork signal reset, i.e. lost. Now the forking thread blocks SIGTERM across the
fork and the child unblocks it once its handler is the default, so the kernel keeps it pending meanwhile.

Runs in a fresh interpreter (fork hooks cannot be unregistered): it installs a rank-like SIGTERM handler as
``preemption.start`` does and forks a child whose first after-fork hook checks that SIGTERM is blocked there and
then SIGTERMs the child itself. The child must die of SIGTERM's default action, and the parent must get its mask
and handler back. Without the fix the child's handler runs instead (here a stand-in that only writes a line; the
C-level window before it cannot be reached from Python), and the child exits 0.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from dask_ddp.rank import preemption

    def handler(signum, frame):  # the rank's handler: a notice in the rank; in a child it ends the child
        os.write(1, b"handler ran in %d\\n" % os.getpid())

    def first_hook():  # after-fork hooks run in the order registered: this one before ours
        blocked = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        os.write(1, b"blocked in the child's first hook: %d\\n" % blocked)
        os.kill(os.getpid(), signal.SIGTERM)

    os.register_at_fork(after_in_child=first_hook)
    preemption._ON_SIGTERM = handler
    signal.signal(signal.SIGTERM, handler)
    os.register_at_fork(before=preemption._block_sigterm, after_in_parent=preemption._unblock_sigterm,
                        after_in_child=preemption._default_sigterm_in_child)
    pid = os.fork()
    if pid == 0:
        time.sleep(0.5)
        os._exit(0)  # SIGTERM was lost
    _, status = os.waitpid(pid, 0)
    print("child", "killed by %d" % os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exited %d" % os.WEXITSTATUS(status))
    print("parent mask", sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    print("parent handler is the rank's", signal.getsignal(signal.SIGTERM) is handler)
""")


def test_sigterm_in_the_fork_window_ends_the_child():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert f"child killed by {int(signal.SIGTERM)}" in lines, out.stdout
    assert "blocked in the child's first hook: 1" in lines, out.stdout
    assert not any(line.startswith("handler ran") for line in lines), out.stdout
    assert "parent mask []" in lines, out.stdout  # the parent's SIGTERM is not left blocked
    assert "parent handler is the rank's True" in lines, out.stdout

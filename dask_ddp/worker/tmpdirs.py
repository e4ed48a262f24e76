"""Where a worker's ranks keep their temporary files: one private folder per worker process, one per rank in it.

Runs in: the Dask worker (the rank supervisor makes a rank's TMPDIR with ``mkdtemp`` in :func:`worker_tmp_root`;
the worker plugin sweeps the roots of workers that are gone, :func:`sweep_tmp_roots`).

Why private: the root's name, ``<system temp>/ddp-w<pid>``, is one anyone can guess, and it must be, so that
the next worker finds what a killed one left behind. Another user who made it first (a folder of theirs, or a
link to one) could read what the ranks write there, or swap a rank's folder for one of theirs. So the root is
made atomically with mode 0700 and, where it exists already, opened without following links and checked:
this user's and 0700 (an own folder with a looser mode is set to 0700), or else never used (another private
root is made beside it, and a warning names both). Each rank's TMPDIR inside it is a ``mkdtemp`` (0700). The
sweep removes only real folders of this user.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import tempfile

__all__ = ["worker_tmp_root", "private_folder", "sweep_tmp_roots"]

logger = logging.getLogger("dask_ddp")


def worker_tmp_root() -> str:
    """This worker process's private folder of rank TMPDIRs: ``<system temp>/ddp-w<pid>``, made if missing.

    A name anyone can guess: where another user made it first (or put a link there), another private folder,
    ``ddp-w<pid>-XXXXXXXX``, is made and used instead (see :func:`private_folder`); this process remembers which.
    A worker killed with its ranks leaves it behind; the next worker's :class:`~dask_ddp.worker.plugin.RankHost`
    removes the folders of workers that are gone (:func:`sweep_tmp_roots`).
    """
    pid = os.getpid()
    root = _ROOTS.get(pid)
    if root is None or _not_private(root) is not None:  # not made yet, or removed since (a closing worker's)
        root = _ROOTS[pid] = private_folder(tempfile.gettempdir(), f"ddp-w{pid}")
    return root


_ROOTS: dict[int, str] = {}  # pid -> its root: a forked child must not take its parent's


def private_folder(base: str, name: str) -> str:
    """``base/name`` as a folder that only this user can enter: made with mode 0700, or kept if it is already
    this user's (its mode set to 0700: an older dask-ddp made it 0755).

    Where it is not this user's folder (another user made it first, or it is a link: anything the rank wrote
    there could be read, or its folders swapped), a fresh private ``base/name-XXXXXXXX`` is made instead and a
    warning names both. Raises OSError only if ``base`` itself cannot be written.
    """
    path = os.path.join(base, name)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)  # atomic: nobody sees it with another mode or owner
    why = _not_private(path, fix_mode=True)
    if why is None:
        return path
    other = tempfile.mkdtemp(prefix=name + "-", dir=base)
    logger.warning("dask-ddp: %s %s, so its ranks' temporary folders go to %s instead; remove %s (it is not "
                   "dask-ddp's), or give the worker a TMPDIR of its own", path, why, other, path)
    return other


def _not_private(path: str, fix_mode: bool = False) -> str | None:
    """Why ``path`` is not a private folder of this user (None: it is). Opened without following a link,
    so what is checked is what is there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:  # a link gives ELOOP or ENOTDIR (O_DIRECTORY is checked first on some kernels)
        if os.path.islink(path):
            return "is a symbolic link"
        return {errno.ENOTDIR: "is not a folder", errno.ENOENT: "does not exist"}.get(
            exc.errno or 0, f"cannot be opened ({exc.strerror})")
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            return f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
        if stat.S_IMODE(st.st_mode) != 0o700:
            if not fix_mode:
                return f"has mode {stat.S_IMODE(st.st_mode):o}"
            os.fchmod(fd, 0o700)
        return None
    finally:
        os.close(fd)


def sweep_tmp_roots() -> list[str]:
    """Remove the rank TMPDIR roots (``ddp-w<pid>``, ``ddp-w<pid>-XXXXXXXX``) of this user's worker processes
    that no longer run; return what was removed.

    Only real folders of this user: never another user's, never through a link. Raises nothing (best effort:
    a pid reused by another process keeps its folder until that one ends).
    """
    import psutil

    removed: list[str] = []
    base = tempfile.gettempdir()
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        pid = name[len("ddp-w"):].split("-", 1)[0] if name.startswith("ddp-w") else ""
        if not pid.isdigit() or int(pid) == os.getpid() or psutil.pid_exists(int(pid)):
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed

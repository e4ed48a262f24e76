"""``PrivateFolder``: a folder of one user's cached files that no other local user can read, plant or swap.

Runs in: the rank process and its DataLoader workers (the node shard cache, :mod:`dask_ddp.data.streaming.cache`, and
``S3ImageFolder``'s blob cache, :mod:`.blob_cache`).

A cache folder the user names (``cache_dir=``, ``cache=``) may be shared by the users of a host, or made first
by one of them (``/local/nvme/shards``, ``/tmp/cache``). The files themselves therefore live one level down,
in ``<folder>/dask-ddp-<uid>``: made ``0700`` (files ``0600``), so a private bucket's objects are readable by
this user alone, and refused when it is a symbolic link, not a folder, owned by another user or open to
group or others (someone else made it, or could have planted a file in it). The folder is opened once per
process and checked through that descriptor; every file is then reached relative to it (``openat`` with
``O_NOFOLLOW``), never through the path again, so a folder renamed or swapped after the check changes
nothing. A file is used only when the descriptor opened says it is a regular file of this user that no
one else can write (``fstat`` of that descriptor); the caller maps or reads that same descriptor, so a file
replaced after the check cannot change what is read. Files are written unnamed (``O_TMPFILE``) and linked
into place complete, or as a ``.part-<pid>-...`` file linked into place where the filesystem lacks it (the
shard cache removes those of processes that are gone).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat

__all__ = ["PrivateFolder", "mapped", "others_can_write"]

logger = logging.getLogger("dask_ddp.data")
PREFIX = "dask-ddp-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class PrivateFolder:
    """``<parent>/dask-ddp-<uid>``: this user's files, reached through one checked descriptor per process.

    Pickles as its path (a DataLoader worker or another process opens and checks the folder again).
    """

    def __init__(self, parent: str | os.PathLike) -> None:
        self.parent = os.path.abspath(os.path.expanduser(os.fspath(parent)))
        self.path = os.path.join(self.parent, f"{PREFIX}{os.geteuid()}")
        self._fd: int | None = None
        self._pid: int | None = None

    def fd(self) -> int:
        """The folder's descriptor in this process, made (``0700``) and checked on first use.

        Raises PermissionError (a symbolic link, owned by another user, open to group or others: the message
        names the folder, its owner and mode, and what to do), OSError (the parent cannot be made, ...).
        """
        if self._fd is None or self._pid != os.getpid():
            os.makedirs(self.parent, exist_ok=True)
            try:
                os.mkdir(self.path, 0o700)
            except FileExistsError:
                pass
            self._fd, self._pid = _open_dir(self.path, None, self.path), os.getpid()
        return self._fd

    def open(self, name: str) -> int | None:
        """A read-only descriptor of the file ``name`` (``"sub/file"`` goes through the checked sub-folder),
        or None (no such file, or one refused: not a regular file of this user, or writable by others; a
        refused file is removed, logged). The caller closes it.

        Raises OSError when the folder itself cannot be used (as :meth:`fd`).
        """
        head, _, base = name.rpartition("/")
        try:
            folder = self._sub(head, make=False)
        except FileNotFoundError:
            return None
        try:
            try:
                fd = os.open(base, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
            except FileNotFoundError:
                return None
            except OSError as err:
                if err.errno != errno.ELOOP:
                    raise
                self._refuse(folder, base, name, "a symbolic link")  # O_NOFOLLOW: not followed
                return None
            st = os.fstat(fd)
            problem = _file_problem(st)
            if problem:
                os.close(fd)
                self._refuse(folder, base, name, problem)
                return None
            return fd
        finally:
            if folder != self._fd:
                os.close(folder)

    def write(self, name: str, data: bytes) -> None:
        """Store ``data`` as ``name`` (``0600``; complete or not at all; an existing file is kept: caches key
        their files by content or by an object that does not change). Raises OSError (disk full, ...)."""
        head, _, base = name.rpartition("/")
        folder = self._sub(head, make=True)
        try:
            _write(folder, base, data)
        finally:
            if folder != self._fd:
                os.close(folder)

    def entries(self) -> list[tuple[str, os.stat_result | None]]:
        """The top folder's names with their ``lstat`` (None: removed since it was listed). Raises OSError.

        Listed through a descriptor of its own: ``os.scandir`` and ``os.listdir`` of the shared descriptor
        :meth:`fd` would share its read offset with every other thread listing it (they duplicate it, and
        rewind it when done), and a thread then saw no names, or the same names several times (a prefetch
        thread's eviction counted each file again, and emptied the shard cache).
        """
        fd = os.open(".", _DIR_FLAGS, dir_fd=self.fd())
        try:
            with os.scandir(fd) as it:
                found: list[tuple[str, os.stat_result | None]] = []
                for e in it:
                    try:
                        found.append((e.name, e.stat(follow_symlinks=False)))
                    except FileNotFoundError:
                        found.append((e.name, None))
                return found
        finally:
            os.close(fd)

    def unlink(self, name: str) -> None:
        """Remove the file ``name`` of the top folder (gone already: nothing). Raises OSError."""
        try:
            os.unlink(name, dir_fd=self.fd())
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Close this process's descriptor of the folder (the next use opens and checks it again)."""
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = self._pid = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fd": None, "_pid": None}

    def __repr__(self) -> str:
        return f"PrivateFolder({self.path!r})"

    def _sub(self, head: str, make: bool) -> int:
        """The checked descriptor of the sub-folder ``head`` ("" is the folder itself)."""
        fd = self.fd()
        if not head:
            return fd
        if "/" in head or head in (".", ".."):
            raise ValueError(f"{head!r} is not one sub-folder name")
        if make:
            try:
                os.mkdir(head, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
        return _open_dir(head, fd, os.path.join(self.path, head))

    def _refuse(self, folder: int, base: str, name: str, problem: str) -> None:
        logger.warning("dask-ddp: %s in the private cache folder %s is not used and is removed (%s): only files "
                       "this user wrote there are read", name, self.path, problem)
        try:
            os.unlink(base, dir_fd=folder)
        except OSError:
            pass


def mapped(fd: int) -> bytes | mmap.mmap:
    """The file of descriptor ``fd`` mapped read-only (``b""`` when empty: an empty file cannot be mapped); the
    map outlives ``fd``. Raises OSError, ValueError."""
    return mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if os.fstat(fd).st_size else b""


def others_can_write(st: os.stat_result) -> bool:
    """Whether someone other than this user (and root) may write the file ``st`` describes: it is group- or
    world-writable, or owned by another user; raises nothing."""
    return bool(st.st_mode & 0o022) or st.st_uid not in (os.geteuid(), 0)


def _open_dir(name: str, dir_fd: int | None, shown: str) -> int:
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW: a symbolic link in its place
            raise PermissionError(f"{shown} is a symbolic link: dask-ddp keeps its cache in a folder of its own, "
                                  "not through a link another user may have made; remove it") from None
        raise
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise PermissionError(
            f"{shown} is not private to this user (uid {os.geteuid()}): it is owned by uid {st.st_uid} with mode "
            f"{stat.filemode(st.st_mode)}; another user may have made it or planted files in it. Remove it (or, if "
            f"it is yours, chmod 700 it), or give another cache folder")
    return fd


def _file_problem(st: os.stat_result) -> str:
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file ({stat.filemode(st.st_mode)})"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not this user's uid {os.geteuid()}"
    if st.st_mode & 0o022:
        return f"writable by others ({stat.filemode(st.st_mode)})"
    return ""


def _write(folder: int, base: str, data: bytes) -> None:
    try:
        fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600, dir_fd=folder)
    except (OSError, AttributeError):  # no O_TMPFILE here: a named part file, linked into place
        part = f".part-{os.getpid()}-{os.urandom(4).hex()}"
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)
        try:
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
            try:
                os.link(part, base, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
            except FileExistsError:
                pass  # another process wrote the same file
        finally:
            try:
                os.unlink(part, dir_fd=folder)
            except FileNotFoundError:
                pass
        return
    try:
        _write_all(fd, data)
        try:  # CPython calls linkat(..., AT_SYMLINK_FOLLOW) here, which links the unnamed file
            os.link(f"/proc/self/fd/{fd}", base, dst_dir_fd=folder, follow_symlinks=True)
        except FileExistsError:
            pass  # another process wrote the same file
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]

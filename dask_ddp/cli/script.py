"""Runs in: the client (:func:`load_script`) and the rank process (:func:`run_script`).

Run an unchanged torchrun-style script as the function of a dask-ddp rank (``dask-ddp run``).

The script travels by value: :func:`load_script` reads and compiles it on the
client, so a syntax error is reported before anything ships and the workers
need not share a filesystem with the client. On each rank, :func:`run_script`
executes it as ``__main__`` the way ``python script.py ARGS`` would, with
torchrun's environment already set by the rank process.

Why :func:`run_script` leaves the process group first: the rank process has
initialised the default group before calling its function, and the script's
own ``dist.init_process_group(...)`` would fail with "initialize the default
process group twice". After ``destroy_process_group()`` the rendezvous store
lives on (rank 0's process holds it, at ``MASTER_ADDR:MASTER_PORT``), but an
``env://`` init would make the script's rank 0 *bind* that port again
(``EADDRINUSE``). ``TORCHELASTIC_USE_AGENT_STORE=True`` is what torchrun sets
for the same situation (its agent hosts the store): every rank, rank 0
included, then connects to the existing store as a client. The script's
group keys live under torch's ``default_pg`` prefix, apart from the first
group's.

Where it runs from: on the CLI's own local cluster (``load_script`` without
``ship_limit``) the workers see the client's files, so ``sys.path[0]`` is the
script's folder and ``__file__`` the script, as under ``python``. On a cluster
started elsewhere (``--scheduler``) the modules beside the script ship with it
(:mod:`dask_ddp.cli.siblings`): ``sys.path[0]`` and ``__file__`` point to a
private copy of the folder (in the rank's ``TMPDIR``, removed after the rank)
holding the script and those modules. Data files next to ``__file__`` are not
there, and packages with compiled extensions must be installed on the workers.
Relative paths resolve against the rank's working directory, its Dask
worker's (where ``dask worker`` started; for the local cluster, where
``dask-ddp run`` did).

Why this module stays light (no torch, no distributed at import): the job
ships :func:`run_script` by reference, so every rank imports this module (and
the ``dask_ddp.cli`` package around it) to unpickle it.
"""

from __future__ import annotations

import builtins
import contextlib
import linecache
import os
import shutil
import sys
import tempfile
import types
from dataclasses import dataclass
from typing import Iterator, Sequence

from dask_ddp.cli import siblings as _siblings
from dask_ddp.rank.context import get_context
from dask_ddp.wire.errors import RankExitError

__all__ = ["Script", "ScriptExitError", "load_script", "run_script"]


class ScriptExitError(RankExitError):
    """A script called ``sys.exit`` with a non-zero code (or a message) on a rank; ``code`` keeps it."""


@dataclass(frozen=True)
class Script:
    """A script read on the client: its path there (the code's file name), its text and its arguments.

    ``siblings`` are the Python files beside it that ship with it, as ``(relative POSIX path, content)``
    (:func:`dask_ddp.cli.siblings.collect`); None when the workers see the client's folder (the CLI's local
    cluster). ``not_shipped`` names the packages beside it left out (compiled extension modules).
    """

    path: str
    source: str
    argv: tuple[str, ...] = ()
    siblings: tuple[tuple[str, bytes], ...] | None = None
    not_shipped: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The script's file name (``train.py``), as messages name it; raises nothing."""
        return os.path.basename(self.path)


def load_script(path: str | os.PathLike, argv: Sequence[str] = (), *, ship_limit: int | None = None) -> Script:
    """Read a Python script on the client and check that it compiles.

    Parameters
    ----------
    path : str or os.PathLike
        The script, as ``python path`` would take it.
    argv : sequence of str
        Its command-line arguments (``sys.argv[1:]`` on the ranks).
    ship_limit : int, optional
        Collect the Python modules beside the script to ship with it, up to this many bytes (for workers
        that do not see the client's files). None: ship none, the workers import from the folder itself.

    Raises
    ------
    FileNotFoundError, IsADirectoryError, PermissionError
        The script cannot be read; the message names the path.
    SyntaxError
        The script does not compile (file name and line as Python reports them).
    ValueError
        The script is not UTF-8 text, or the modules beside it add up to more than ``ship_limit`` bytes.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory: give the path of a Python script")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"no such script: {path}") from None
    try:
        source = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (a Python script?): {exc}") from None
    compile(source, path, "exec")  # SyntaxError here, on the client, before anything ships
    files, not_shipped = _siblings.collect(path, ship_limit) if ship_limit is not None else (None, ())
    return Script(path=path, source=source, argv=tuple(str(a) for a in argv), siblings=files,
                  not_shipped=not_shipped)


def run_script(script: Script) -> int:
    """Run ``script`` as ``__main__`` on this rank; return 0 when it ends or exits with code 0.

    Call it only as the function of ``dask_ddp.dispatch.run``: it leaves the
    rank's process group so that the script can initialise its own (``env://``
    through the existing rendezvous store; see the module docstring).

    Raises
    ------
    NotInRankError
        Outside a dask-ddp rank.
    ScriptExitError
        The script called ``sys.exit`` with a non-zero code or a message.
    Exception
        Whatever the script raised, unchanged (the client re-raises it with its type).
    """
    import torch.distributed as dist  # here, not at the top: the client imports this module too

    ctx = get_context()
    if dist.is_initialized():
        # a rank that leaves at once would close its gloo connections while a slower rank is still
        # making them (connectFullMesh: "Connection closed by peer"): leave together
        dist.barrier()
        dist.destroy_process_group()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # connect to rank 0's store; never bind it again
    code = compile(script.source, script.path, "exec")
    # the client has the file, so tracebacks formatted there show its lines; here, serve them from memory
    linecache.cache[script.path] = (len(script.source), None, script.source.splitlines(True), script.path)
    try:
        with _as_main(script) as namespace:
            exec(code, namespace)  # noqa: S102 - running the user's script is the point
    except SystemExit as exc:
        what = ScriptExitError.describe(exc.code)
        if what is None:
            return 0
        raise ScriptExitError(f"{script.name} called sys.exit with {what} on rank {ctx.rank}",
                              code=exc.code, rank=ctx.rank, worker=ctx.worker) from None
    return 0


@contextlib.contextmanager
def _as_main(script: Script) -> Iterator[dict]:
    """A fresh ``__main__`` module for the script, with ``sys.argv`` and ``sys.path[0]`` as ``python`` sets them.

    ``sys.path[0]`` is the script's own folder when the workers see it (nothing shipped), else a private copy
    holding the script and its shipped siblings, removed afterwards. The file serves ``__file__`` and
    multiprocessing's spawn start method (which re-imports ``__main__`` from its file).
    """
    copy = None if script.siblings is None else _private_copy(script)
    file = script.path if copy is None else copy
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=file, __builtins__=builtins, __spec__=None, __loader__=None,
                         __package__=None, __cached__=None)
    saved = sys.modules.get("__main__"), sys.argv, list(sys.path)
    sys.modules["__main__"], sys.argv = main, [file, *script.argv]
    sys.path.insert(0, os.path.dirname(file))
    try:
        yield main.__dict__
    finally:
        if saved[0] is not None:
            sys.modules["__main__"] = saved[0]
        sys.argv, sys.path[:] = saved[1], saved[2]
        if copy is not None:
            shutil.rmtree(os.path.dirname(copy), ignore_errors=True)


def _private_copy(script: Script) -> str:
    """Write the script and its siblings into a new folder (under the rank's TMPDIR); return the script's path."""
    folder = tempfile.mkdtemp(prefix="dask-ddp-script-")
    _siblings.materialise(script.siblings, folder)
    copy = os.path.join(folder, script.name)
    with open(copy, "w", encoding="utf-8") as f:
        f.write(script.source)
    return copy

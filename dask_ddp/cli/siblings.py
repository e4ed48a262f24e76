"""Runs in: the client (:func:`collect`) and the rank process (:func:`materialise`).

The modules beside a script, shipped with it to a cluster started elsewhere (``dask-ddp run --scheduler``).

``python train.py`` puts the script's folder first on ``sys.path``, so ``from datautils import load`` finds
``datautils.py`` beside it. The workers of a cluster started elsewhere do not have that folder, so the client
collects the folder's importable Python files (:func:`collect`), they travel with the script, and each rank
writes them into its private copy of the folder (:func:`materialise`), which :mod:`dask_ddp.cli.script` puts
first on ``sys.path``. Nothing ships to the CLI's own local cluster: its workers see the folder itself.

What ships: every ``*.py`` beside the script whose name can be imported, and every folder beside it whose name
can be imported (a package, regular or namespace), with the ``*.py`` files of its tree. What never ships:
hidden files and folders, ``__pycache__``, ``node_modules``, virtual environments (a folder holding
``pyvenv.cfg`` or ``conda-meta``) and data files. Nor does a package with compiled extension modules (``.so``,
``.pyd``): a copy without them would shadow the complete package installed on the workers, so it must be
installed there (:func:`collect` names it). Folder links are followed, except back into a folder being read.

The total is bounded (``dask-ddp run --ship-limit``, :data:`DEFAULT_LIMIT` bytes): every rank receives it in its
task, through the scheduler. Python source is small; a folder over the bound is usually a whole project
(the script at its root), and the error says so.
"""

from __future__ import annotations

import os
from typing import Iterable

__all__ = ["DEFAULT_LIMIT", "collect", "materialise"]

#: The most bytes of Python files shipped with a script unless ``--ship-limit`` says otherwise (4 MiB).
DEFAULT_LIMIT = 4 << 20

_NEVER = frozenset({"__pycache__", "node_modules", "site-packages"})
_COMPILED = (".so", ".pyd")
_ENVIRONMENT = ("pyvenv.cfg", "conda-meta")


def collect(script: str, limit: int) -> tuple[tuple[tuple[str, bytes], ...], tuple[str, ...]]:
    """The Python files beside ``script`` to ship with it, and the packages left out (compiled extensions).

    Returns ``(files, not_shipped)``: ``files`` as ``(relative POSIX path, content)`` in path order, the
    script itself excluded (it travels as text); ``not_shipped`` the names of the packages beside it that
    hold compiled extension modules. Files that cannot be read are left out (Python could not import them).

    Raises
    ------
    ValueError
        The files add up to more than ``limit`` bytes; the message names the folder, the total, the
        largest files, and what to do.
    OSError
        The script's folder cannot be listed.
    """
    folder = os.path.dirname(os.path.abspath(script))
    found, not_shipped = [], []
    for entry in _entries(folder):
        if entry.is_file() and _is_module(entry.name) and entry.path != os.path.abspath(script):
            found.append((entry.name, entry.path))
        elif _is_package(entry):
            inside, compiled = _package(entry.path, entry.name, {os.path.realpath(folder)})
            if compiled:
                not_shipped.append(entry.name)
            else:
                found += inside
    sizes = {rel: _size(path) for rel, path in found}
    _check_bound(folder, sizes, limit)
    files = ((rel, _read(path)) for rel, path in sorted(found))
    return tuple((rel, data) for rel, data in files if data is not None), tuple(not_shipped)


def materialise(files: Iterable[tuple[str, bytes]], folder: str) -> None:
    """Write the ``(relative POSIX path, content)`` pairs of :func:`collect` under ``folder``; raises ``OSError``."""
    for rel, data in files:
        path = os.path.join(folder, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def _entries(folder: str) -> list[os.DirEntry]:
    with os.scandir(folder) as found:
        return sorted((e for e in found if not e.name.startswith(".")), key=lambda e: e.name)


def _is_module(name: str) -> bool:
    return name.endswith(".py") and name[:-3].isidentifier()


def _is_package(entry: os.DirEntry) -> bool:
    """A folder Python could import from: its name is an identifier; not a cache, nor a virtual environment."""
    return (entry.name.isidentifier() and entry.name not in _NEVER and entry.is_dir()
            and not any(os.path.exists(os.path.join(entry.path, marker)) for marker in _ENVIRONMENT))


def _package(path: str, rel: str, above: set[str]) -> tuple[list[tuple[str, str]], bool]:
    """The ``(relative path, path)`` of a package's ``*.py`` files, and whether it holds compiled extensions."""
    real = os.path.realpath(path)
    if real in above:  # a link back into a folder being read
        return [], False
    found, compiled = [], False
    for entry in _entries(path):
        name = f"{rel}/{entry.name}"
        if entry.is_file():
            if _is_module(entry.name):
                found.append((name, entry.path))
            compiled = compiled or entry.name.endswith(_COMPILED)
        elif _is_package(entry):
            inside, deeper = _package(entry.path, name, above | {real})
            found, compiled = found + inside, compiled or deeper
    return found, compiled


def _check_bound(folder: str, sizes: dict[str, int], limit: int) -> None:
    total = sum(sizes.values())
    if total <= limit:
        return
    largest = ", ".join(f"{rel} {_human(n)}" for rel, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:3])
    raise ValueError(
        f"the script's folder {folder} holds {_human(total)} of Python modules to ship with it, over the bound of "
        f"{_human(limit)} (the largest: {largest}): raise the bound with --ship-limit MIB, or run the script from "
        f"a folder that holds only it and the modules it imports (modules installed on the workers need not be "
        f"beside it; data files never ship)")


def _human(n: int) -> str:
    return f"{n} bytes" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None

"""Pickle the training call for the ranks, keeping the file name of each function shipped by value.

Runs in: the client (:func:`dumps`) and the rank (:func:`_named_code`, called by ``pickle.loads``, and
:func:`expose_main`).
cloudpickle 3.1.3 writes ``"<dynamic-code>"`` as the file name of every function it ships by value (a
notebook's functions always are, and so are those of a module only the notebook can import): a failing rank's
traceback then names no file and shows no source line, and a stalled rank's stack dump shows none either.
:func:`dumps` is ``cloudpickle.dumps`` with one change: each code object is rebuilt under its own file name.
On cloudpickle releases that kept the name it changes nothing.
"""

from __future__ import annotations

import inspect
import io
import pickle
import sys
import types
from collections import ChainMap

import cloudpickle

__all__ = ["dumps", "expose_main"]


def _named_code(rebuild, args: tuple, filename: str) -> types.CodeType:
    """Rebuild a code object as cloudpickle does, under ``filename`` (its file where the client defined it)."""
    code = rebuild(*args)
    return code if code.co_filename == filename else code.replace(co_filename=filename)


def _reduce_code(code: types.CodeType):
    rebuild, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    return _named_code, (rebuild, args, code.co_filename)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)


def dumps(obj) -> bytes:
    """``cloudpickle.dumps(obj)``, with every function shipped by value keeping its file name (see the module).

    Raises
    ------
    Exception
        Whatever ``cloudpickle.dumps`` raises for an object that cannot be pickled.
    """
    with io.BytesIO() as buffer:
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return buffer.getvalue()


def expose_main(*objects) -> list[str]:
    """In a rank: make the functions and classes of the notebook's (or script's) ``__main__`` that ``objects``
    are, are instances of, or use, findable as ``__main__.<name>``, as they are in the notebook; return the names
    set.

    They ship by value, so in the rank they live only in the shipped functions' globals, while standard pickle
    finds a function or class by module and name: a ``multiprocessing.Pool`` (fork) given one of them failed
    with "attribute lookup ... on __main__ failed". A name the rank's own ``__main__`` has is left as it is.
    """
    main = sys.modules["__main__"]
    found: dict[str, object] = {}
    for obj in objects:
        for value in [obj, type(obj), *(getattr(obj, "__globals__", None) or {}).values()]:
            if _of_main(value):
                found.setdefault(value.__qualname__, value)
    names = [name for name in found if not hasattr(main, name)]
    for name in names:
        setattr(main, name, found[name])
    return names


def _of_main(obj) -> bool:
    """A top-level function or class of ``__main__`` (what pickle would look up there by name)."""
    return ((inspect.isfunction(obj) or isinstance(obj, type)) and getattr(obj, "__module__", None) == "__main__"
            and "." not in getattr(obj, "__qualname__", "."))

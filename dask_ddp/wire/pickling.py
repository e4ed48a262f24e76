"""Pickle the training call for the ranks, keeping the file name of each function shipped by value.

Runs in: the client (:func:`dumps_call`, :func:`local_module`, :func:`dumps`) and the rank (:func:`_named_code`,
called by ``pickle.loads``, and :func:`expose_main`).
cloudpickle 3.1.3 writes ``"<dynamic-code>"`` as the file name of every function it ships by value (a
notebook's functions always are, and so are those of a module only the notebook can import): a failing rank's
traceback then names no file and shows no source line, and a stalled rank's stack dump shows none either.
:func:`dumps` is ``cloudpickle.dumps`` with one change: each code object is rebuilt under its own file name.
On cloudpickle releases that kept the name it changes nothing.
"""

from __future__ import annotations

import inspect
import io
import os
import pickle
import sys
import sysconfig
import types
from collections import ChainMap
from typing import Callable, Sequence

import cloudpickle

from dask_ddp.wire.errors import SerializationError

__all__ = ["dumps_call", "local_module", "dumps", "expose_main"]


def local_module(fn: Callable):
    """The module of ``fn`` when it is a user's file (a script, a test) rather than an installed package, else None.

    cloudpickle ships functions of importable modules by reference; the workers would then fail with
    ModuleNotFoundError for a module that only the client has, so the caller ships it by value
    (``cloudpickle.register_pickle_by_value``) while it pickles. Raises nothing.
    """
    mod = sys.modules.get(getattr(fn, "__module__", None) or "")
    path = getattr(mod, "__file__", None)
    if mod is None or mod.__name__ == "__main__" or not path:
        return None
    installed = {os.path.realpath(p) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"],
                                               sysconfig.get_paths()["platlib"])}
    real = os.path.realpath(path)
    if any(real.startswith(p + os.sep) for p in installed) or mod.__name__.split(".")[0] == "dask_ddp":
        return None
    return mod


def dumps_call(fn: Callable, args: Sequence, kwargs: dict) -> bytes:
    """The training call ``(fn, args, kwargs)`` pickled for the ranks (:func:`dumps`), ``fn``'s module shipped by
    value when it is a user's file (:func:`local_module`; one the user registered already stays registered).

    Raises
    ------
    SerializationError
        ``fn`` or an argument cannot be pickled: names which, and says to create it inside the function.
    """
    mod = local_module(fn)
    if mod is not None and mod.__name__ in cloudpickle.list_registry_pickle_by_value():
        mod = None  # the user registered it already: leave it registered
    if mod is not None:
        cloudpickle.register_pickle_by_value(mod)
    try:
        return _dumps_parts(fn, args, kwargs)
    finally:
        if mod is not None:
            cloudpickle.unregister_pickle_by_value(mod)


def _dumps_parts(fn: Callable, args: Sequence, kwargs: dict) -> bytes:
    try:
        return dumps((fn, tuple(args), dict(kwargs)))  # the user's file names kept in tracebacks
    except Exception as whole:  # noqa: BLE001 - find which part, to name it
        parts = [("the function " + getattr(fn, "__qualname__", repr(fn)), fn)]
        parts += [(f"positional argument {i} ({type(a).__name__})", a) for i, a in enumerate(args)]
        parts += [(f"keyword argument {k!r} ({type(v).__name__})", v) for k, v in kwargs.items()]
        for what, obj in parts:
            try:
                cloudpickle.dumps(obj)
            except Exception as exc:  # noqa: BLE001
                raise SerializationError(f"{what} cannot be pickled to ship to the workers: {exc}. Create it "
                                         "inside the training function instead (e.g. open files, clients, locks "
                                         "and CUDA tensors there)") from exc
        raise SerializationError(f"the call cannot be pickled to ship to the workers: {whole}") from whole


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

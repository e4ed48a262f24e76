"""Pickle the training call for the ranks, keeping the file name of each function shipped by value.

Runs in: the client (:func:`dumps`) and the rank (:func:`_named_code`, called by ``pickle.loads``).
cloudpickle 3.1.3 writes ``"<dynamic-code>"`` as the file name of every function it ships by value (a
notebook's functions always are, and so are those of a module only the notebook can import): a failing rank's
traceback then names no file and shows no source line, and a stalled rank's stack dump shows none either.
:func:`dumps` is ``cloudpickle.dumps`` with one change: each code object is rebuilt under its own file name.
On cloudpickle releases that kept the name it changes nothing.
"""

from __future__ import annotations

import io
import pickle
import types
from collections import ChainMap

import cloudpickle

__all__ = ["dumps"]


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

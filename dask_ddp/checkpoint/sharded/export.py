"""A sharded checkpoint as one file: ``torch.save`` or safetensors, in one process (the ``dask-ddp export`` verb).

Runs in: any one process (a notebook, a shell, a serving box): no process group, no GPU.

The whole state is read with torch DCP's format utilities (the
empty-state load planner of ``dcp_to_torch_save``, which rebuilds the nested
dict from the checkpoint's own metadata, with ``no_dist``) over our reader, so every shard's
CRC-32 is checked and every value that is not a tensor is unpickled with ``weights_only=True``
(:mod:`.values`: a checkpoint handed over for export cannot run code), and written once.
``torch`` keeps the nested dict as saved
(``{"model": {...}, "optim": {...}, "epoch": 3}``); ``safetensors`` takes the
tensors under flattened names (``model.0.weight``, ``optim.state.0.weight.exp_avg``)
and the other values as JSON in the file's metadata (``dask_ddp.values``).
"""

from __future__ import annotations

import contextlib
import io
import json

from dask_ddp.checkpoint import folder
from dask_ddp.checkpoint.sharded import folder as sharded_folder
from dask_ddp.checkpoint.sharded import reader as dcp_reader
from dask_ddp.checkpoint.sharded import state as sharded_state
from dask_ddp.checkpoint.sharded import values as dcp_values

__all__ = ["export_sharded", "read_sharded"]


def read_sharded(directory: str, *, step: int | None = None, storage_options: dict | None = None) -> tuple:
    """Return ``(step, state)``: the whole state of a committed step (the newest by default) as nested dicts of
    CPU tensors and values, read in this one process.

    As :func:`dask_ddp.load_sharded`, values that are not tensors are read with ``weights_only=True`` only, and
    without ``step`` a step whose marker or metadata does not check out is skipped with a warning.

    Raises
    ------
    FileNotFoundError
        No committed step there (none that checks out), or not ``step`` (the message lists those there are).
    CheckpointError, ShardError, PermissionError
        As :func:`dask_ddp.load_sharded` (a ShardError for an item ``weights_only=True`` refuses).
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    where = folder.where(directory, storage_options)
    with contextlib.ExitStack() as leases:
        picked = sharded_folder.choose(where, step, leases)
        if picked is None:
            raise FileNotFoundError(f"no committed sharded step in {sharded_folder.base(where)[1]} (or none that "
                                    "checks out: see the warnings)")
        chosen, metadata = picked
        reader = dcp_reader.ShardReader(where.fs, f"{sharded_folder.base(where)[0]}/{chosen.folder}", chosen.url,
                                        metadata, options=where.options)
        state: dict = {}  # no_dist: this process alone, even inside a process group
        sharded_state.run_dcp(lambda: _load_state_dict(state, storage_reader=reader, no_dist=True,
                                                       planner=dcp_values.load_planner(rebuild=True)),
                              "reading", chosen.step)  # the reader's own error, not DCP's wrapper
    return chosen.step, sharded_state.decode_keys(state)


def export_sharded(directory: str, out: str, *, step: int | None = None, format: str = "torch",
                   storage_options: dict | None = None, out_options: dict | None = None) -> int:
    """Write a committed sharded step (the newest by default) to ``out`` (a path or fsspec URL) as one
    ``torch.save`` file (``format="torch"``) or a safetensors file (``format="safetensors"``); return its step.

    ``torch.load(out, weights_only=True)`` reads the torch file back; ``safetensors.torch.load_file`` the other.

    Raises
    ------
    ValueError
        Unknown ``format``. ImportError: ``format="safetensors"`` without the safetensors package.
    FileNotFoundError, CheckpointError, ShardError, PermissionError
        As :func:`read_sharded`; PermissionError also when ``out`` cannot be written.
    """
    if format not in ("torch", "safetensors"):
        raise ValueError(f"format must be 'torch' or 'safetensors', got {format!r}")
    if format == "safetensors":
        try:
            import safetensors.torch  # noqa: F401 - checked before the read
        except ImportError:
            raise ImportError("format='safetensors' needs the safetensors package: pip install safetensors") from None
    found, state = read_sharded(directory, step=step, storage_options=storage_options)
    data = _torch_bytes(state) if format == "torch" else _safetensors_bytes(state)
    from dask_ddp import storage

    fs, path = storage.resolve(out, out_options)
    storage.call(lambda: fs.pipe_file(path, data), out, doing="writing it", storage_options=out_options)
    return found


def _torch_bytes(state: dict) -> bytes:
    import torch

    torch.save(state, buffer := io.BytesIO())
    return buffer.getvalue()


def _safetensors_bytes(state: dict) -> bytes:
    import torch
    from safetensors.torch import save
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    tensors = {k: v.contiguous() for k, v in flat.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    return save(tensors, metadata={"dask_ddp.values": json.dumps(values, default=repr)})

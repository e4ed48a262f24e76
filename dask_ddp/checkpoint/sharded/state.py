"""The user's ``state`` dict as torch DCP sees it, and the checks that give bad input a clear error.

Runs in: the rank process.

:func:`to_save`/:func:`to_load` turn ``{"model": m, "optim": o, "epoch": 3, ...}``
into DCP state dicts (``get_state_dict``: DDP's ``module.`` prefix gone, FSDP2
parameters as DTensors) and :func:`apply` loads them back (``set_state_dict``).
:func:`check_agreement` (every rank the same keys, kinds and global shapes),
:func:`check_against` (the checkpoint was made with this model) and
:func:`run_dcp` (DCP's ``CheckpointException`` turned into the first failing
rank's own error) make the errors name what to do.
"""

from __future__ import annotations

import hashlib

from dask_ddp.checkpoint.sharded import values as dcp_values
from dask_ddp.checkpoint.whole import CheckpointError

__all__ = ["to_save", "to_load", "load_main", "load_extras", "apply", "encode_keys", "decode_keys", "check_agreement",
           "check_against", "run_dcp", "on_rank_zero"]


def _roles(state: dict) -> tuple[str | None, str | None]:
    import torch

    models = [k for k, v in state.items() if isinstance(v, torch.nn.Module)]
    optims = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
    if len(optims) > 1 or (optims and len(models) != 1):
        raise ValueError(f"a sharded state holds at most one optimizer, next to its one model; got models "
                         f"{models} and optimizers {optims}: save each pair with its own save_sharded directory, "
                         "or wrap them in an object with state_dict()/load_state_dict()")
    if not isinstance(next(iter(state), ""), str) or not all(isinstance(k, str) and k for k in state):
        raise TypeError(f"the keys of a sharded state are non-empty strings, got {list(state)[:5]}")
    return (models[0] if optims else None), (optims[0] if optims else None)


def to_save(state: dict) -> dict:
    """The DCP state dict of ``state`` (models and optimizer as sharded state dicts, Statefuls' state_dict())."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model_key, optim_key = _roles(state)
    out = {}
    for key, value in state.items():
        if key == optim_key:
            continue
        if key == model_key:
            out[key], out[optim_key] = get_state_dict(value, [state[optim_key]])
        elif isinstance(value, torch.nn.Module):
            out[key] = get_model_state_dict(value)
        elif _stateful(value):
            out[key] = encode_keys(value.state_dict())
        else:
            out[key] = encode_keys(value)
    return out


_INT = "__int__"  # DCP flattens dict keys into paths where an int means a list index: int keys travel as text


def encode_keys(obj):
    """``obj`` with every int dict key ``k`` as ``"__int__k"`` (an optimizer's ``state`` is keyed by ints)."""
    if isinstance(obj, dict):
        return {(f"{_INT}{k}" if isinstance(k, int) and not isinstance(k, bool) else k): encode_keys(v)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(encode_keys(v) for v in obj)
    return obj


def decode_keys(obj):
    """The inverse of :func:`encode_keys`."""
    if isinstance(obj, dict):
        return {(int(k[len(_INT):]) if isinstance(k, str) and k.startswith(_INT) else k): decode_keys(v)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(decode_keys(v) for v in obj)
    return obj


def to_load(state: dict) -> tuple[dict, list[str]]:
    """``(the DCP state dict of the models and the optimizer, the other keys)``.

    Models and optimizer load in place, resharded onto this job's DTensors; the other entries (Statefuls,
    plain values) are read whole from the checkpoint's own metadata (see :func:`load_extras`), so that a
    fresh object (an optimizer without state yet) gets everything that was saved, not only the keys it has.
    """
    import torch

    model_key, optim_key = _roles(state)
    main = {k: v for k, v in state.items() if k == optim_key or isinstance(v, torch.nn.Module)}
    return to_save(main), [k for k in state if k not in main]


def load_main(flat: dict, reader, group, no_dist: bool) -> None:
    """Load the models and the optimizer of :func:`to_load` in place (``dcp.load``, values read safely)."""
    import torch.distributed.checkpoint as dcp

    dcp.load(flat, storage_reader=reader, planner=dcp_values.load_planner(), process_group=group, no_dist=no_dist)


def load_extras(keys: list[str], reader, group, no_dist: bool) -> dict:
    """Read the entries ``keys`` of a checkpoint whole (every rank the same), as saved."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    out: dict = {}  # filled by the planner from the metadata (dcp.load would fill a copy of it)
    if keys:  # values read with weights_only=True (dcp_values)
        _load_state_dict(out, storage_reader=reader, planner=dcp_values.load_planner(rebuild=True, keys=set(keys)),
                         process_group=group, no_dist=no_dist)
    return out


def apply(state: dict, flat: dict, extras: dict) -> None:
    """Put what DCP loaded back into ``state``: models and optimizer from ``flat``, the rest from ``extras``."""
    import torch
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    model_key, optim_key = _roles(state)
    for key, value in list(state.items()):
        if key == optim_key:
            continue
        if key == model_key:
            set_state_dict(value, [state[optim_key]], model_state_dict=flat[key], optim_state_dict=flat[optim_key])
        elif isinstance(value, torch.nn.Module):
            set_model_state_dict(value, flat[key])
        elif _stateful(value):
            value.load_state_dict(decode_keys(extras[key]))
        else:
            state[key] = decode_keys(extras[key])


def _stateful(value) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _summary(flat: dict) -> dict[str, tuple]:
    """{flattened key: (kind, global shape, dtype)} of a DCP state dict."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    flattened, _ = flatten_state_dict(flat)
    out = {}
    for key, value in flattened.items():
        if isinstance(value, DTensor):
            out[key] = ("sharded (DTensor)", tuple(value.shape), str(value.dtype))
        elif isinstance(value, torch.Tensor):
            out[key] = ("plain tensor", tuple(value.shape), str(value.dtype))
        else:
            out[key] = ("value", (), type(value).__name__)
    return out


def check_agreement(flat: dict, group) -> None:
    """Raise ValueError (on every rank) unless every rank has the same keys, kinds and global shapes.

    DCP writes one copy of a plain tensor, and a key one rank has as a DTensor and another as a
    plain tensor (a model sharded on some ranks only) cannot be saved; the message names the key.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    mine = _summary(flat)
    digest = hashlib.sha1(repr(sorted(mine.items())).encode()).hexdigest()
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return
    summaries: list = [None] * len(digests)
    dist.all_gather_object(summaries, mine, group=group)
    keys: set = set().union(*summaries)
    for key in sorted(keys):
        seen = [s.get(key) for s in summaries]
        if len(set(seen)) > 1:
            detail = "; ".join(f"rank {r}: {_show(v)}" for r, v in enumerate(seen))
            raise ValueError(f"the ranks disagree on {key!r} of the state to save ({detail}): DCP cannot save a state "
                             "that is sharded on some ranks and not on others, or whose keys differ by rank. Call "
                             "fully_shard on every rank alike (dask_ddp.shard_model), give every rank the same "
                             "keys, and keep per-rank values out of save_sharded (save_checkpoint(all_ranks=True))")


def _show(entry) -> str:
    return "missing" if entry is None else f"{entry[0]} of shape {list(entry[1])}, {entry[2]}"


def check_against(flat: dict, extras: list[str], metadata, url: str) -> None:
    """Raise CheckpointError naming missing and unexpected keys and differing shapes between ``flat`` (and the
    top-level ``extras``) and the checkpoint's metadata (unexpected: keys under a model of ``flat`` that the
    model does not have)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    mine, saved = _summary(flat), metadata.state_dict_metadata
    tops = {str((metadata.planner_data or {}).get(k, (k,))[0]) for k in saved}
    missing = sorted([k for k in mine if k not in saved] + [k for k in extras if k not in tops])
    prefixes = tuple(f"{k}." for k, v in flat.items() if isinstance(v, dict))
    unexpected = sorted(k for k in saved if k not in mine and k.startswith(prefixes) and ".state." not in k)
    shapes = sorted(f"{k}: checkpoint {list(saved[k].size)}, here {list(v[1])}" for k, v in mine.items()
                    if isinstance(saved.get(k), TensorStorageMetadata) and tuple(saved[k].size) != v[1])
    if missing or unexpected or shapes:
        parts = [f"{what} ({len(keys)}): {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}"
                 for what, keys in (("missing from the checkpoint", missing), ("in the checkpoint only", unexpected),
                                    ("shapes differ", shapes)) if keys]
        raise CheckpointError(f"{url} was saved from another model or state: {'; '.join(parts)}. Load it into the "
                              "model it was made with, or load another directory=/step=", url=url)


def run_dcp(fn, doing: str, step: int):
    """``fn()``; a DCP ``CheckpointException`` becomes the first failing rank's own error (others in a note)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return fn()
    except CheckpointException as exc:
        failures = sorted(exc.failures.items())
        rank, (first, _) = failures[0]
        if not isinstance(first, Exception):
            first = RuntimeError(f"rank {rank}: {type(first).__name__}: {first}")
        if f"rank {rank}" not in str(first):
            first.add_note(f"(on rank {rank})")
        if len(failures) > 1:
            first.add_note(f"{doing} step {step} failed on ranks {[r for r, _ in failures]}; this is rank {rank}'s "
                           "error")
        raise first from None


def on_rank_zero(fn, group):
    """``fn()`` on rank 0, its value broadcast to every rank; an exception it returns or raises is raised on all."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        value = _call(fn)
    else:
        box = [_call(fn) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        value = box[0]
    if isinstance(value, BaseException):
        raise value
    return value


def _call(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - handed to every rank, raised there
        return exc

"""Sharded checkpoints: ``save_sharded`` / ``load_sharded`` over torch DCP, for FSDP2 and DDP models alike.

Runs in: the rank process (every rank calls both; outside a job, one process counts as rank 0 of 1).

``state`` is a dict. Its values may be:

- a model (``nn.Module``: plain, DDP, or FSDP2 ``fully_shard``-ed), saved with
  ``get_model_state_dict`` (so DDP's ``module.`` prefix is gone and one format
  serves DDP and FSDP2, at any number of ranks);
- at most one optimizer (``torch.optim.Optimizer``) of the dict's one model,
  saved with ``get_optimizer_state_dict`` (keyed by parameter names);
- anything with ``state_dict()``/``load_state_dict()`` (a scheduler, your own
  class: DCP's ``Stateful``);
- plain values: tensors, numbers, strings, lists, dicts. A plain tensor is taken
  to be the same on every rank (DCP keeps one copy); different per rank, put it
  in a DTensor, or save it with ``save_checkpoint(..., all_ranks=True)``.

``load_sharded`` loads into the same dict in place: models and optimizers with
``set_state_dict``, Statefuls with ``load_state_dict``, plain values replaced in
the dict. The saved state is resharded onto however many ranks load it, and
onto DDP or FSDP2 whichever saved it. The storage, commit and folder layout
are described in :mod:`.writer` and :mod:`.folder`;
async saves in :mod:`.background`.
"""

from __future__ import annotations

import contextlib
import time
import warnings

from dask_ddp.checkpoint import folder, riders, stalls
from dask_ddp.checkpoint.sharded import background as sharded_async
from dask_ddp.checkpoint.sharded import folder as sharded_folder
from dask_ddp.checkpoint.sharded import reader as dcp_reader
from dask_ddp.checkpoint.sharded import state as sharded_state
from dask_ddp.checkpoint.sharded import writer as dcp_storage

__all__ = ["save_sharded", "load_sharded", "list_sharded", "wait_sharded"]


def save_sharded(state: dict, step: int, *, directory: str | None = None, keep: int | None = None,
                 async_save: bool = False, storage_options: dict | None = None) -> str | None:
    """Save ``state`` (see the module's docs) as sharded checkpoint ``step``; every rank calls it.

    Each rank writes only its own shards (replicated tensors are written once,
    spread over the ranks); the step becomes visible atomically, once every
    rank's files are on the store and verified (see ``dask_ddp/checkpoint/sharded/folder.py``).

    Parameters
    ----------
    state : dict of models, one optimizer, Statefuls and plain values.
    step : int >= 0, not committed before in this folder.
    directory : fsspec URL; default inside a job: its folder ``<checkpoint_dir>/<run_id>``
        (the sharded steps go to ``sharded/`` in it).
    keep : after the commit, remove committed steps older than the newest ``keep`` (never
        the one just written, never one a reader holds a lease on); None keeps all.
    async_save : return once the state is copied to host memory (reused buffers); upload in the
        background. At most one save is in flight: the next call waits for it first. Its failure
        is raised by the next ``save_sharded``, ``load_sharded``, :func:`wait_sharded` or ``report()``.
    storage_options : fsspec options; default: the job's ``checkpoint_options``.

    Returns
    -------
    str or None
        The committed step's URL; None when ``async_save`` (see :func:`wait_sharded`).

    Raises
    ------
    TypeError, ValueError
        Bad ``state`` (e.g. ranks disagree on its keys or on which tensors are sharded: named), ``step``, ``keep``.
    FileExistsError
        ``step`` is committed already in this folder (on every rank).
    PermissionError, FileNotFoundError
        The workers cannot write the URL (named; no secret in the text).
    ShardError
        An upload failed, stalled past ``ddp.checkpoint.upload-timeout`` or lost bytes; names rank and key.
        The step is not committed; the previous one stays the latest. The same for an earlier async save.
    """
    folder.check_int("step", step, 0)
    if keep is not None:
        folder.check_int("keep", keep, 1)
    if not isinstance(state, dict):
        raise TypeError(f"save_sharded(state=...) takes a dict of models, an optimizer and values, got "
                        f"{type(state).__name__}")
    waited = sharded_async.wait_previous()
    where = folder.where(directory, storage_options)
    started = time.perf_counter()
    flat = sharded_state.to_save(riders.with_riders(state))  # what rides in every save (streaming positions)
    sharded_state.check_agreement(flat, sharded_async.control_group())
    if async_save:
        staged = sharded_async.stage(flat)
        stall = time.perf_counter() - started
        stalls.count(stall + waited)  # the training thread's part, for the rank's goodput
        sharded_async.submit(lambda: _write(where, staged, step, keep, sharded_async.control_group()),
                             step=step, stall=stall, waited=waited)
        return None
    writer = _write(where, flat, step, keep, None)
    stall = time.perf_counter() - started
    stalls.count(stall + waited)
    sharded_async.record(step, writer, stall=stall, waited=waited, background=False)
    return f"{sharded_folder.base(where)[1]}/{writer.folder}"


def _write(where, flat: dict, step: int, keep: int | None, group) -> dcp_storage.ShardWriter:
    import torch.distributed.checkpoint as dcp

    world = _world(group)
    writer = dcp_storage.ShardWriter(
        where.fs, f"{where.root}/{sharded_folder.SUBFOLDER}", sharded_folder.base(where)[1], step, where.rank,
        commit=lambda folder, md, files: sharded_folder.commit(where, step, folder, md, files, world),
        check_step=lambda: _check_new(where, step), timeout=sharded_async.upload_timeout(),
        options=where.options, **_io_settings())
    with _quiet():
        sharded_state.run_dcp(lambda: dcp.save(flat, storage_writer=writer, process_group=group, no_dist=world == 1),
                              "saving", step)
    if keep is not None and where.rank == 0:
        sharded_folder.prune(where, keep, step)
    return writer


def _io_settings() -> dict:
    """``ddp.checkpoint.{threads,part-size,max-file-bytes}`` as ShardWriter arguments."""
    import dask.config

    get = dask.config.get
    return {"threads": int(get("ddp.checkpoint.threads", 4)), "block_size": int(get("ddp.checkpoint.part-size",
                                                                                    32 << 20)),
            "max_file_bytes": int(get("ddp.checkpoint.max-file-bytes", 64 << 20))}


def _world(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _check_new(where, step: int) -> None:
    found = sharded_folder.committed(where)
    if step in found:
        raise FileExistsError(f"step {step} is committed already in {sharded_folder.base(where)[1]} "
                              f"({found[step].folder}): save under a new step, or load it with load_sharded(step=...)")


def load_sharded(state: dict, *, directory: str | None = None, step: int | None = None,
                 storage_options: dict | None = None) -> int | None:
    """Load the newest committed sharded step (or ``step``) into ``state`` in place; return its step, or None.

    Every rank calls it (it is collective). The state is resharded onto this
    job's ranks whatever their number, and DDP and FSDP2 read each other's
    steps. None (state untouched) when the folder has no committed step.
    Arguments as in :func:`save_sharded`.

    Values that are not tensors are unpickled with ``weights_only=True`` only: a checkpoint cannot run code
    in the ranks that load it, whoever wrote the folder. Without ``step``, a committed step whose commit
    marker or ``.metadata`` does not check out (forged, or its folder deleted) is skipped with a warning
    naming it and why, and the newest one that does is loaded.

    Raises
    ------
    FileNotFoundError
        ``step`` is not committed there (the message lists those that are).
    CheckpointError
        The checkpoint was made with another model: missing or unexpected keys, or shapes that
        differ (each named); or ``step``'s marker or metadata does not check out.
    ShardError
        A shard is missing or fails its CRC-32 check, or an item holds objects that ``weights_only=True``
        refuses (nothing of it ran); names the rank, the URL, the key and what to do.
    PermissionError, NotInRankError, TypeError, ValueError
        As in :func:`save_sharded`.
    """
    if step is not None:
        folder.check_int("step", step, 0)
    if not isinstance(state, dict):
        raise TypeError(f"load_sharded(state=...) takes the dict given to save_sharded, got {type(state).__name__}")
    sharded_async.wait_previous()
    where = folder.where(directory, storage_options)
    group = sharded_async.control_group()
    with contextlib.ExitStack() as leases:  # rank 0's reader's lease on the step, while every rank reads it
        chosen = sharded_state.on_rank_zero(lambda: sharded_folder.choose(where, step, leases), group)
        if chosen is None:
            return None
        found, metadata = chosen
        _rider_slots(state, metadata)
        flat, extras = sharded_state.to_load(state)
        sharded_state.check_against(flat, extras, metadata, found.url)
        reader = dcp_reader.ShardReader(where.fs, f"{sharded_folder.base(where)[0]}/{found.folder}", found.url,
                                        metadata, rank=where.rank, options=where.options,
                                        threads=_io_settings()["threads"])
        no_dist = _world(group) == 1
        with _quiet():
            if flat:
                sharded_state.run_dcp(lambda: sharded_state.load_main(flat, reader, group, no_dist), "loading",
                                      found.step)
            loaded = sharded_state.run_dcp(lambda: sharded_state.load_extras(extras, reader, group, no_dist),
                                           "loading", found.step)
    sharded_state.apply(state, flat, loaded)
    riders.take(state)
    return found.step


def _rider_slots(state: dict, metadata) -> None:
    """Before a load: an empty slot in ``state`` for each rider's key the checkpoint (its DCP metadata) has."""
    tops = {str((metadata.planner_data or {}).get(k, (k,))[0]) for k in metadata.state_dict_metadata}
    for key in riders.reserved_keys(tops):
        state.setdefault(key, {})


@contextlib.contextmanager
def _quiet():
    """Silence DCP's warning that a single process saves or loads without a process group (that is the intent)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def list_sharded(directory: str | None = None, *, storage_options: dict | None = None) -> list:
    """Return the committed sharded steps of ``directory`` (inside a job: its folder), oldest first.

    Each is a ``Step(step, folder, url)``. Errors as in :func:`save_sharded`.
    """
    return list(sharded_folder.committed(folder.where(directory, storage_options)).values())


def wait_sharded() -> None:
    """Wait for this rank's async save in flight, if any; raise its failure (ShardError naming rank and key)."""
    sharded_async.wait_previous()

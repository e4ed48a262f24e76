"""Checkpoints on any fsspec URL (a local path, ``file://``, ``s3://``, ``memory://``, ...).

Runs in: the rank process (and the client, given ``directory=``).

Each job writes to a folder of its own, ``<checkpoint_dir>/<run_id>/`` (the
run id is the job's name made safe plus 8 random hex digits, see ``Job.run_id``
and ``Job.checkpoint_dir``), so two jobs given the same ``checkpoint_dir``
never read, count or prune each other's files, while the restarts of one job
(same run id) resume from its own. To resume a *previous* job, pass its folder
explicitly: ``load_checkpoint(directory=old_job.checkpoint_dir)`` (or
``f"{checkpoint_dir}/{run_id}"``). An explicit ``directory=`` is always used as
given, inside a job or not. A checkpoint folder is flat::

    step-000000100.pt                     payload: torch.save of the state, written in one piece
    step-000000100.done                   commit marker (small JSON), written after the payload
    step-000000100.rank-00001-of-00004.pt / .done      the same, per rank, with all_ranks=True

A checkpoint counts only once its marker exists (with ``all_ranks=True``: once
the markers of all its ranks exist), so a reader never sees half of one. On S3
there is no rename, but an object appears whole when its PUT (or multipart
upload) completes; on local disk each file goes to a temporary name in the same
folder, is fsynced and ``os.replace``-d. A crash before the marker leaves the
previous checkpoint the latest. Steps are zero-padded for people and parsed,
never string-sorted, by the code.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import random
import re
import time
from typing import Any, NamedTuple, Sequence

from dask_ddp.checkpoint import folder, riders, stalls
from dask_ddp.checkpoint.folder import Where, call, check_int, put
from dask_ddp.wire.errors import DaskDDPError

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints",
           "rng_state", "set_rng_state", "Checkpoint", "CheckpointError"]

# groups: step, rank, world size, kind, and a ".PID-RANDOM.tmp" suffix that (with a leading
# dot) marks a local temporary file
_NAME = re.compile(r"^(?:\.(?=.*\.tmp$))?step-(\d+)(?:\.rank-(\d+)-of-(\d+))?\.(pt|done)"
                   r"(\.\d+-[0-9a-f]{8}\.tmp)?$")


class CheckpointError(DaskDDPError, ValueError):
    """A checkpoint cannot be loaded: corrupt, or refused by ``weights_only`` (see ``unsafe_globals``)."""

    def __init__(self, message: str, *, url: str = "", unsafe_globals: Sequence[str] = (), **kw: Any) -> None:
        super().__init__(message, **kw)
        self.url = url
        self.unsafe_globals = list(unsafe_globals)


class Checkpoint(NamedTuple):
    """A complete checkpoint: its step and the URL of its payload."""
    step: int
    url: str


def _name(step: int, rank: int | None, world_size: int | None, kind: str) -> str:
    who = "" if rank is None else f".rank-{rank:05d}-of-{world_size:05d}"
    return f"step-{step:09d}{who}.{kind}"


def _names(where: Where) -> list[str]:
    def ls():
        where.fs.invalidate_cache(where.root)  # s3fs caches listings; other writers change them
        try:
            return where.fs.ls(where.root, detail=False)
        except FileNotFoundError:
            return []

    return [str(e).rstrip("/").rsplit("/", 1)[-1] for e in call(where, ls, doing="listing it")]


def _complete(names: list[str], all_ranks: bool) -> dict[int, int | None]:
    """Map each complete step to its world size (None for shared checkpoints)."""
    seen: dict[tuple, set[int]] = {}
    for m in map(_NAME.match, names):
        if m and m[4] == "done" and not m[5] and (m[2] is not None) == all_ranks:
            seen.setdefault((int(m[1]), int(m[3]) if all_ranks else None), set()).add(int(m[2] or 0))
    return {step: world for (step, world), ranks in sorted(seen.items())
            if world is None or ranks == set(range(world))}


def _prune(where: Where, keep: int, all_ranks: bool, written: int) -> None:
    names = _names(where)
    steps = sorted(_complete(names, all_ranks))
    if len(steps) < keep:
        return
    # everything older than the keep-th newest complete step goes, crash leftovers included, but never the
    # step just written (older than the others when saved out of order, or after an attempt that got further);
    # with all_ranks each rank removes only its own files, so it lags the others by a step
    cutoff = steps[-keep]
    mine = [n for n in names if (m := _NAME.match(n)) and int(m[1]) < cutoff and int(m[1]) != written
            and (m[2] is not None) == all_ranks and (not all_ranks or int(m[2]) == where.rank)]
    for markers in (True, False):  # markers first: a step stops counting before its payload goes
        doomed = [where.path(n) for n in mine if n.endswith(".done") == markers]
        with contextlib.suppress(FileNotFoundError):
            if doomed:
                call(where, lambda: where.fs.rm(doomed), doing="deleting old checkpoints in it")


def save_checkpoint(state: dict, step: int, *, directory: str | None = None, keep: int | None = None,
                    all_ranks: bool = False, storage_options: dict | None = None) -> str | None:
    """Write ``state`` as the checkpoint of ``step``, atomically; return its URL.

    Only rank 0 writes (other ranks return None at once, without a barrier,
    so call it on every rank or on rank 0 alone) unless ``all_ranks=True``:
    then each rank writes its own file and a step counts once all have. The
    state goes through ``torch.save`` in memory, is written in one piece and
    committed by a ``.done`` marker. Keep it loadable with ``weights_only=True``:
    state_dicts, tensors, numbers, strings, lists, dicts, :func:`rng_state`.

    Parameters
    ----------
    state : dict to save, e.g. ``{"model": m.state_dict(), "optim": o.state_dict(), "epoch": 3}``.
    step : int >= 0; a step saved again replaces the earlier one.
    directory : fsspec URL, used as given; defaults inside a rank to this job's
        folder ``<checkpoint_dir>/<run_id>`` (see the module's docs). Outside a
        rank the caller counts as rank 0 of 1.
    keep : after a successful write, delete the complete checkpoints of this
        folder older than the newest ``keep`` (and older leftovers of crashed
        writes), never the one just written (even when newer steps exist, e.g.
        from an attempt that got further); None keeps all.
    all_ranks : one file per rank, named ``...rank-RRRRR-of-WWWWW.pt``.
    storage_options : fsspec options (s3: ``key``, ``secret``, ``client_kwargs``);
        default: the job's ``checkpoint_options`` inside a rank, else none.

    Raises
    ------
    TypeError, ValueError
        Bad ``state``, ``step`` or ``keep``; ValueError also inside a rank with no directory known.
    NotInRankError
        Outside a rank without ``directory``.
    PermissionError
        Missing or refused credentials (the message names the URL); FileNotFoundError: no bucket.
    """
    if not isinstance(state, dict):
        raise TypeError(f"save_checkpoint(state=...) takes a dict, got {type(state).__name__}")
    check_int("step", step, 0)
    if keep is not None:
        check_int("keep", keep, 1)
    started = time.perf_counter()
    try:
        where = folder.where(directory, storage_options)
        return _save(where, state, step, keep, all_ranks) if all_ranks or where.rank == 0 else None
    finally:
        stalls.count(time.perf_counter() - started)  # the training thread waited: the rank's goodput counts it


def _save(where: Where, state: dict, step: int, keep: int | None, all_ranks: bool) -> str:
    """Write ``state`` and its marker, prune; the URL written (see :func:`save_checkpoint`)."""
    import torch

    torch.save(riders.with_riders(state), buffer := io.BytesIO())  # may raise half-way: nothing written
    data = buffer.getvalue()
    rank, world = (where.rank, where.world_size) if all_ranks else (None, None)
    payload = _name(step, rank, world, "pt")
    put(where, payload, data)
    marker = {"format": 1, "step": step, "file": payload, "bytes": len(data), "rank": rank,
              "world_size": world, "run_id": where.run_id, "time": time.time()}  # no storage options here
    put(where, _name(step, rank, world, "done"), json.dumps(marker).encode())
    if keep is not None:
        _prune(where, keep, all_ranks, step)
    return where.url_of(payload)


def _entries(where: Where, all_ranks: bool) -> list[tuple[int, str]]:
    complete = _complete(_names(where), all_ranks)
    rank = where.rank if all_ranks else None
    return [(step, _name(step, rank, world, "pt")) for step, world in sorted(complete.items())
            if world is None or rank is None or rank < world]


def list_checkpoints(directory: str | None = None, *, all_ranks: bool = False,
                     storage_options: dict | None = None) -> list[Checkpoint]:
    """Return the complete checkpoints in ``directory`` (inside a rank: this job's folder), oldest first.

    Empty if none or no folder. With ``all_ranks=True``, the URLs are this rank's files of
    the steps every rank completed.
    Arguments and errors as in :func:`save_checkpoint`.
    """
    where = folder.where(directory, storage_options)
    return [Checkpoint(step, where.url_of(name)) for step, name in _entries(where, all_ranks)]


def latest_checkpoint(directory: str | None = None, *, all_ranks: bool = False,
                      storage_options: dict | None = None) -> str | None:
    """Return the URL of the newest complete checkpoint, or None. Errors as in :func:`save_checkpoint`."""
    found = list_checkpoints(directory, all_ranks=all_ranks, storage_options=storage_options)
    return found[-1].url if found else None


def load_checkpoint(directory: str | None = None, *, step: int | None = None, map_location: Any = "cpu",
                    weights_only: bool = True, all_ranks: bool = False,
                    storage_options: dict | None = None) -> dict | None:
    """Load the newest complete checkpoint (or the one of ``step``); None when there is none.

    Inside a rank, without ``directory``, it reads this job's folder: a restart
    resumes from what this job saved. To resume another (earlier) job, pass its
    folder: ``directory=old_job.checkpoint_dir``. Every rank may call it.
    ``weights_only=True``, torch's safe loader, is the default; ``weights_only=False``
    unpickles anything, which can run code: only for files you trust.
    ``all_ranks=True`` loads this rank's own file. Other arguments as in :func:`save_checkpoint`.

    Raises
    ------
    FileNotFoundError
        ``step`` was given and has no complete checkpoint (the message lists those there are).
    CheckpointError
        Corrupt or truncated, or holds types ``weights_only=True`` refuses (named in the message).
    PermissionError, NotInRankError, ValueError
        As in :func:`save_checkpoint`.
    """
    if step is not None:
        check_int("step", step, 0)
    where = folder.where(directory, storage_options)
    for attempt in range(3):
        entries = dict(_entries(where, all_ranks))
        if step is not None and step not in entries:
            raise FileNotFoundError(f"no complete checkpoint of step {step} in {where.url}; "
                                    f"complete steps: {sorted(entries) or 'none'}")
        if not entries:
            return None
        name = entries[step if step is not None else max(entries)]
        try:
            data = call(where, lambda: where.fs.cat_file(where.path(name)), name)  # one big object: s3fs's ranged GETs
        except FileNotFoundError:
            if attempt == 2:
                raise FileNotFoundError(f"{where.url_of(name)} is missing although its .done marker "
                                        "exists: delete the marker, or load another step=...") from None
            continue  # pruned by a writer between listing and reading: list again
        return riders.take(_deserialize(data, where.url_of(name), map_location, weights_only))
    return None  # not reached: the third miss raises above


def _deserialize(data: bytes, url: str, map_location, weights_only: bool) -> dict:
    import torch

    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
    except Exception as exc:
        unsafe = _unsafe_globals(data) if weights_only and isinstance(exc, pickle.UnpicklingError) else []
        if unsafe:
            raise CheckpointError(
                f"checkpoint {url} holds objects that weights_only=True refuses to load: "
                f"{', '.join(unsafe)}. Save plain state instead (state_dict(), tensors, numbers, lists, "
                "dicts; rng_state() for RNG states), allow these types with "
                "torch.serialization.add_safe_globals([...]), or, only for files you trust, pass "
                "weights_only=False: an explicit opt-out, since unpickling can run arbitrary code",
                url=url, unsafe_globals=unsafe) from exc
        raise CheckpointError(
            f"cannot load checkpoint {url} ({len(data)} bytes): {type(exc).__name__}: {exc}. If it is "
            "corrupt or truncated, delete it and its .done marker (the previous checkpoint becomes the "
            "latest) or load an earlier one with step=...", url=url) from exc


def _unsafe_globals(data: bytes) -> list[str]:
    from torch.serialization import get_unsafe_globals_in_checkpoint

    with contextlib.suppress(Exception):  # unreadable: reported as corrupt instead
        return list(get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
    return []


def rng_state() -> dict:
    """Return Python's, NumPy's (legacy global) and torch's RNG states (and CUDA's, once initialised).

    It holds only tensors, numbers, strings and lists, so ``weights_only=True`` loads it back.
    Restore it with :func:`set_rng_state`.
    """
    import torch

    version, internal, gauss = random.getstate()  # tuples of ints: kept as lists for weights_only
    state = {"python": {"version": version, "state": list(internal), "gauss": gauss},
             "torch": torch.get_rng_state()}
    with contextlib.suppress(ImportError):
        import numpy as np

        kind, key, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached": float(cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's, i.e. this rank's GPU
    return state


def set_rng_state(state: dict) -> None:
    """Restore RNG states made by :func:`rng_state`; raise TypeError for anything else."""
    import torch

    if not isinstance(state, dict) or not {"python", "torch"} <= state.keys():
        raise TypeError("set_rng_state takes the dict made by dask_ddp.checkpoint.rng_state()")
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    torch.set_rng_state(state["torch"].cpu())  # .cpu(): it may have been loaded with map_location
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["kind"], n["key"].cpu().numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())

"""``StreamingLoader``: whole batches of a :class:`StreamingDataset` in the epoch's global order, resumable.

Runs in: the rank process (the loader) and its DataLoader workers (:class:`_EpochStream`).

A DataLoader prefetches, so a dataset cannot know what the training loop consumed: the loader counts the
batches it hands out. Its position is ``(epoch, cursor)``, the cursor being the samples of the epoch's global
order consumed by every rank together, the same number on every rank. ``state_dict()`` /
``load_state_dict()`` work as torchdata's ``StatefulDataLoader``'s do; inside dask-ddp, checkpoints carry them
without the user's help (:mod:`.state`). DataLoader worker ``w`` of ``W`` builds steps ``w, w+W, ...``
and torch returns them in step order, so ``num_workers`` changes nothing but speed.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import numpy as np
import torch.utils.data

from dask_ddp.data.streaming import state as stream_state
from dask_ddp.data.streaming.format import ShardDataError
from dask_ddp.data.streaming.order import Plan, epoch_order

__all__ = ["StreamingLoader"]


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class _EpochStream(torch.utils.data.IterableDataset):
    """One rank's steps of one epoch from a cursor: yields ``(batch, keys, real, skipped, step)`` per step."""

    def __init__(self, dataset: Any, plan: Plan, epoch: int, collate: Callable) -> None:
        self.dataset, self.plan, self.epoch, self.collate = dataset, plan, epoch, collate

    def __iter__(self) -> Iterator[tuple]:
        info = torch.utils.data.get_worker_info()
        w, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        ds, plan = self.dataset, self.plan
        order = epoch_order(ds.shard_sizes, ds.seed, self.epoch, ds.shuffle, ds.buffer)
        steps = list(range(w, plan.steps, n_workers))
        picks = [(s, *plan.positions(s)) for s in steps]
        ids = [order[pos] for _, pos, _ in picks]
        shard_seq = _first_uses(np.concatenate(ids) if ids else np.zeros(0, np.int64), ds.index.shard)
        fetcher, ahead, shard_of, keys = ds.fetcher, max(1, ds.ahead), ds.columns["shard"], ds.index.keys
        try:
            seen = 0
            for (step, _, real), sample_ids in zip(picks, ids):
                need = list(dict.fromkeys(shard_of[i] for i in sample_ids.tolist()))
                while seen < len(shard_seq) and shard_seq[seen] in need:
                    seen += 1
                fetcher.prefetch(need + shard_seq[seen:seen + ahead])
                blobs = {j: fetcher.get(j) for j in need}
                items = ds.load_many(sample_ids.tolist(), blobs)
                kept = [(it, keys[i], k < real) for k, (it, i) in enumerate(zip(items, sample_ids.tolist()))
                        if it is not None]
                if not kept:
                    raise ShardDataError(f"every sample of step {step} on rank {plan.rank} failed to decode and was "
                                         f"skipped ({[keys[i] for i in sample_ids.tolist()][:4]}...): check the shards "
                                         "and the decoder")
                batch = self.collate([it for it, _, _ in kept])
                yield batch, [k for _, k, _ in kept], sum(r for _, _, r in kept), len(items) - len(kept), step
        finally:
            if info is not None:
                fetcher.close()


def _first_uses(ids: np.ndarray, shard_of: np.ndarray) -> list[int]:
    """The distinct shards of ``ids`` in order of first use."""
    if not len(ids):
        return []
    shards = shard_of[ids]
    _, first = np.unique(shards, return_index=True)
    return [int(shards[i]) for i in sorted(first)]


class StreamingLoader:
    """Batches of ``batch_size`` samples of ``dataset`` for this rank; every rank gets the same number of batches.

    Parameters
    ----------
    dataset : a :class:`~dask_ddp.data.StreamingDataset`.
    batch_size : samples per batch on each rank (a step consumes ``batch_size * world_size`` of the order).
    num_workers : DataLoader worker processes (0: in this process); changing it changes no sample's place.
    policy : ``"drop_last"`` (the epoch's tail shorter than a global batch is left out, counted in
        ``dropped``) or ``"pad"`` (filled from the start of the order; ``batch_real`` says how many are real).
    collate_fn : builds a batch from ``(sample, class)`` pairs; default torch's ``default_collate``.
    rank, world_size : default: torch.distributed's, else ``RANK``/``WORLD_SIZE``, else 0 of 1.
    name : the key its position is saved under in checkpoints (default ``"stream"``: one loader; give each
        loader of a job its own name).
    dataloader_kwargs : passed to torch's DataLoader (``pin_memory``, ``prefetch_factor``,
        ``multiprocessing_context``, ...).

    After each batch, ``batch_keys`` (its samples' keys on this rank), ``batch_real`` (how many are not
    padding) and ``step`` (the step in the epoch) describe it; ``skipped`` counts samples skipped for decode errors.

    Raises
    ------
    ValueError
        A bad ``batch_size``, ``policy``, ``rank``/``world_size``; a state of another dataset in ``load_state_dict``.
    """

    def __init__(self, dataset: Any, batch_size: int, *, num_workers: int = 0, policy: str = "drop_last",
                 collate_fn: Callable | None = None, rank: int | None = None, world_size: int | None = None,
                 name: str = "stream", **dataloader_kwargs: Any) -> None:
        if dataloader_kwargs.get("in_order", True) is not True:
            raise ValueError("StreamingLoader counts the batches it hands out in step order: in_order=False would "
                             "lose that count; leave in_order out")
        r, w = _world()
        self.dataset, self.batch_size, self.num_workers, self.policy = dataset, int(batch_size), num_workers, policy
        self.rank, self.world_size = (r if rank is None else rank), (w if world_size is None else world_size)
        self.collate_fn = collate_fn or torch.utils.data.default_collate
        self.name, self.dataloader_kwargs = name, dataloader_kwargs
        self.epoch, self.cursor, self.skipped = 0, 0, 0
        self.batch_keys: list[str] = []
        self.batch_real, self.step = 0, -1
        self._plan()  # validates
        stream_state.register(self)

    def _plan(self) -> Plan:
        return Plan(len(self.dataset), self.cursor, self.batch_size, self.world_size, self.rank, self.policy)

    def __len__(self) -> int:
        """Batches left in the current epoch on this rank (the same on every rank)."""
        return self._plan().steps

    @property
    def dropped(self) -> int:
        """Samples the current epoch's tail leaves out from the cursor on (``drop_last``)."""
        return self._plan().dropped

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch``; the current epoch keeps its position (a resumed loop may call it)."""
        if epoch != self.epoch:
            self.epoch, self.cursor = int(epoch), 0

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch's batches; after its last one the loader is at the next epoch's start."""
        plan, epoch = self._plan(), self.epoch
        if plan.steps == 0:
            self._next_epoch()
            plan, epoch = self._plan(), self.epoch
        stream = _EpochStream(self.dataset, plan, epoch, self.collate_fn)
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=self.num_workers,
                                             **self.dataloader_kwargs)
        for batch, keys, real, skipped, step in loader:
            self.cursor, self.step = plan.cursor_after(step), step
            self.batch_keys, self.batch_real, self.skipped = keys, real, self.skipped + skipped
            if step == plan.steps - 1:
                self._next_epoch()
            yield batch

    def _next_epoch(self) -> None:
        self.epoch, self.cursor = self.epoch + 1, 0

    def state_dict(self) -> dict:
        """``{"epoch", "cursor", "seed", "fingerprint", "samples", "skipped"}``: plain ints and strings."""
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.dataset.seed,
                "fingerprint": self.dataset.fingerprint, "samples": len(self.dataset), "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (any world size, any ``num_workers``).

        Raises ValueError when it was saved for another dataset (fingerprint) or seed, naming both.
        """
        if state.get("fingerprint") != self.dataset.fingerprint or state.get("seed") != self.dataset.seed:
            raise ValueError(f"loader {self.name!r}: the saved position belongs to dataset {state.get('fingerprint')} "
                             f"with seed {state.get('seed')}, this one is {self.dataset.fingerprint} with seed "
                             f"{self.dataset.seed} ({self.dataset.url}): load it into a loader over the same shards "
                             "and seed, or start the epoch afresh")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.skipped = int(state.get("skipped", 0))

    def __repr__(self) -> str:
        return (f"StreamingLoader({self.dataset!r}, batch_size={self.batch_size}, rank={self.rank} of "
                f"{self.world_size}, epoch={self.epoch}, cursor={self.cursor})")

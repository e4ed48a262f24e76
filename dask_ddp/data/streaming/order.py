"""The global order of an epoch and each rank's part of each step: pure functions, no I/O.

Runs in: the rank process and its DataLoader workers (and tests, with no cluster).

The order of epoch ``e`` is a function of ``(seed, e, the index)`` only, never of the world size or the
number of DataLoader workers: the shards are permuted, then the samples, taken shard after shard, are
shuffled inside consecutive windows of ``buffer`` samples (a bounded in-buffer shuffle: a window spans a
few shards, so a reader holds only those). Progress in an epoch is a cursor into that order (samples
consumed). A step consumes the next ``batch_size * world_size`` samples and rank ``r`` takes the ``r``-th
contiguous ``batch_size`` of them; after a resume at any world size the rest of the order is split the same
way, so no divisibility rule exists. The tail shorter than a global batch is dropped (``"drop_last"``) or
filled from the start of the order (``"pad"``, the padding flagged).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["epoch_order", "Plan", "POLICIES"]

POLICIES = ("drop_last", "pad")


def epoch_order(sizes: np.ndarray, seed: int, epoch: int, shuffle: bool = True, buffer: int = 4096) -> np.ndarray:
    """The sample ids of epoch ``epoch`` in order. ``sizes[j]`` is shard j's sample count (ids shard after shard).

    Raises ValueError for a negative seed or epoch, or ``buffer < 1``.
    """
    if seed < 0 or epoch < 0 or buffer < 1:
        raise ValueError(f"seed and epoch must be >= 0 and buffer >= 1, got {seed}, {epoch}, {buffer}")
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if len(sizes) else np.zeros(0, np.int64)
    if not shuffle:
        return np.arange(int(np.sum(sizes)), dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(len(sizes))
    order = np.concatenate([np.arange(starts[j], starts[j] + sizes[j], dtype=np.int64) for j in perm]) \
        if len(sizes) else np.zeros(0, np.int64)
    for lo in range(0, len(order), buffer):
        window = order[lo:lo + buffer]  # a view: shuffled in place
        rng.shuffle(window)
    return order


@dataclass(frozen=True)
class Plan:
    """One rank's steps of one epoch from ``cursor`` on, at ``world_size`` ranks of ``batch_size``.

    ``total`` is the epoch's sample count. ``steps`` is the same on every rank (no DDP hang).
    """

    total: int
    cursor: int
    batch_size: int
    world_size: int
    rank: int
    policy: str = "drop_last"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.batch_size < 1 or self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"bad batch_size={self.batch_size}, world_size={self.world_size}, rank={self.rank}")
        if not 0 <= self.cursor <= self.total:
            raise ValueError(f"cursor {self.cursor} is outside the epoch of {self.total} samples")

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def steps(self) -> int:
        """Steps left in the epoch (every rank the same)."""
        left = self.total - self.cursor
        if self.policy == "pad":
            return -(-left // self.global_batch)
        return left // self.global_batch

    @property
    def dropped(self) -> int:
        """Samples this epoch's tail leaves out under ``drop_last`` (0 under ``pad``)."""
        return 0 if self.policy == "pad" else (self.total - self.cursor) % self.global_batch

    def cursor_after(self, step: int) -> int:
        """The cursor once ``step`` (0-based, counted from this plan's start) is consumed on every rank."""
        return min(self.total, self.cursor + (step + 1) * self.global_batch)

    def positions(self, step: int) -> tuple[np.ndarray, int]:
        """Positions in the epoch's order of this rank's samples in ``step``, and how many are real (the rest pad)."""
        lo = self.cursor + step * self.global_batch + self.rank * self.batch_size
        pos = np.arange(lo, lo + self.batch_size, dtype=np.int64)
        real = int(np.clip(self.total - lo, 0, self.batch_size))
        if real < self.batch_size and self.total:
            pos[real:] = (pos[real:] - self.total) % self.total  # padding: from the start of the order
        return pos, real

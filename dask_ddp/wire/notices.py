"""Preemption as it crosses processes: the notice a rank gets, and the record of how its ranks stopped.

Runs in: every process: a leaving worker's supervisor makes a :class:`Notice`, the
rank process publishes it in the job's store (:meth:`Notice.to_json`) and answers
with a :class:`Stopped` at the end, which its supervisor puts in the rank's
outcome and the client's controller reads (:mod:`dask_ddp.client.elastic`). One
frozen type each, end to end: no string-keyed dicts.

What the store carries is signed (:class:`Seal`): anyone who can reach rank 0's store can list and write its
keys, so a rank acts only on values made with its attempt's key, and tells the job (:func:`forged_item`, kept in
``job.history`` by :func:`forged_note`) of each one it ignored.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from dataclasses import asdict, dataclass, replace

import dask

__all__ = ["Notice", "Stopped", "KINDS", "grace_period", "Seal", "forged_item", "forged_note", "FORGED_WHAT"]

KINDS = ("leave", "grow", "signal", "stop")


def grace_period() -> float:
    """``ddp.preemption.grace-period`` (seconds), as this process's config says: how long a leaving worker waits
    for its ranks' save, and what a rank process that receives SIGTERM gives the job."""
    return float(dask.config.get("ddp.preemption.grace-period", 25))


@dataclass(frozen=True)
class Notice:
    """Save and stop by ``deadline`` (``time.time()``): a worker of the job leaves, or the job grows.

    ``worker``: the address of the worker that leaves; ``kind``: ``leave`` (a worker leaves), ``grow`` (workers
    joined an elastic job), ``signal`` (a rank process received SIGTERM) or ``stop`` (``Job.stop()``: the job
    ends at the agreed step, no restart; a sweep's pruned trial)."""

    deadline: float
    cause: str
    worker: str = ""
    kind: str = "leave"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a preemption notice's kind is one of {KINDS}, got {self.kind!r}")

    def to_json(self) -> str:
        """The notice as the job's rendezvous store holds it."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Notice":
        """The notice :meth:`to_json` wrote.

        Raises
        ------
        ValueError
            ``text`` is not such a notice (bad JSON, a missing or unknown field, a kind not in :data:`KINDS`).
        """
        try:
            fields = json.loads(text)
            return cls(float(fields["deadline"]), str(fields["cause"]), str(fields.get("worker", "")),
                       str(fields.get("kind", "leave")))
        except (TypeError, KeyError, ValueError) as exc:  # JSONDecodeError is a ValueError
            raise ValueError(f"not a dask-ddp preemption notice: {text[:200]!r} ({exc!r})") from None


@dataclass(frozen=True)
class Stopped:
    """What a notice did to a rank: the notice, and (once its ranks stopped at the agreed step) how.

    Attributes
    ----------
    notice : the :class:`Notice` that reached the rank.
    step : the step every rank agreed to stop at; None when the ranks did not stop at one (the notice came,
        then the rank ended otherwise).
    saved : the rank's state was saved at ``step``.
    committed : every rank passed the commit barrier before the deadline.
    heard : when the notice reached the rank (``time.time()``).
    save_took : seconds from the agreed step to the end of the save.
    commit_time : when the commit barrier was passed (``time.time()``).
    phases : ``(phase, seconds after heard)`` pairs, for ``job.history`` and tests.
    """

    notice: Notice
    step: int | None = None
    saved: bool = False
    committed: bool = False
    heard: float = 0.0
    save_took: float = 0.0
    commit_time: float = 0.0
    phases: tuple[tuple[str, float], ...] = ()

    @property
    def safe(self) -> bool:
        """The job can resume from ``step`` without loss: saved there and committed by every rank."""
        return self.step is not None and self.saved and self.committed

    def heard_first(self, heard: float) -> "Stopped":
        """This record with ``heard`` (e.g. the earliest of several ranks')."""
        return replace(self, heard=heard)


class Seal:
    """Signs and checks the values of the preemption protocol that cross a job's rendezvous store.

    Anyone who can connect to rank 0's store can list its keys (torch's ``TCPStore.list_keys()`` shows the
    attempt's prefix) and write any of them. A value there is trusted only with an HMAC-SHA256 made with
    ``key``: the attempt's own random key, drawn by the client and given to the ranks inside their Dask task
    (:attr:`~dask_ddp.wire.task.RankTask.signing_key`), never written to the store. The MAC covers the name the
    value is stored under, so a genuine value copied under another name (another rank's) fails the check too.
    The key never appears in a repr.

    Raises
    ------
    ValueError
        ``key`` is shorter than 16 bytes.
    """

    MAX_VALUE = 65536  # characters: a longer value is no value of ours (and is not hashed)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) < 16:
            raise ValueError("a preemption Seal needs a key of at least 16 random bytes (RankTask.signing_key), "
                             f"got {len(key) if isinstance(key, bytes) else type(key).__name__}")
        self._key = key

    def __repr__(self) -> str:
        return "Seal(<key hidden>)"

    def sign(self, name: str, text: str) -> str:
        """``text`` with its MAC for the store name ``name``: what :meth:`open` takes back."""
        return f"{self._mac(name, text)} {text}"

    def open(self, name: str, value: bytes | str) -> str | None:
        """The text :meth:`sign` signed for ``name``, or None when ``value`` was not signed with this key for
        this name (forged, copied from another name, cut or changed)."""
        if isinstance(value, (bytes, bytearray)):
            value = bytes(value).decode("utf-8", "replace")
        if not isinstance(value, str) or len(value) > self.MAX_VALUE:
            return None
        mac, sep, text = value.partition(" ")
        if not sep or not hmac.compare_digest(mac.encode("utf-8", "replace"), self._mac(name, text).encode()):
            return None
        return text

    def _mac(self, name: str, text: str) -> str:
        message = b"dask-ddp preemption\0" + name.encode("utf-8", "replace") + b"\0" + text.encode("utf-8", "replace")
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()


#: What a rank found forged in the store (the ``what`` of :func:`forged_item`), as ``job.history`` names it.
FORGED_WHAT = {
    "notice": "preemption notice",
    "seen": "posted step of the preemption protocol",
    "stopped": "stop mark of the preemption protocol",
}


def forged_item(rank: int, attempt: int, what: str, count: int, total: int) -> dict:
    """The event item that tells the client rank ``rank`` ignored ``count`` store values of kind ``what`` (a key
    of :data:`FORGED_WHAT`) that failed their signature check, ``total`` of all kinds so far in this attempt."""
    return {"kind": "forged", "rank": rank, "attempt": attempt, "time": time.time(), "what": what,
            "count": int(count), "total": int(total)}


def forged_note(item: dict) -> str:
    """The ``job.history`` line for a :func:`forged_item`."""
    count, rank, attempt = int(item.get("count") or 0), item.get("rank"), int(item.get("attempt") or 0)
    what = FORGED_WHAT.get(str(item.get("what")), str(item.get("what")))
    one = count == 1
    return (f"rank {rank} (attempt {attempt + 1}) ignored {'a' if one else count} {what}{'' if one else 's'} that "
            f"failed {'its' if one else 'their'} signature check ({int(item.get('total') or count)} so far in this "
            "attempt): not written by the job's ranks but by someone who can reach rank 0's rendezvous store "
            "(MASTER_ADDR:MASTER_PORT); the job goes on. Keep the workers' network private to the job's owner")

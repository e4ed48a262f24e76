"""Telling the ranks of a live-recovered job that peers were lost (``recovery="live"``).

Runs in: the client (:func:`tell_peer_lost`, for the controller) and the Dask workers (:func:`_tell_here`).
The message goes to each survivor's supervisor, which passes it to its rank process
(:class:`~dask_ddp.wire.messages.PeerLost`; the rank side is :mod:`dask_ddp.rank.live`).
"""

from __future__ import annotations

from typing import Sequence

from dask_ddp.wire.messages import PeerLost

__all__ = ["tell_peer_lost"]

RANK_HOST = "dask-ddp"  # the name of the workers' RankHost plugin (dask_ddp.worker.plugin)


async def _tell_here(attempt_id: str, ranks: list[int], cause: str, replaced: list, joined: list,
                     dask_worker=None) -> int:
    host = dask_worker.plugins.get(RANK_HOST)
    sups = host.running(attempt_id) if host is not None else []
    for sup in sups:
        sup.peer_lost(PeerLost(tuple(ranks), cause, tuple((int(r), int(n)) for r, n in replaced), tuple(joined)))
    return len(sups)


def tell_peer_lost(client, attempt_id: str, addresses: list[str], ranks: list[int], cause: str,
                   replaced: Sequence = (), joined: Sequence = ()) -> None:
    """From the client: tell every rank of ``attempt_id`` on ``addresses`` that ``ranks`` were lost, and which of
    them have replacements starting (``(rank, n)``: the n-th rank started into the attempt); ``joined``: the n of
    each lost process (0: started with the attempt). A worker that does
    not answer is skipped: it is being lost too. Raises what ``client.run`` raises when the scheduler cannot be
    reached."""
    client.run(_tell_here, attempt_id, list(ranks), cause, list(replaced), list(joined), workers=list(addresses),
               on_error="ignore")

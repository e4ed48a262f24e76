"""Rank planning: which workers take part and which rank each gets.

Runs in: the client (from the scheduler's view of the workers).

Pure functions, no cluster: :func:`make_plan` turns the scheduler's view of
the workers into a frozen :class:`RankPlan`. Ranks are deterministic: workers
are ordered by host, then by worker name (dask-cuda names workers by GPU id),
then by port, parsed as numbers where they are numbers, never by the raw
address string (``tcp://10.0.0.10`` would sort before ``tcp://10.0.0.9``).
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence
from urllib.parse import urlsplit

from dask_ddp.wire.errors import PlanError

__all__ = ["WorkerInfo", "RankSpec", "RankPlan", "make_plan", "parse_address", "torchrun_env"]


@dataclass(frozen=True)
class WorkerInfo:
    """One Dask worker as the scheduler sees it."""

    address: str
    host: str
    port: int
    name: str


@dataclass(frozen=True)
class RankSpec:
    """Where one rank runs and what it is called (frozen, made on the client)."""

    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    num_nodes: int
    address: str
    host: str
    name: str


@dataclass(frozen=True)
class RankPlan:
    """The ranks of one launch, in rank order, and the rendezvous host."""

    ranks: tuple[RankSpec, ...]
    master_addr: str

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self.ranks]

    def rank_of(self, address: str) -> RankSpec | None:
        """The rank running on worker ``address``, or None."""
        return next((r for r in self.ranks if r.address == address), None)


def parse_address(address: str) -> tuple[str, int]:
    """Split a Dask address (``tcp://host:port``, ``ucx://[::1]:8786``) into host and port.

    Raises
    ------
    PlanError
        If the address has no host.
    """
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    if not parts.hostname:
        raise PlanError(f"cannot read a host from worker address {address!r}")
    try:
        port = parts.port or 0
    except ValueError:
        port = 0
    return parts.hostname, port


_DIGITS = re.compile(r"(\d+)")


def _natural_key(text: str) -> tuple:
    """Sort key that orders embedded numbers numerically: 'w2' < 'w10', '9' < '10'.

    ``re.split`` with a group alternates text and digits (``'w10a'`` -> ``['w', '10', 'a']``), so the key
    compares text with text and numbers with numbers at every position.
    """
    parts = _DIGITS.split(text)
    parts[1::2] = map(int, parts[1::2])
    return tuple(parts)


@functools.lru_cache(maxsize=4096)  # one parse per host, not per worker (8 workers a host is common)
def _host_key(host: str) -> tuple:
    try:
        ip = ipaddress.ip_address(host)
        return (0, ip.version, int(ip), "")
    except ValueError:
        return (1, 0, 0, _natural_key(host))


def workers_from_scheduler_info(info: Mapping[str, Any]) -> list[WorkerInfo]:
    """Read the workers out of the scheduler's identity, ``{"workers": {address: info}}``
    (``{"workers": dask_ddp.client.cluster.scheduler_workers(client)}``)."""
    out = []
    for address, w in info.get("workers", {}).items():
        host, port = w.get("host"), _port(address)
        if not host or port is None:  # the scheduler gave no host, or an address of an unusual form
            parsed_host, port = parse_address(address)
            host = host or parsed_host
        out.append(WorkerInfo(address=address, host=host, port=port, name=str(w.get("name", address))))
    return out


def _port(address: str) -> int | None:
    """The port of ``proto://host:port`` without a URL parse (10,000 workers: ms, not 100s of ms); else None."""
    tail = address.rpartition(":")[2]
    return int(tail) if tail.isdigit() else None


def _order(workers: Sequence[WorkerInfo]) -> list[WorkerInfo]:
    return sorted(workers, key=lambda w: (_host_key(w.host), _natural_key(w.name), w.port))


def elastic_bounds(selection: Any) -> tuple[int, int | None] | None:
    """``(min, max)`` when ``workers=`` asks for an elastic job (a tuple of two counts), else None.

    Raises
    ------
    PlanError
        If the bounds are not ``1 <= min <= max`` (``max`` may be None: every worker).
    """
    if not (isinstance(selection, tuple) and len(selection) == 2 and _count(selection[0])
            and (selection[1] is None or _count(selection[1]))):
        return None
    lo, hi = selection
    if lo < 1 or (hi is not None and hi < lo):
        raise PlanError(f"workers={selection!r}: elastic bounds must be (min, max) with 1 <= min <= max "
                        "(max None for every worker)")
    return lo, hi


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _select(workers: Sequence[WorkerInfo], selection: Any) -> list[WorkerInfo]:
    available = len(workers)
    bounds = elastic_bounds(selection)
    if bounds is not None:
        lo, hi = bounds
        if available < lo:
            raise PlanError(f"workers={selection!r} needs at least {lo} workers, the cluster has {available}: "
                            f"scale the cluster up or lower the minimum")
        return _order(workers)[:available if hi is None else min(hi, available)]
    if selection is None:
        if not workers:
            raise PlanError("the cluster has no workers: start some (cluster.scale(n)) or wait for them "
                            "(client.wait_for_workers(n)) before dispatching")
        return list(workers)
    if isinstance(selection, bool) or not isinstance(selection, (int, list, tuple)):
        raise PlanError(f"workers= takes a count, a list of worker addresses or names, or (min, max) counts; "
                        f"got {selection!r}")
    if isinstance(selection, int):
        if selection < 1:
            raise PlanError(f"workers={selection}: ask for at least 1 worker")
        if selection > available:
            raise PlanError(f"asked for {selection} workers, the cluster has {available}: "
                            f"scale the cluster up or ask for at most {available}")
        return _order(workers)[:selection]
    if not selection:
        raise PlanError("workers=[] names no worker: pass None for every worker, a count, or addresses/names")
    by_key: dict[str, WorkerInfo] = {}
    for w in workers:
        by_key[w.address] = w
        by_key.setdefault(w.name, w)
    chosen: list[WorkerInfo] = []
    unknown: list = []
    for key in selection:
        found = by_key.get(str(key))
        if found:
            chosen.append(found)
        else:
            unknown.append(key)
    if unknown:
        known = ", ".join(sorted(w.address for w in workers)) or "none"
        raise PlanError(f"workers= names {len(unknown)} unknown worker(s): {unknown!r}; the cluster has: {known}")
    if len(set(chosen)) != len(chosen):
        raise PlanError(f"workers= names the same worker twice: {list(selection)!r}")
    return chosen


def make_plan(workers: Sequence[WorkerInfo], selection: Any = None, master_addr: str | None = None) -> RankPlan:
    """Choose workers and give each a rank.

    Parameters
    ----------
    workers
        Every worker of the cluster.
    selection
        None for all workers, an int for the first ``n`` in rank order, a
        list of worker addresses or names, or a tuple ``(min, max)`` of counts
        (elastic: as many as there are, at most ``max``, at least ``min``).
    master_addr
        Host of the rendezvous store; defaults to rank 0's host as the
        scheduler sees it.

    Raises
    ------
    PlanError
        If the selection asks for more workers than exist (or fewer than an
        elastic minimum exist), names unknown or repeated workers, or is of
        the wrong type.
    """
    chosen = _order(_select(workers, selection))
    node_of: dict[str, int] = {}  # host -> node rank, in rank order (dicts: 10,000 workers plan in ms)
    per_host: dict[str, int] = {}
    local = []
    for w in chosen:
        node_of.setdefault(w.host, len(node_of))
        local.append(per_host.get(w.host, 0))
        per_host[w.host] = local[-1] + 1
    ranks = tuple(
        RankSpec(
            rank=i,
            local_rank=local[i],
            node_rank=node_of[w.host],
            world_size=len(chosen),
            local_world_size=per_host[w.host],
            num_nodes=len(node_of),
            address=w.address,
            host=w.host,
            name=w.name,
        )
        for i, w in enumerate(chosen)
    )
    return RankPlan(ranks=ranks, master_addr=master_addr or chosen[0].host)


def torchrun_env(r: RankSpec, master_addr: str, run_id: str, attempt: int, max_restarts: int) -> dict:
    """The environment torchrun gives a rank (all but MASTER_PORT, known once rank 0 has bound it)."""
    env = {"RANK": r.rank, "LOCAL_RANK": r.local_rank, "WORLD_SIZE": r.world_size,
           "LOCAL_WORLD_SIZE": r.local_world_size, "GROUP_RANK": r.node_rank, "GROUP_WORLD_SIZE": r.num_nodes,
           "ROLE_RANK": r.rank, "ROLE_WORLD_SIZE": r.world_size, "ROLE_NAME": "default",
           "MASTER_ADDR": master_addr, "TORCHELASTIC_RESTART_COUNT": attempt,
           "TORCHELASTIC_MAX_RESTARTS": max_restarts, "TORCHELASTIC_RUN_ID": run_id}
    return {k: str(v) for k, v in env.items()}

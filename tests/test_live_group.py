"""The live group's membership protocol in one process: a real torch store (``HashStore``) and a real gloo group of
the one rank left, no cluster. The ranks a test plays besides it exist only as what they wrote to the store."""

import json
import os
import time

import pytest
import torch
import torch.distributed as dist

from dask_ddp.rank.live_group import KEY, LiveGroup, LiveRecoveryError
from dask_ddp.rank.live_state import Replicated
from dask_ddp.wire.notices import Seal


@pytest.fixture
def group():
    """Rank 0 of a 3-rank live group, its gen-0 process group stood in for by a gloo group of one."""
    store, seal = dist.HashStore(), Seal(os.urandom(32))
    dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", store), rank=0, world_size=1)
    try:
        g = LiveGroup(store, seal, 0, 3, "gloo", timeout=5.0)
        net = torch.nn.Linear(2, 1)
        g.attach(Replicated(net, torch.optim.SGD(net.parameters(), lr=0.1)))
        yield g
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_generation_agreed_with_a_member_this_rank_knows_lost_is_given_up_at_once(group):
    """Ranks 1 and 2 die at once. Rank 2's process, before it died, had heard only of rank 1 and wrote the first
    proposal for generation 1: members [0, 2]. Rank 0 has heard of both: it must not wait in generation 1 for
    rank 2 (no more news would come to release it: the hang of the five-recoveries test, 1 run in ~20), but go
    to generation 2 alone."""
    name = f"{KEY}1/members"
    stale = json.dumps({"members": [0, 2], "joiners": {}})
    group.store.set(name, group.seal.sign(name, stale))
    group.note_lost([1], joined=[0])
    group.note_lost([2], joined=[0])
    started = time.monotonic()
    group.regroup(7)
    assert (group.gen, group.members) == (2, [0]), (group.gen, group.members)
    assert time.monotonic() - started < 4, "waited for the lost member instead of giving the generation up"
    assert dist.get_world_size() == 1


def test_a_member_whose_replacement_joins_is_not_taken_for_lost(group):
    """The lost rank's old process is lost, its replacement (n=1) is a member of the agreed generation: that
    generation can form (it is not given up for the old process's loss). Here the replacement never checks in,
    so rank 0 waits for it until the group's timeout, and says so."""
    group.note_lost([2], replaced=[(2, 1)], joined=[0])
    with pytest.raises(LiveRecoveryError, match=r"generation 1 did not all check in"):
        group.regroup(7)
    invite = f"{KEY}invite/1"
    assert json.loads(group.seal.open(invite, group.store.get(invite)))["gen"] == 1  # invited, not skipped


def test_a_forming_generation_is_given_up_for_a_lost_member_only(group):
    """Rank 0 forms generation 1 with rank 2 (rank 1 lost, no replacement); rank 2 has not checked in yet. News
    that does not touch the generation (rank 1's loss told again, a replacement starting for rank 1, taken in at
    a step boundary later) leaves it forming: giving it up then left a rank that had heard everything alone in a
    generation the others had left (the five-recoveries test's second hang). Rank 2's loss gives it up at once."""
    import threading

    group.note_lost([1], joined=[0])
    out: list = []
    forming = threading.Thread(target=lambda: out.append(group._form(1, [0, 2], {})), daemon=True)
    forming.start()
    group.note_lost([1], joined=[0])
    group.note_lost([], replaced=[(1, 1)])
    forming.join(1.5)
    assert forming.is_alive() and not out, "news of another process gave the generation up"
    started = time.monotonic()
    group.note_lost([2], joined=[0])
    forming.join(3)
    assert out == [False] and time.monotonic() - started < 1, out

"""Exactly once per epoch through a sharded checkpoint: FSDP2 on 2 ranks saves mid-epoch, 3 ranks resume.

Real parts: real JPEGs in tar shards on local disk, two dask-ddp jobs on a LocalCluster of 3 worker processes
(gloo), FSDP2's ``fully_shard`` and ``save_sharded``/``load_sharded`` over torch DCP (resharded 2 -> 3),
DataLoader worker processes (2 ranks x 1 worker, then 3 ranks x 2 workers). The loader's position is never saved
by hand. (Ranks forked from the pytest process itself hung once in a full-suite run: it holds other tests'
threads, and the ranks fork DataLoader workers in turn.)
"""

from __future__ import annotations

import collections
import json

from _cluster import leftover_processes, local_client, run
from test_streaming import make_folder

import dask_ddp
from dask_ddp.data import StreamingDataset, write_shards

N = 97  # a prime
SAVED_AT = 5  # the step the checkpoint holds; phase 0 goes on 2 more steps, which the model then does not hold


def to_tensor(img):
    import numpy as np
    import torch

    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)


def _phase(url, save_dir, log_dir, phase):
    import torch
    from torch.distributed.fsdp import fully_shard

    rank = dask_ddp.get_context().rank
    loader = StreamingDataset(url, seed=3, transform=to_tensor, buffer=16).loader(
        2, num_workers=1 if phase == 0 else 2, policy="pad")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3 * 16 * 16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "step": -1}
    step = dask_ddp.load_sharded(state, directory=save_dir) if phase else -1  # the position comes with it
    with open(f"{log_dir}/p{phase}-r{rank}.jsonl", "w") as log:
        log.write(json.dumps({"resumed_from": step, "cursor": loader.cursor}) + "\n")
        for x, y in loader:
            step += 1
            torch.nn.functional.cross_entropy(model(x.flatten(1).float() / 255), y).backward()
            opt.step()
            opt.zero_grad()
            log.write(json.dumps({"step": step, "keys": loader.batch_keys[:loader.batch_real]}) + "\n")
            if phase == 0 and step == SAVED_AT:
                dask_ddp.save_sharded({"model": model, "step": step}, step, directory=save_dir)
            if phase == 0 and step == SAVED_AT + 2:
                break  # a crash: these two steps are lost with the process
    return step


def test_sharded_checkpoint_resumes_the_epoch_exactly_once_on_another_world_size(tmp_path):
    make_folder(tmp_path / "src", n=N, classes=3)
    url = str(tmp_path / "shards")
    write_shards(str(tmp_path / "src"), url, shard_size="16KB", progress=False, client=False)
    logs = tmp_path / "logs"
    logs.mkdir()
    save_dir = str(tmp_path / "ckpt")
    with local_client(3) as client:
        assert run(client, _phase, url, save_dir, str(logs), 0, workers=2).result(timeout=300) == [SAVED_AT + 2] * 2
        ends = run(client, _phase, url, save_dir, str(logs), 1, workers=3).result(timeout=300)
        assert leftover_processes(client) == []
    held, resumed = [], set()
    for path in sorted(logs.glob("p*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        if path.name.startswith("p1"):
            resumed.add((lines[0]["resumed_from"], lines[0]["cursor"]))
        held += [k for rec in lines[1:] if path.name.startswith("p1") or rec["step"] <= SAVED_AT for k in rec["keys"]]
    # 2 ranks x batch 2 = 4 samples a step: 6 steps (0..5) held 24 samples; 3 ranks continue at cursor 24
    assert resumed == {(SAVED_AT, 4 * (SAVED_AT + 1))}, resumed
    count = collections.Counter(held)
    assert [k for k, n in count.items() if n > 1] == [], "duplicates"
    assert sorted(count) == sorted(StreamingDataset(url).index.keys), "missing or foreign samples"
    assert len(set(ends)) == 1  # every rank ended the epoch at the same step (equal batch counts)

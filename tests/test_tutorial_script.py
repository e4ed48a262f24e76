"""PyTorch's DDP tutorial script, unchanged but for CPU, finishes as a success under ``dask-ddp run``, every time.

The script below follows ``distributed/ddp-tutorial-series/multigpu_torchrun.py`` of pytorch/examples (its own
``init_process_group``, a ``DistributedSampler``, rank 0's ``torch.save`` snapshot every few epochs, resume
from it, ``destroy_process_group()`` at the end), written here for CPU and gloo, with its dataset in the file.
It trained to the end and then, in 5 of 10 runs, one rank aborted ("terminate called after throwing an
instance of 'std::system_error' what(): Resource deadlock avoided", SIGABRT): dask-ddp's timing comm hook
held the model's process group, and the hook's last future, freed on one of gloo's own threads, freed the
group there; the group's destructor joined that very thread. The hook now holds the group weakly.
"""

from __future__ import annotations

import os
import textwrap

import pytest
from dask.distributed import Client, LocalCluster
from test_cli import run_cli

# The abort this guards against came in 5 of 10 runs: 10 runs miss a defect that frequent with a chance of
# 2**-10 (under 1 in 1,000). Each run is a whole `dask-ddp run` (a new client process, its job, its ranks).
RUNS = 10

TUTORIAL = textwrap.dedent('''
    import os
    import sys

    import torch
    from torch.distributed import destroy_process_group, init_process_group
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, Dataset
    from torch.utils.data.distributed import DistributedSampler


    class Pairs(Dataset):
        def __init__(self, size):
            self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

        def __len__(self):
            return len(self.data)

        def __getitem__(self, index):
            return self.data[index]


    class Trainer:
        def __init__(self, model, data, optimizer, save_every, snapshot):
            self.gpu_id = int(os.environ["LOCAL_RANK"])
            self.model, self.data, self.optimizer = model.to("cpu"), data, optimizer
            self.save_every, self.epochs_run = save_every, 0
            if os.path.exists(snapshot):
                state = torch.load(snapshot, map_location="cpu")
                self.model.load_state_dict(state["MODEL_STATE"])
                self.epochs_run = state["EPOCHS_RUN"]
                print(f"Resuming training from snapshot at Epoch {self.epochs_run}")
            self.model = DDP(self.model)

        def _run_epoch(self, epoch):
            self.data.sampler.set_epoch(epoch)
            for source, targets in self.data:
                self.optimizer.zero_grad()
                torch.nn.CrossEntropyLoss()(self.model(source), targets).backward()
                self.optimizer.step()

        def train(self, max_epochs):
            for epoch in range(self.epochs_run, max_epochs):
                self._run_epoch(epoch)
                if self.gpu_id == 0 and epoch % self.save_every == 0:
                    torch.save({"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}, "snapshot.pt")
                    print(f"Epoch {epoch} | Training snapshot saved at snapshot.pt")


    def main(save_every, total_epochs, batch_size=32):
        init_process_group(backend="gloo")
        dataset = Pairs(2048)
        model = torch.nn.Linear(20, 1)
        loader = DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                            sampler=DistributedSampler(dataset))
        Trainer(model, loader, torch.optim.SGD(model.parameters(), lr=1e-3), save_every, "snapshot.pt").train(
            total_epochs)
        destroy_process_group()


    if __name__ == "__main__":
        main(int(sys.argv[2]), int(sys.argv[1]))
''')


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory):
    """A 2-worker LocalCluster whose workers run in a folder of their own (the script's snapshot.pt lands
    there, as in the working directory of a torchrun job), and the script's path."""
    folder = tmp_path_factory.mktemp("tutorial")
    (folder / "multigpu_torchrun.py").write_text(TUTORIAL)
    here = os.getcwd()
    os.chdir(folder)  # the workers are spawned now and keep it as their working directory
    try:
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                          dashboard_address=":0") as cluster, Client(cluster):
            os.chdir(here)
            yield cluster.scheduler_address, folder
    finally:
        os.chdir(here)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_tutorial_script_trains_saves_resumes_and_succeeds_every_time(tutorial):
    address, folder = tutorial
    failures = []
    for i in range(RUNS):
        out = run_cli("run", "--scheduler", address, "--workers", "2", folder / "multigpu_torchrun.py", "4", "2",
                      timeout=300)
        if out.returncode != 0:
            failures.append(f"run {i}: exit {out.returncode}\n{out.stderr[-3000:]}")
        elif i == 0:
            assert "Epoch 2 | Training snapshot saved" in out.stdout, out.stdout[-3000:]
        else:
            assert "Resuming training from snapshot at Epoch 2" in out.stdout, out.stdout[-3000:]
    print(f"tutorial script: {RUNS - len(failures)} of {RUNS} runs succeeded")
    assert not failures, f"{len(failures)} of {RUNS} runs failed; the first:\n{failures[0]}"
    assert (folder / "snapshot.pt").exists()

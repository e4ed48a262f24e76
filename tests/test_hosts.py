"""DDP jobs across simulated hosts: network namespaces on a bridge, one Dask worker process per rank.

Every test is a real job through a ``distributed.Client`` in the root namespace, which reaches the
scheduler and nothing else (tests/_hosts.py draws the network). Needs root and ``ip``; skips otherwise.
Run with ``-s`` to see the measured figures.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
import traceback

import dask
import psutil
import pytest
import torch
from _cluster import (
    elastic_job_past_its_first_checkpoint,
    first_step_after_restart,
    run,
    wait_until,
)
from _hosts import ip, simulated_hosts, unavailable

import dask_ddp
from dask_ddp.client.cluster import scheduler_workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


# ---- fixtures ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def can_make_hosts():
    reason = unavailable()
    if reason:
        pytest.skip(reason)


# distributed's TCP timeout for the three hosts' scheduler and workers: 20 s instead of 30 s. Only a cut longer than
# it is told apart by it (test_host_cut_off_past_the_tcp_timeout_...), which then waits 20 s instead of 30 s for the
# same thing; a connection whose peer answers is never timed out by it (keepalive and TCP_USER_TIMEOUT act on bytes
# left unacknowledged, which the kernel acknowledges, under load too). A shorter cut must stay well under it: bytes
# sent during a cut wait for TCP's next retransmission after it (exponential backoff: up to about the cut's length
# again), so test_host_cut_off_mid_job_... (a cut of about 8 s: ddp.worker-timeout's 6 s and the restart) restores
# the link as soon as the job runs again. With 12 s, its workers came back and then lost their connections.
TCP_TIMEOUT = 20


@pytest.fixture(scope="module")
def three_hosts(can_make_hosts):
    """3 hosts x 2 workers, every host named as the machine (a name /etc/hosts maps to loopback)."""
    with simulated_hosts([2, 2, 2], env={"DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": f"{TCP_TIMEOUT}s"}) as hosts:
        yield hosts


def client_peers(hosts) -> set[str]:
    """The simulated hosts' addresses this (client) process has TCP connections to: only the scheduler's."""
    return {c.raddr.ip for c in psutil.Process().net_connections("tcp")
            if c.raddr and c.raddr.ip in {str(a) for a in hosts.subnet}}


# ---- functions run on the ranks ------------------------------------------------------------------------------

def train_and_tell(steps):
    """A few DDP steps; then where the rank ran, its interface, its store's listener, its TCP peers."""
    import socket

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    dask_ddp.seed_everything(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        loss = model(torch.randn(16, 8)).pow(2).mean()  # different data per rank (seed + rank)
        opt.zero_grad()
        loss.backward()
        opt.step()
        dask_ddp.report(loss=loss, step=step)
    port = int(os.environ["MASTER_PORT"])
    conns = psutil.Process().net_connections("tcp")  # torch's store client connects over IPv6, IPv4-mapped
    name = socket.gethostname()
    return {"rank": ctx.rank, "node_rank": ctx.node_rank, "local_rank": ctx.local_rank,
            "local_world_size": ctx.local_world_size, "num_nodes": ctx.num_nodes, "worker": ctx.worker,
            "env": {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                                   "GROUP_WORLD_SIZE", "GLOO_SOCKET_IFNAME")},
            "listen": [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port],
            "listening": sorted((c.laddr.ip, c.laddr.port, c.family.name) for c in conns if c.status == "LISTEN"),
            "conns": sorted((c.laddr.ip, c.laddr.port, c.raddr.ip, c.raddr.port, c.family.name)
                            for c in conns if c.raddr),
            "peers": sorted({c.raddr.ip.removeprefix("::ffff:") for c in conns if c.raddr}),
            "hostname": name, "resolves": socket.gethostbyname(name),
            "params": torch.cat([p.detach().flatten() for p in model.parameters()])}


def all_reduce_one():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


def _fail_here(rank):
    raise ValueError(f"rank {rank} found a bad batch")


def raise_on(bad):
    import torch
    import torch.distributed as dist

    ctx = dask_ddp.get_context()
    print(f"hello from rank {ctx.rank} on host {ctx.node_rank}", flush=True)
    dask_ddp.report(step=0, node=ctx.node_rank)
    dist.barrier()
    if ctx.rank == bad:
        time.sleep(2.5)  # every rank's report and line is out by now (ddp.events.flush-interval: 1 s)
        _fail_here(ctx.rank)
    while True:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.01)


# ---- tests ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("workers_per_host", [(2, 1)])
def test_uneven_hosts(three_hosts, workers_per_host):
    """A job on 2 workers of h1 and 1 of h2. The plan counts the job's own workers per host (the cluster's other
    workers, here h2-w1 and h3's, are no part of it), so the three hosts' cluster serves as a (2, 1) one and no
    cluster of its own is started."""
    workers = [w for host, n in zip(three_hosts.hosts, workers_per_host) for w in host.workers[:n]]
    job = run(three_hosts.client, train_and_tell, 2, workers=workers)
    out = job.result(timeout=300)
    assert [o["local_world_size"] for o in out] == [2, 2, 1]
    assert [o["env"]["LOCAL_WORLD_SIZE"] for o in out] == ["2", "2", "1"]  # torchrun's: ranks on this node
    assert [o["node_rank"] for o in out] == [0, 0, 1] and [o["local_rank"] for o in out] == [0, 1, 0]
    assert all(o["env"]["GROUP_WORLD_SIZE"] == "2" for o in out)
    assert job.state == "FINISHED"


def test_own_host_names(can_make_hosts):
    """Each host named h<i> by unshare --uts, resolving to its own address through /etc/netns/<ns>/hosts."""
    with simulated_hosts([1, 1], host_names=True) as hosts:
        out = run(hosts.client, train_and_tell, 2).result(timeout=300)
        assert [(o["hostname"], o["resolves"]) for o in out] == [(h.hostname, h.address) for h in hosts.hosts]
        assert [o["env"]["GLOO_SOCKET_IFNAME"] for o in out] == ["veth-h1", "veth-h2"]
        assert (out[0]["params"] == out[1]["params"]).all()


def test_gloo_on_loopback_fails_across_hosts(can_make_hosts):
    """What dask-ddp's pinning prevents: gloo on loopback (here set by the user, which dask-ddp respects)."""
    with simulated_hosts([1, 1], worker_env={"GLOO_SOCKET_IFNAME": "lo"}) as hosts:
        # a lost worker outranks gloo's error (a broken collective) as the root cause; with another test file
        # loading the machine, a worker's heartbeat once came 6 s late while this job ran, and ddp.worker-timeout
        # (6 s) named its worker lost instead: this test is about gloo's message, not liveness
        with dask.config.set({"ddp.worker-timeout": 60}):
            job = run(hosts.client, all_reduce_one, timeout=30)
        with pytest.raises(Exception) as info:
            job.result(timeout=300)
        text = "".join(traceback.format_exception(info.value))
        print(f"gloo on loopback across hosts: {type(info.value).__name__}: {str(info.value).splitlines()[0]}")
        assert "127.0.0.1" in text, text[-2000:]


def test_six_ranks_on_three_hosts(three_hosts):
    hosts, client = three_hosts, three_hosts.client
    job = run(client, train_and_tell, 5)
    out = job.result(timeout=300)
    assert len(out) == 6 and [o["rank"] for o in out] == list(range(6))
    master = hosts.hosts[0].address
    for r, got in enumerate(out):
        host = hosts.host_of(got["worker"])
        assert got["node_rank"] == host.index and got["num_nodes"] == 3
        assert got["local_rank"] == host.workers.index(job.plan.ranks[r].name)
        assert got["local_world_size"] == 2 and got["env"]["LOCAL_WORLD_SIZE"] == "2"
        assert got["env"]["GROUP_RANK"] == str(host.index) and got["env"]["GROUP_WORLD_SIZE"] == "3"
        assert got["env"]["MASTER_ADDR"] == master
        assert got["env"]["GLOO_SOCKET_IFNAME"] == host.ifname, got["env"]
        assert "127.0.0.1" not in got["peers"] and set(got["peers"]) <= {h.address for h in hosts.hosts}, got
        assert {ip for ip, _, _ in got["listening"]} == {host.address}, got["listening"]  # gloo's and the store's
        assert (got["params"] == out[0]["params"]).all(), f"rank {r}'s parameters differ from rank 0's"
    assert out[0]["listen"] == [master], "rank 0's store must listen on its host's address only"
    said = [line for line in job.logs if "collectives use interface" in line]
    assert said == [f"[rank 0] INFO dask_ddp: collectives use interface {hosts.hosts[0].ifname} (the worker's "
                    f"address {master}); set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / TP_SOCKET_IFNAME to choose "
                    "another"], job.logs[-20:]
    assert sorted(job.metrics["rank"].unique()) == list(range(6)) and len(job.metrics) == 30
    assert client_peers(hosts) <= {hosts.scheduler_address}


def test_machine_name_maps_to_loopback(three_hosts):
    """Every host has the machine's name, which /etc/hosts maps to 127.0.0.1 (as on Debian): DDP still works."""
    hosts = three_hosts
    out = run(hosts.client, train_and_tell, 2, workers=["h1-w0", "h2-w0", "h3-w0"]).result(timeout=300)
    assert all(o["resolves"].startswith("127.") for o in out), [o["resolves"] for o in out]
    assert [o["env"]["GLOO_SOCKET_IFNAME"] for o in out] == ["veth-h1", "veth-h2", "veth-h3"]
    assert all((o["params"] == out[0]["params"]).all() for o in out)


def test_raising_rank_across_hosts(three_hosts):
    hosts = three_hosts
    job = run(hosts.client, raise_on, 3)
    with pytest.raises(ValueError, match="rank 3 found a bad batch") as info:
        job.result(timeout=300)
    err = info.value
    assert "_fail_here" in "".join(traceback.format_exception(err)), "the rank's traceback must come back"
    assert any("raised on rank 3" in note and job.plan.addresses[3] in note for note in err.__notes__)
    assert sorted(job.metrics["rank"].unique()) == list(range(6)), "every rank's report must arrive"
    assert sorted(job.metrics["node"].unique()) == [0, 1, 2]
    for r in range(6):
        assert any(f"hello from rank {r} on host {r // 2}" in line for line in job.logs), (r, job.logs)
    assert client_peers(hosts) <= {hosts.scheduler_address}


def test_dispatch_latency_across_hosts(three_hosts):
    client = three_hosts.client
    assert run(client, all_reduce_one).result(timeout=300) == [6] * 6  # warm: every worker's zygote is up
    figures = {}
    for n in (2, 4, 6):
        took = []
        for _ in range(3):
            t0 = time.perf_counter()
            assert run(client, all_reduce_one, workers=n).result(timeout=120) == [n] * n
            took.append(time.perf_counter() - t0)
        figures[n] = statistics.median(took)
    print("dispatch latency (run -> result, median of 3): " +
          ", ".join(f"{n} ranks on {(n + 1) // 2} host(s) {s * 1000:.0f} ms" for n, s in figures.items()))
    assert all(s < 30 for s in figures.values())


def test_host_cut_off_mid_job_resumes_on_the_hosts_left(three_hosts, tmp_path):
    """Host h3's link goes down mid-job: the job restarts from its checkpoint on h1 and h2; h3 comes back (once
    the job runs again on h1 and h2: the cut stays well under the hosts' TCP timeout, see TCP_TIMEOUT)."""
    hosts, client = three_hosts, three_hosts.client
    victim = hosts.hosts[2]
    job = elastic_job_past_its_first_checkpoint(client, tmp_path, 6)
    t_cut = time.time()
    hosts.cut(victim)
    try:
        wait_until(lambda: any(h[2] == "RESTARTING" for h in job.history), 120, what="the job noticing the cut")
        when, _, _, cause = next(h for h in job.history if h[2] == "RESTARTING")
        print(f"host cut off: the job was RESTARTING {when - t_cut:.2f} s later ({cause})")
        wait_until(lambda: [h[2] for h in job.history][1:3] == ["RESTARTING", "RUNNING"] or job.done(), 120,
                   what="the job running again on the hosts left")
    finally:
        hosts.restore(victim)
    print(f"host cut off for {time.time() - t_cut:.1f} s")
    out = job.result(timeout=300)
    print(f"host cut off: first step after the restart {first_step_after_restart(job) - t_cut:.2f} s after the cut")
    assert [h[2] for h in job.history] == ["RUNNING", "RESTARTING", "RUNNING", "FINISHED"], job.history
    assert all(hosts.host_of(a) is not victim for a in job.plan.addresses)
    assert [o[:2] for o in out] == [(4, 1)] * 4 and all(o[2] >= 1 for o in out), "resumed from a checkpoint"
    assert all((o[3] == out[0][3]).all() for o in out)
    assert client_peers(hosts) <= {hosts.scheduler_address}
    _back_to_six(hosts, client, victim)


def _back_to_six(hosts, client, victim) -> None:
    """The link is back: the host's workers serve the scheduler again, or (when their connection to the
    scheduler broke meanwhile and they closed themselves) start again as a node's supervisor would start them;
    then a 6-rank job runs (the module's later tests need all six)."""
    t_back = time.time()
    procs = hosts.host_procs[victim.index]
    came = wait_until(lambda: "rejoined" if _fresh(client, victim, hosts) == 2 else
                      "exited" if all(p.poll() is not None for p in procs) else None, 120, must=False)
    print(f"link restored: the workers of {victim.ns} {came or 'neither rejoined nor exited'} after "
          f"{time.time() - t_back:.1f} s")
    assert came, f"the workers of {victim.ns} neither came back nor exited:\n{hosts.log_tails()}"
    if came == "exited":
        hosts.start_workers(victim)
    wait_until(lambda: all(_fresh(client, h, hosts) == 2 for h in hosts.hosts) and
               len(scheduler_workers(client)) == 6, 180, interval=0.5,
               what="6 live workers, 2 per host")
    print(f"all 6 workers live again {time.time() - t_back:.1f} s after the link came back")
    assert run(client, all_reduce_one).result(timeout=300) == [6] * 6


def train_live(steps: int, step_s: float):
    """A live loop (issue 42): the plain module, momentum SGD, data drawn from (step, group rank)."""
    import torch

    ctx = dask_ddp.get_context()
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    runs = []
    for step in dask_ddp.live_steps(steps, model=net, optimizer=opt):
        with step:
            runs.append((step.index, step.world_size))
            g = torch.Generator().manual_seed(1000 * step.index + step.rank)
            x = torch.randn(16, 8, generator=g)
            loss = torch.nn.functional.mse_loss(net(x), x.sum(1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
            dask_ddp.report(step=step.index, loss=loss.item())
            time.sleep(step_s)
    return {"rank": ctx.rank, "worker": ctx.worker, "pid": os.getpid(), "runs": runs,
            "params": torch.cat([p.detach().reshape(-1) for p in net.parameters()])}


def test_host_cut_off_mid_live_job_costs_one_step_and_a_spare_on_another_host_takes_its_place(three_hosts):
    """A live job (issue 42) of 3 ranks, one per host; h3's link goes down at step 8: no FIN ever comes, rank
    2's worker goes silent (ddp.worker-timeout), the survivors blocked in their all-reduce are released by the
    recovery, keep their processes and redo at most one step; the replacement starts on a free worker of a host
    still reachable (never on h3's other worker, as silent as rank 2's) and heals from their memory; the job ends
    at its full size with parameters bitwise equal to a run without the cut."""
    hosts, client = three_hosts, three_hosts.client
    victim, ranks, steps = hosts.hosts[2], ["h1-w0", "h2-w0", "h3-w0"], 30
    clean = run(client, train_live, steps, 0.0, workers=ranks, recovery="live").result(timeout=300)
    job = run(client, train_live, steps, 0.25, workers=ranks, recovery="live", stall_timeout=120)
    try:
        wait_until(lambda: len(job.metrics) and job.metrics["step"].max() >= 8, 120, what="step 8")
        t_cut = time.time()
        hosts.cut(victim)
        wait_until(lambda: any("its replacement starts on" in h[3] for h in job.history) or job.done(), 120,
                   what="the live recovery")
        when, *_, cause = next(h for h in job.history if "live recovery" in h[3])
        print(f"host cut off: live recovery {when - t_cut:.2f} s later ({cause})")
    finally:  # back as soon as the job went on without it (the cut well under the TCP timeout, see TCP_TIMEOUT):
        hosts.restore(victim)  # its stale rank hears again and must not disturb the group that left it behind
    print(f"host cut off for {time.time() - t_cut:.1f} s")
    out = job.result(timeout=300)
    print(f"history: {[h[3] for h in job.history]}")
    assert job.state == "FINISHED" and [o["rank"] for o in out] == [0, 1, 2]
    assert hosts.host_of(out[2]["worker"]) is not victim, out[2]["worker"]
    for o in out[:2]:  # the survivors: one process each, every step committed, at most one redone
        indices = [i for i, _ in o["runs"]]
        assert sorted(set(indices)) == list(range(steps)) and len(indices) - steps <= 1, indices
        assert {w for _, w in o["runs"]} == {3}  # they waited for the replacement: never smaller
    for a, b in zip(out, clean):
        assert torch.equal(a["params"], b["params"]), f"rank {a['rank']}: parameters differ from the clean run"
    assert not any(h[2] == "RESTARTING" for h in job.history), job.history
    assert job.goodput.loc["job", "recovery_s"] > 0
    _back_to_six(hosts, client, victim)


def _fresh(client, host, hosts) -> int:
    """How many of ``host``'s workers the scheduler heard from within the last 2 s."""
    info = scheduler_workers(client)
    now = time.time()
    return sum(1 for a, w in info.items() if a.startswith(f"tcp://{host.address}:") and now - w["last_seen"] < 2)


def test_host_cut_off_past_the_tcp_timeout_leaves_and_rejoins_when_restarted(three_hosts):
    """Cut longer than distributed's TCP timeout (30 s by default; TCP_TIMEOUT, 20 s, for these hosts): the host's
    workers close themselves and their ``dask worker`` processes exit; started again after the link is back (as
    systemd or Kubernetes would), they rejoin and a 6-rank job runs."""
    hosts, client = three_hosts, three_hosts.client
    victim = hosts.hosts[1]
    procs = hosts.host_procs[victim.index]
    t_cut = time.time()
    hosts.cut(victim)
    try:
        wait_until(lambda: all(p.poll() is not None for p in procs), 120, interval=0.5,
                   what=f"the worker processes of {victim.ns} exiting")
        exited = time.time() - t_cut
        wait_until(lambda: not hosts.workers_of(victim), 60, interval=0.5, what="the scheduler dropping them")
        dropped = time.time() - t_cut
    finally:
        hosts.restore(victim)
    print(f"host cut off with no job: its worker processes exited {exited:.1f} s later, the scheduler dropped "
          f"them {dropped:.1f} s later")
    assert exited >= TCP_TIMEOUT - 1, f"the workers left {exited:.1f} s after the cut: before the TCP timeout"
    t_back = time.time()
    hosts.start_workers(victim)
    wait_until(lambda: all(_fresh(client, h, hosts) == 2 for h in hosts.hosts) and
               len(scheduler_workers(client)) == 6, 180, interval=0.5,
               what="6 live workers, 2 per host")
    assert run(client, all_reduce_one).result(timeout=300) == [6] * 6
    print(f"restarted workers joined and ran a 6-rank job {time.time() - t_back:.1f} s after the link came back")


def steps_until_cancelled():
    import torch
    import torch.distributed as dist

    for i in range(100_000):
        dist.all_reduce(torch.ones(1))
        dask_ddp.report(loss=1.0 / (i + 1))
        time.sleep(0.02)


def test_two_jobs_at_once_across_hosts(three_hosts):
    """Two 3-rank jobs, each with one worker on every host, at the same time: each trains as its own group."""
    hosts, client = three_hosts, three_hosts.client
    a = run(client, train_and_tell, 8, workers=["h1-w0", "h2-w0", "h3-w0"])
    b = run(client, train_and_tell, 8, workers=["h1-w1", "h2-w1", "h3-w1"])
    out_a, out_b = a.result(timeout=300), b.result(timeout=300)
    for job, out in ((a, out_a), (b, out_b)):
        assert [o["rank"] for o in out] == [0, 1, 2] and {o["num_nodes"] for o in out} == {3}
        assert all((o["params"] == out[0]["params"]).all() for o in out), f"{job.name}: ranks differ"
        assert sorted(job.metrics["rank"].unique()) == [0, 1, 2]
    assert {o["worker"] for o in out_a}.isdisjoint(o["worker"] for o in out_b)
    assert out_a[0]["env"]["MASTER_ADDR"] == out_b[0]["env"]["MASTER_ADDR"] == hosts.hosts[0].address
    assert out_a[0]["env"]["MASTER_PORT"] != out_b[0]["env"]["MASTER_PORT"], "two stores on one port"
    assert client_peers(hosts) <= {hosts.scheduler_address}


def test_progress_and_cancel_from_a_client_that_reaches_only_the_scheduler(three_hosts, capsys):
    """The bar draws, live metrics arrive and cancel() stops every rank on every host; the client opens no
    connection to a worker or a rank."""
    hosts, client = three_hosts, three_hosts.client
    job = dask_ddp.dispatch.run(client, steps_until_cancelled, progress=True)
    wait_until(lambda: not job.metrics.empty and job.metrics["rank"].nunique() == 6, 240,
               what="metrics from all 6 ranks")
    assert len(_rank_processes(hosts)) == 6, _rank_processes(hosts)  # what must be gone after cancel()
    t0 = time.time()
    job.cancel()
    with pytest.raises(dask_ddp.JobCancelledError):
        job.result(timeout=120)
    stopped = time.time() - t0
    assert job.state == "CANCELLED"
    err = capsys.readouterr().err
    assert job.run_id in err and "step" in err, "no progress bar was drawn"
    left = wait_until(lambda: not _rank_processes(hosts), 30, interval=0.2, must=False)
    assert left is not False and not _rank_processes(hosts), _rank_processes(hosts)
    print(f"cancel() to result() raising: {stopped:.2f} s")
    assert client_peers(hosts) <= {hosts.scheduler_address}


def _rank_processes(hosts) -> list[str]:
    """Rank processes in any simulated host, as 'ns pid cmd': each is forked from its worker's zygote (same command
    line, the zygote its parent), or with ``ddp.zygote: false`` a ``python -m dask_ddp.rank.main``. The rank a
    worker forked ahead for its next job (``rank_process_pids``' spare) is no job's and is left out."""
    from dask_ddp.worker.plugin import rank_process_pids

    try:
        spares = {p for got in hosts.client.run(rank_process_pids).values() for p in got["spare"]}
    except Exception:  # noqa: BLE001 - a worker leaving meanwhile: ask again at the next look
        return ["(the workers could not be asked for their spare ranks)"]
    out = []
    for h in hosts.hosts:
        for pid in ip("netns", "pids", h.ns, check=False).split():
            try:
                proc = psutil.Process(int(pid))
                cmd = " ".join(proc.cmdline())
                parent = proc.parent()
                forked = "dask_ddp.rank.zygote" in cmd and parent is not None and "dask_ddp.rank.zygote" in " ".join(
                    parent.cmdline())
                if (forked or "dask_ddp.rank.main" in cmd) and int(pid) not in spares:
                    out.append(f"{h.ns} {pid} {cmd[:80]}")
            except (psutil.Error, ValueError):
                pass
    return out


def test_dask_ddp_run_against_the_hosts_scheduler(three_hosts, tmp_path):
    """The CLI, from outside the cluster network, runs a torchrun-style script on the 6 ranks."""
    script = tmp_path / "train.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(1) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "print(f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} on node {os.environ['GROUP_RANK']}: "
        "{int(t.item())}\", flush=True)\n"
        "dist.destroy_process_group()\n")
    out = subprocess.run([sys.executable, "-m", "dask_ddp.cli", "run", "--scheduler", three_hosts.scheduler_url,
                          str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout + out.stderr
    for r in range(6):
        assert f"rank {r} of 6 on node {r // 2}: 21" in text, text[-3000:]


def test_all_workers_of_one_host_killed_at_once(three_hosts, tmp_path):
    """Both `dask worker` processes of h2 SIGKILLed together mid-job (a node that dies): the job resumes from its
    checkpoint on h1 and h3, no rank process is left anywhere, and workers started again on h2 serve the next job."""
    hosts, client = three_hosts, three_hosts.client
    victim = hosts.hosts[1]
    job = elastic_job_past_its_first_checkpoint(client, tmp_path, 6)
    t_kill = time.time()
    for p in hosts.host_procs[victim.index]:
        os.killpg(p.pid, signal.SIGKILL)
    wait_until(lambda: any(h[2] == "RESTARTING" for h in job.history), 120, what="the job noticing the kill")
    when = next(h[0] for h in job.history if h[2] == "RESTARTING")
    out = job.result(timeout=300)
    print(f"all workers of one host killed: the job was RESTARTING {when - t_kill:.2f} s later, its first step "
          f"after the restart {first_step_after_restart(job) - t_kill:.2f} s after the kill")
    assert [h[2] for h in job.history] == ["RUNNING", "RESTARTING", "RUNNING", "FINISHED"], job.history
    assert all(hosts.host_of(a) is not victim for a in job.plan.addresses)
    assert [o[:2] for o in out] == [(4, 1)] * 4 and all(o[2] >= 1 for o in out), "resumed from a checkpoint"
    assert wait_until(lambda: not _rank_processes(hosts), 30, interval=0.2, must=False) is not False, \
        _rank_processes(hosts)
    hosts.start_workers(victim)
    wait_until(lambda: all(_fresh(client, h, hosts) == 2 for h in hosts.hosts) and
               len(scheduler_workers(client)) == 6, 180, interval=0.5,
               what="6 live workers, 2 per host")
    assert run(client, all_reduce_one).result(timeout=300) == [6] * 6


def test_each_host_publishes_its_ranks_events_through_its_own_hub(three_hosts):
    """ddp.events.per-host: every rank forwards to the worker of its host's local rank 0 (across the host's own
    address), which publishes its host's batches: the scheduler hears from 3 workers, not 6, and from each only
    its own host's ranks; every report arrives, in order."""
    from test_hub import hub_of, watched_report_job

    from dask_ddp.wire.events import unpack

    job, events = watched_report_job(three_hosts.client, 4.0, 300, per_host=True, flush_interval=0.2)
    plan = job.attempt.plan
    senders: dict[str, set] = {}
    for event in events:
        if "batches" in event:
            senders.setdefault(event.get("worker"), set()).update(b["rank"] for b in unpack(event))
    print({w: sorted(r) for w, r in senders.items()})
    assert set(senders) == {hub_of(plan, r.rank) for r in plan.ranks}, senders
    assert all(hub_of(plan, r) == w for w, ranks in senders.items() for r in ranks), senders

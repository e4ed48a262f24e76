"""Evaluate torchft for dask-ddp's live recovery (issue 42): CPU, gloo, 127.0.0.1 only.

Runs in its own venv so the project's stays untouched:

    /work/main/.venv/bin/python -m venv /tmp/ftvenv
    /tmp/ftvenv/bin/pip install torchft==0.2.0 torch==2.14.1 numpy grpcio grpcio-tools
    /tmp/ftvenv/bin/python benchmarks/torchft_eval.py pg        # (a) reconfigurable gloo vs plain c10d
    /tmp/ftvenv/bin/python benchmarks/torchft_eval.py manager   # (b) Manager: overhead, kill + heal
    /tmp/ftvenv/bin/python benchmarks/torchft_eval.py quorum    # (b) Manager driven by a custom quorum
    /tmp/ftvenv/bin/python benchmarks/torchft_eval.py transfer  # (c) peer transfer of ~50 MB
    /tmp/ftvenv/bin/python benchmarks/torchft_eval.py all       # about 8 minutes on 2 cores

Every part starts its ranks as separate processes (`python this_file _child ROLE ARGS`), so a
SIGKILL is a real process death. Each part prints one JSON line per run; ``--out FILE`` appends
them to FILE; ``--keep`` keeps the ranks' logs. The `quorum` part needs grpcio and grpcio-tools in
the same venv (it compiles torchft's LighthouseService proto and serves it from Python).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

HERE = os.path.abspath(__file__)
ENV = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


# ----------------------------------------------------------------------------- helpers


def spawn(role: str, log_dir: str, **args) -> subprocess.Popen:
    tag = f"{role}-{args.get('rank', args.get('name', ''))}"
    if role == "pg":
        tag = f"pg-{args['rank']}"  # run_pg reads these back on a failure; truncated per run below
    log = open(os.path.join(log_dir, f"{tag}.log"), "ab")
    return subprocess.Popen(
        [sys.executable, HERE, "_child", role, json.dumps(args)],
        stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=log_dir,
    )


def write_out(path: str, res: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(path + ".tmp", path)


def read_out(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def reap(procs, limit_s: float) -> None:
    """Wait for our own children, then SIGKILL (by pid) any still alive."""
    deadline = time.time() + limit_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()


def shutdown_peer_sockets(keep_ports) -> int:
    """Shut down (SHUT_RDWR) every connected TCP socket of this process whose remote port is not in
    keep_ports: the open file description is shared, so gloo's own fd sees EOF and fails its pending
    op at once. This is what a recovery can do to release a rank blocked on a peer that is hung or cut
    off (no FIN/RST ever comes)."""
    import socket

    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                peer = s.getpeername()
                if peer[1] not in keep_ports:
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
        except OSError:
            pass  # a listener, or not connected
        finally:
            s.close()
    return n


def listening() -> list:
    """This process's listening TCP sockets, as 'address:port' (from /proc/net/tcp{,6})."""
    import ipaddress

    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    out = []
    for fam in ("tcp", "tcp6"):
        with open(f"/proc/net/{fam}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in mine:
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                if fam == "tcp":
                    addr = str(ipaddress.IPv4Address(raw[::-1]))
                else:
                    addr = "[" + str(ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))) + "]"
                out.append(f"{addr}:{int(hexport, 16)}")
    return sorted(out)


def nfds() -> int:
    return len(os.listdir("/proc/self/fd"))


def nthreads() -> int:
    return len(os.listdir("/proc/self/task"))


def med(xs):
    return round(statistics.median(xs), 6) if xs else None


def p95(xs):
    return round(sorted(xs)[max(0, int(0.95 * len(xs)) - 1)], 6) if xs else None


def emit(res: dict, out: str | None) -> None:
    line = json.dumps(res, sort_keys=True)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


# ----------------------------------------------------------------------------- (a) process groups


def child_pg(impl, rank, world, port, timeout_s, victim, fault, out, loops, abort_how="api"):
    import torch
    import torch.distributed as dist

    T = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    res = {"rank": rank, "pid": os.getpid()}
    if impl in ("ft", "baby"):
        from torchft.process_group import ProcessGroupBabyGloo, ProcessGroupGloo

        # baby: torchft's variant that runs gloo in a spawned subprocess, killed on abort/reconfigure
        pg = ProcessGroupGloo(timeout=T) if impl == "ft" else ProcessGroupBabyGloo(timeout=T)

        def form(prefix, r, n):
            pg.configure(f"127.0.0.1:{port}/{prefix}", "0", r, n)

        def allreduce(x):
            return pg.allreduce([x], dist.ReduceOp.SUM)

        def abort():
            pg.abort() if impl == "ft" else pg.shutdown()

        def probe():
            if impl == "baby":
                return {}
            b = pg.parent._get_backend(torch.device("cpu"))
            return {"supports_shrinking": b.supports_shrinking, "supports_reconfigure": b.supports_reconfigure}
    else:
        def form(prefix, r, n):
            if dist.is_initialized():
                t = time.perf_counter()
                dist.destroy_process_group()
                res.setdefault("destroy_s", []).append(round(time.perf_counter() - t, 4))
            dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=r,
                                    world_size=n, timeout=T)

        def allreduce(x):
            return dist.all_reduce(x, async_op=True)

        def abort():
            dist.distributed_c10d._abort_process_group()

        def probe():
            b = dist.group.WORLD._get_backend(torch.device("cpu"))
            return {"supports_shrinking": b.supports_shrinking, "supports_reconfigure": b.supports_reconfigure}

    t0 = time.perf_counter()
    form("q1", rank, world)
    t1 = time.perf_counter()
    allreduce(torch.ones(1000)).wait()
    t2 = time.perf_counter()
    res.update(configure_s=round(t1 - t0, 4), first_allreduce_s=round(t2 - t1, 4), **probe())
    lat = []
    for _ in range(20):
        t = time.perf_counter()
        allreduce(torch.ones(1000)).wait()
        lat.append(time.perf_counter() - t)
    res["allreduce_4kB_median_s"] = med(lat)
    write_out(out, res)
    store.set(f"ready/{rank}", "1")
    if rank == victim:
        time.sleep(600)  # never joins the next allreduce; the parent kills or stops it
        return
    if fault == "stop":
        def aborter():
            store.wait(["abort"], timedelta(seconds=120))
            res["abort_called_at"] = time.time()
            if abort_how == "sockets":
                res["sockets_shut"] = shutdown_peer_sockets({port})
            else:
                abort()
            res["abort_returned_at"] = time.time()
        threading.Thread(target=aborter, daemon=True).start()
    x = torch.ones(1000)
    res["wait_started_at"] = time.time()
    try:
        allreduce(x).wait()
        res["released"] = "returned without error"
    except Exception as e:  # noqa: BLE001
        res["released"] = "raised"
        res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"
    res["released_at"] = time.time()
    write_out(out, res)
    new_rank = rank if rank < victim else rank - 1
    try:
        t3 = time.perf_counter()
        form("q2", new_rank, world - 1)
        t4 = time.perf_counter()
        y = torch.ones(1000)
        allreduce(y).wait()
        t5 = time.perf_counter()
        res.update(reconfigure_s=round(t4 - t3, 4), allreduce_after_s=round(t5 - t4, 4),
                   value_ok=bool(y[0].item() == world - 1))
        fd0, th0 = nfds(), nthreads()
        rt = []
        for i in range(loops):
            t = time.perf_counter()
            form(f"loop{i}", new_rank, world - 1)
            allreduce(torch.ones(1000)).wait()
            rt.append(time.perf_counter() - t)
        res.update(reconfigure_loop_median_s=med(rt), fds_before_after=[fd0, nfds()],
                   threads_before_after=[th0, nthreads()])
    except Exception as e:  # noqa: BLE001
        res["reconfigure_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"
    write_out(out, res)


def run_pg(impl, fault, abort_after, timeout_s, tmp, world=3, victim=2, loops=5, abort_how="api"):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    outs = [os.path.join(tmp, f"pg-{impl}-{fault}-{abort_after}-{abort_how}-{r}.json") for r in range(world)]
    for r in range(world):
        open(os.path.join(tmp, f"pg-{r}.log"), "w").close()
    procs = [spawn("pg", tmp, impl=impl, rank=r, world=world, port=store.port, timeout_s=timeout_s,
                   victim=victim, fault=fault, out=outs[r], loops=loops, abort_how=abort_how)
             for r in range(world)]
    deadline = time.time() + 180
    while not store.check([f"ready/{r}" for r in range(world)]):
        dead = [r for r, p in enumerate(procs) if p.poll() is not None]
        if dead or time.time() > deadline:  # a rank failed before the fault: report why, go on
            reap(procs, 15)
            errs = {}
            for r in range(world):
                with open(os.path.join(tmp, f"pg-{r}.log"), errors="replace") as f:
                    tail = [x for x in f.read().splitlines() if "Error" in x]
                errs[r] = tail[-1][:240] if tail else None
            return {"part": "a", "impl": impl, "fault": fault, "abort_after_s": abort_after,
                    "abort_how": abort_how, "gloo_timeout_s": timeout_s, "failed_before_fault": True,
                    "exited_ranks": dead, "errors": errs}
        time.sleep(0.1)
    time.sleep(0.5)  # the survivors are now blocked inside the allreduce
    t_fault = time.time()
    os.kill(procs[victim].pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    if abort_after is not None:
        time.sleep(abort_after)
        store.set("abort", "1")
    survivors = [p for r, p in enumerate(procs) if r != victim]
    reap(survivors, timeout_s + 90)
    if fault == "stop":
        os.kill(procs[victim].pid, signal.SIGKILL)
    reap(procs, 10)
    ranks = [read_out(o) or {} for o in outs]
    surv = [ranks[r] for r in range(world) if r != victim]
    rel = [r["released_at"] - t_fault for r in surv if "released_at" in r]
    res = {
        "part": "a", "impl": impl, "fault": fault, "abort_after_s": abort_after, "abort_how": abort_how,
        "gloo_timeout_s": timeout_s, "sockets_shut": [r.get("sockets_shut") for r in ranks if r],
        "configure_3_ranks_s": [r.get("configure_s") for r in ranks],
        "first_allreduce_s": [r.get("first_allreduce_s") for r in ranks],
        "allreduce_4kB_median_s": [r.get("allreduce_4kB_median_s") for r in ranks],
        "supports_shrinking": ranks[0].get("supports_shrinking"),
        "supports_reconfigure": ranks[0].get("supports_reconfigure"),
        "released": [r.get("released") for r in surv], "errors": [r.get("error") for r in surv],
        "release_after_fault_s": [round(x, 3) for x in rel],
        "reconfigure_2_ranks_s": [r.get("reconfigure_s") for r in surv],
        "allreduce_after_reconf_s": [r.get("allreduce_after_s") for r in surv],
        "value_ok": [r.get("value_ok") for r in surv],
        "reconfigure_error": [r.get("reconfigure_error") for r in surv],
        "reconfigure_loop_median_s": [r.get("reconfigure_loop_median_s") for r in surv],
        "fds_before_after": [r.get("fds_before_after") for r in surv],
        "threads_before_after": [r.get("threads_before_after") for r in surv],
        "destroy_s": [r.get("destroy_s") for r in surv],
        "survivor_exit_codes": [p.returncode for p in survivors],
    }
    if abort_after is not None:
        res["abort_call_s"] = [round(r["abort_returned_at"] - r["abort_called_at"], 4)
                               if "abort_returned_at" in r else None for r in surv]
    return res


def part_pg(args, tmp):
    runs = [("ft", "kill", None, "api"), ("plain", "kill", None, "api"), ("baby", "kill", None, "api"),
            ("ft", "stop", None, "api"), ("ft", "stop", 1.0, "api"), ("plain", "stop", 1.0, "api"),
            ("baby", "stop", 1.0, "api"), ("ft", "stop", 1.0, "sockets"), ("plain", "stop", 1.0, "sockets")]
    for impl, fault, ab, how in runs:
        if (args.impl and impl not in args.impl) or (args.abort_how and how not in args.abort_how):
            continue
        emit(run_pg(impl, fault, ab, args.gloo_timeout, tmp, abort_how=how), args.out)


# ----------------------------------------------------------------------------- (b) Manager


def _tiny():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt


def fixed_comm_hook(manager, bucket):
    """torchft.ddp.DistributedDataParallel._comm_hook, but it survives a failed allreduce: in torchft
    0.2.0 a peer's death makes _ManagedWork.wait() return False before its future chain is set, and the
    hook's `assert fut._fut` then kills the survivor. Here the bucket is returned as it is (should_commit
    then answers False and the step is dropped)."""
    import torch

    buf = bucket.buffer()
    manager.allreduce(buf).wait()  # divides by the participants on success; reports the error otherwise
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def child_mgr(name, rank, lighthouse, steps, kill_at, sleep_s, out, min_rep, timeout_s, async_quorum,
              stop_at_step=None, hook="torchft"):
    import torch
    import torch.distributed as dist
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo

    T = timedelta(seconds=timeout_s)
    model, opt = _tiny()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    res = {"name": name, "pid": os.getpid(), "started_at": time.time(), "steps": []}
    t = time.perf_counter()
    manager = Manager(
        pg=ProcessGroupGloo(timeout=T), min_replica_size=min_rep,
        load_state_dict=lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["opt"])),
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
        use_async_quorum=async_quorum, timeout=T, quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10), rank=0, world_size=1, store_addr="127.0.0.1",
        store_port=store.port, lighthouse_addr=lighthouse, replica_id=name, hostname="127.0.0.1",
    )
    res["manager_init_s"] = round(time.perf_counter() - t, 4)
    if hook == "fixed":  # what torchft's DDP wrapper does, with the hook above
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torchft.process_group import ProcessGroupDummy

        ddp = DDP(model, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True)
        ddp.register_comm_hook(manager, fixed_comm_hook)
    else:
        ddp = DistributedDataParallel(manager, model)
    g = torch.Generator().manual_seed(rank)
    res["listening_after_init"] = listening()
    i = 0
    deadline = time.time() + 240

    def more():
        return manager.current_step() < stop_at_step if stop_at_step else i < steps

    while more() and time.time() < deadline:
        ta = time.perf_counter()
        manager.start_quorum()
        opt.zero_grad()
        if not async_quorum:
            manager.wait_quorum()
        tb = time.perf_counter()
        if kill_at is not None and manager.current_step() == kill_at:
            write_out(out, dict(res, killed_at=time.time(), killed_step=manager.current_step()))
            os.kill(os.getpid(), signal.SIGKILL)  # dies mid-step: after the quorum, before the allreduce
        x = torch.randn(32, 64, generator=g)
        loss = ddp(x).pow(2).mean()
        loss.backward()
        tc = time.perf_counter()
        ok = manager.should_commit()
        if ok:
            opt.step()
        td = time.perf_counter()
        res["steps"].append({"i": i, "step": manager.current_step(), "committed": ok, "t": time.time(),
                             "quorum_s": tb - ta, "fwd_bwd_allreduce_s": tc - tb, "commit_s": td - tc,
                             "total_s": td - ta, "participants": manager.num_participants(),
                             "errored": bool(manager.errored())})
        i += 1
        if sleep_s:
            time.sleep(sleep_s)
    res["listening_at_end"] = listening()
    res["final_param_sum"] = float(sum(p.double().sum() for p in model.parameters()))
    res["final_step"] = manager.current_step()
    write_out(out, res)
    manager.shutdown(wait=False)


def child_ddp(rank, world, port, steps, out):
    """The same tiny model under plain torch DDP (gloo) for the overhead baseline."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model, opt = _tiny()
    ddp = DDP(model)
    g = torch.Generator().manual_seed(rank)
    tot = []
    for _ in range(steps):
        ta = time.perf_counter()
        opt.zero_grad()
        ddp(torch.randn(32, 64, generator=g)).pow(2).mean().backward()
        opt.step()
        tot.append(time.perf_counter() - ta)
    write_out(out, {"rank": rank, "total_s": tot})
    dist.destroy_process_group()


def lighthouse(min_replicas, heartbeat_timeout_ms, join_timeout_ms):
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            quorum_tick_ms=100, heartbeat_timeout_ms=heartbeat_timeout_ms)


def summarize_steps(steps, skip=3):
    s = [x for x in steps if x["committed"]][skip:]
    return {k: med([x[k] for x in s]) for k in ("quorum_s", "fwd_bwd_allreduce_s", "commit_s", "total_s")} | {
        "total_p95_s": p95([x["total_s"] for x in s]), "n": len(s)}


def run_overhead(args, tmp, n=3, steps=40):
    import torch.distributed as dist

    out = {"part": "b-overhead", "replicas": n, "steps": steps}
    for aq in (False, True):
        lh = lighthouse(n, 5000, 60000)
        outs = [os.path.join(tmp, f"mgr-ov-{aq}-{r}.json") for r in range(n)]
        procs = [spawn("mgr", tmp, name=f"replica_{r}", rank=r, lighthouse=lh.address(), steps=steps,
                       kill_at=None, sleep_s=0, out=outs[r], min_rep=n, timeout_s=10, async_quorum=aq)
                 for r in range(n)]
        reap(procs, 240)
        lh.shutdown()
        rs = [read_out(o) or {"steps": []} for o in outs]
        allsteps = [x for r in rs for x in r["steps"]]
        out[f"torchft_async_quorum={aq}"] = summarize_steps(allsteps) | {
            "manager_init_s": [r.get("manager_init_s") for r in rs],
            "committed": [sum(x["committed"] for x in r["steps"]) for r in rs],
            "listening_per_replica_at_end": rs[0].get("listening_at_end"),
            "param_sums": [r.get("final_param_sum") for r in rs]}
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    outs = [os.path.join(tmp, f"ddp-{r}.json") for r in range(n)]
    procs = [spawn("ddp", tmp, rank=r, world=n, port=store.port, steps=steps, out=outs[r]) for r in range(n)]
    reap(procs, 240)
    tot = [x for o in outs for x in (read_out(o) or {"total_s": []})["total_s"][3:]]
    out["plain_ddp"] = {"total_s": med(tot), "total_p95_s": p95(tot), "n": len(tot)}
    return out


def run_fault(args, tmp, hb_ms, hook, n=3, kill_at=20, target=250, sleep_s=0.05):
    lh = lighthouse(2, hb_ms, 60000)
    outs = {f"replica_{r}": os.path.join(tmp, f"mgr-f{hb_ms}-{hook}-{r}.json") for r in range(n)}
    common = dict(lighthouse=lh.address(), steps=0, sleep_s=sleep_s, min_rep=2, timeout_s=10,
                  async_quorum=False, stop_at_step=target, hook=hook)
    procs = {nm: spawn("mgr", tmp, name=nm, rank=r, kill_at=kill_at if r == n - 1 else None,
                       out=outs[nm], **common) for r, nm in enumerate(outs)}
    victim = f"replica_{n - 1}"
    procs[victim].wait(240)
    t_dead = time.time()
    # a replacement starts as soon as the death is seen (a warm spare would skip the import)
    repl = "replica_9"
    outs[repl] = os.path.join(tmp, f"mgr-f{hb_ms}-{hook}-9.json")
    procs[repl] = spawn("mgr", tmp, name=repl, rank=9, kill_at=None, out=outs[repl], **common)
    reap(list(procs.values()), 300)
    lh.shutdown()
    rs = {k: read_out(v) or {"steps": []} for k, v in outs.items()}
    t_kill = rs[victim].get("killed_at")
    surv = [k for k in outs if k not in (victim, repl)]
    detail = {}
    for k in surv:
        st = rs[k]["steps"]
        after = [x for x in st if x["t"] > t_kill]
        failed = [x for x in after if not x["committed"]]
        first_ok = next((x for x in after if x["committed"]), None)
        detail[k] = {
            "pid": rs[k].get("pid"), "failed_steps_after_kill": len(failed),
            "kill_to_next_commit_s": round(first_ok["t"] - t_kill, 3) if first_ok else None,
            "participants_after": sorted({x["participants"] for x in after}),
            "slowest_step_after_kill_s": round(max((x["total_s"] for x in after), default=0), 3),
            "final_step": rs[k].get("final_step"), "final_param_sum": rs[k].get("final_param_sum"),
        }
    r9 = rs[repl]["steps"]
    first = r9[0] if r9 else None
    return {
        "part": "b-fault", "heartbeat_timeout_ms": hb_ms, "ddp_comm_hook": hook, "kill_at_step": kill_at,
        "step_sleep_s": sleep_s,
        "victim_killed_step": rs[victim].get("killed_step"), "survivors": detail,
        "replacement": {
            "process_start_to_manager_ready_s": round(rs[repl]["started_at"] - t_dead, 3)
            if "started_at" in rs[repl] else None,
            "manager_init_s": rs[repl].get("manager_init_s"),
            "first_quorum_incl_heal_s": round(first["quorum_s"], 3) if first else None,
            "first_step_after_heal": first["step"] if first else None,
            "healed_committed": first["committed"] if first else None,
            "process_spawn_to_first_commit_s": round(next(x["t"] for x in r9 if x["committed"]) - t_dead, 3)
            if any(x["committed"] for x in r9) else None,
            "final_step": rs[repl].get("final_step"), "final_param_sum": rs[repl].get("final_param_sum"),
        },
        "exit_codes": {k: p.returncode for k, p in procs.items()},
    }


def probe_no_lighthouse():
    """Can a Manager start with no Lighthouse listening? (a closed port, connect_timeout 3 s)"""
    import socket

    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    t = time.perf_counter()
    try:
        Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=None, state_dict=None,
                rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                lighthouse_addr=f"http://127.0.0.1:{port}", connect_timeout=timedelta(seconds=3),
                hostname="127.0.0.1")
        r = "started"
    except Exception as e:  # noqa: BLE001
        r = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return {"part": "b-no-lighthouse", "result": r, "after_s": round(time.perf_counter() - t, 2)}


def part_manager(args, tmp):
    if not args.skip_overhead:
        emit(probe_no_lighthouse(), args.out)
        emit(run_overhead(args, tmp), args.out)
    for hook in args.hook:
        for hb in args.heartbeat_ms:
            emit(run_fault(args, tmp, hb, hook), args.out)


# ----------------------------------------------------------------------------- (b) a quorum from outside


def _grpc_modules(tmp):
    """Compile PROTO (the LighthouseService part of torchft's proto/torchft.proto) with grpcio-tools."""
    from grpc_tools import protoc

    src = os.path.join(tmp, "proto")
    os.makedirs(src, exist_ok=True)
    with open(os.path.join(src, "torchft.proto"), "w") as f:
        f.write(PROTO)
    import grpc_tools

    inc = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    rc = protoc.main(["protoc", f"-I{src}", f"-I{inc}", f"--python_out={src}", f"--grpc_python_out={src}",
                      os.path.join(src, "torchft.proto")])
    assert rc == 0, rc
    sys.path.insert(0, src)
    import torchft_pb2
    import torchft_pb2_grpc

    return torchft_pb2, torchft_pb2_grpc


# The LighthouseService messages of meta-pytorch/torchft proto/torchft.proto (the part a Lighthouse serves).
PROTO = """
syntax = "proto3";
package torchft;
import "google/protobuf/timestamp.proto";
message QuorumMember {
  string replica_id = 1; string address = 2; string store_address = 3; int64 step = 4;
  uint64 world_size = 5; bool shrink_only = 6; int64 commit_failures = 8; string data = 7;
}
message Quorum { int64 quorum_id = 1; repeated QuorumMember participants = 2; google.protobuf.Timestamp created = 3; }
message LighthouseQuorumRequest { QuorumMember requester = 1; }
message LighthouseQuorumResponse { Quorum quorum = 1; }
message LighthouseHeartbeatRequest { string replica_id = 1; }
message LighthouseHeartbeatResponse {}
service LighthouseService {
  rpc Quorum(LighthouseQuorumRequest) returns (LighthouseQuorumResponse);
  rpc Heartbeat(LighthouseHeartbeatRequest) returns (LighthouseHeartbeatResponse);
}
"""


class ExternalQuorum:
    """A LighthouseService whose membership is decided outside (here: a set the parent edits, as the
    Dask scheduler would): a quorum is returned once every member of the current membership has asked."""

    def __init__(self, pb, pbg, members):
        from concurrent import futures

        import grpc

        self.pb, self.members, self.cv = pb, set(members), threading.Condition()
        self.waiting, self.answers, self.quorum_id, self.served, self.prev_ids = {}, {}, 0, [], None
        outer = self

        class Svc(pbg.LighthouseServiceServicer):
            def Quorum(self, request, context):
                return outer.quorum(request.requester)

            def Heartbeat(self, request, context):
                return outer.pb.LighthouseHeartbeatResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        pbg.add_LighthouseServiceServicer_to_server(Svc(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def base(self, rid):
        return rid.split(":")[0]  # the Manager appends ":uuid" to the replica_id

    def set_members(self, members):
        with self.cv:
            self.members = set(members)
            self.cv.notify_all()

    def quorum(self, member):
        rid = self.base(member.replica_id)
        with self.cv:
            self.waiting[rid] = member
            self.answers.pop(rid, None)
            while rid not in self.answers:
                if self.members and self.members <= set(self.waiting):
                    parts = [self.waiting.pop(m) for m in sorted(self.members)]
                    ids = [p.replica_id for p in parts]
                    # as torchft's Lighthouse: a new quorum_id (a PG reconfigure) only when the members
                    # changed or one of them reports a failed commit
                    if ids != self.prev_ids or any(p.commit_failures > 0 for p in parts):
                        self.quorum_id += 1
                    self.prev_ids = ids
                    resp = self.pb.LighthouseQuorumResponse(
                        quorum=self.pb.Quorum(quorum_id=self.quorum_id, participants=parts))
                    for m in self.members:
                        self.answers[m] = resp
                    self.served.append((time.time(), self.quorum_id, sorted(self.members)))
                    self.cv.notify_all()
                    break
                self.cv.wait(0.05)
            return self.answers.pop(rid)


def part_quorum(args, tmp, n=3, kill_at=20, target=400, sleep_s=0.02):
    pb, pbg = _grpc_modules(tmp)
    names = [f"replica_{r}" for r in range(n)]
    q = ExternalQuorum(pb, pbg, names)
    addr = f"http://127.0.0.1:{q.port}"
    outs = {nm: os.path.join(tmp, f"mgr-q-{r}.json") for r, nm in enumerate(names)}
    common = dict(lighthouse=addr, steps=0, sleep_s=sleep_s, min_rep=2, timeout_s=10, async_quorum=False,
                  stop_at_step=target, hook="fixed")
    procs = {nm: spawn("mgr", tmp, name=nm, rank=r, kill_at=kill_at if r == n - 1 else None, out=outs[nm],
                       **common) for r, nm in enumerate(names)}
    victim = names[-1]
    procs[victim].wait(240)
    t_seen = time.time()
    q.set_members(names[:-1])  # what the scheduler's remove-worker would say
    # a replacement: admitted to the membership once it has asked for a quorum (it is ready)
    repl = "replica_9"
    outs[repl] = os.path.join(tmp, "mgr-q-9.json")
    procs[repl] = spawn("mgr", tmp, name=repl, rank=9, kill_at=None, out=outs[repl], **common)
    t_admit = None
    while time.time() < t_seen + 120 and procs[repl].poll() is None:
        with q.cv:
            asked = repl in q.waiting
        if asked:
            q.set_members(names[:-1] + [repl])
            t_admit = time.time()
            break
        time.sleep(0.01)
    reap(list(procs.values()), 240)
    q.server.stop(0)
    rs = {k: read_out(v) or {"steps": []} for k, v in outs.items()}
    t_kill = rs[victim].get("killed_at")
    detail = {}
    for k in names[:-1]:
        after = [x for x in rs[k]["steps"] if x["t"] > t_kill]
        ok = next((x for x in after if x["committed"]), None)
        detail[k] = {"failed_steps_after_kill": sum(not x["committed"] for x in after),
                     "kill_to_next_commit_s": round(ok["t"] - t_kill, 3) if ok else None,
                     "participants_after": sorted({x["participants"] for x in after}),
                     "final_step": rs[k].get("final_step"), "final_param_sum": rs[k].get("final_param_sum")}
    r9 = rs[repl]["steps"]
    res = {"part": "b-external-quorum", "kill_seen_after_s": round(t_seen - t_kill, 3) if t_kill else None,
           "quorums_served": len(q.served), "quorum_ids": sorted({x[1] for x in q.served}), "survivors": detail,
           "median_quorum_s_before_kill": med([x["quorum_s"] for k in names[:-1] for x in rs[k]["steps"]
                                               if x["t"] < (t_kill or 0)][3:]),
           "replacement": {"spawn_to_admitted_s": round(t_admit - t_seen, 3) if t_admit else None,
                           "admitted_to_first_commit_s": round(r9[0]["t"] - t_admit, 3) if r9 and t_admit else None,
                           "first_quorum_incl_heal_s": round(r9[0]["quorum_s"], 3) if r9 else None,
                           "first_step_after_heal": r9[0]["step"] if r9 else None,
                           "healed_committed": r9[0]["committed"] if r9 else None,
                           "final_step": rs[repl].get("final_step"),
                           "final_param_sum": rs[repl].get("final_param_sum")},
           "exit_codes": {k: p.returncode for k, p in procs.items()}}
    emit(res, args.out)


# ----------------------------------------------------------------------------- (c) peer transfer


def _state(nbytes, fill):
    import torch

    n = 12
    per = nbytes // n // 4
    return {f"layer{i}.weight": torch.full((per,), float(fill + i)) for i in range(n)}


def child_xfer(kind, rank, port, nbytes, reps, out):
    import torch
    import torch.distributed as dist

    T = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=T)
    sd = _state(nbytes, 1 if rank == 0 else 0)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    times, ok = [], True
    if kind.startswith("http"):
        from torchft.checkpointing import HTTPTransport

        tr = HTTPTransport(timeout=T, num_chunks=int(kind[4:] or 0))
        for i in range(reps):
            if rank == 0:
                tr.send_checkpoint([1], step=i, state_dict=sd, timeout=T)
                store.set(f"meta/{i}", tr.metadata())
                store.wait([f"done/{i}"], T)
                tr.disallow_checkpoint()
            else:
                meta = store.get(f"meta/{i}").decode()
                t = time.perf_counter()
                got = tr.recv_checkpoint(0, meta, i, T)
                times.append(time.perf_counter() - t)
                ok &= all(float(got[k][0]) == 1.0 + j for j, k in enumerate(sd))
                store.set(f"done/{i}", "1")
        res_meta = {"address": tr.metadata()} if rank == 0 else {}
        tr.shutdown(wait=False)
    elif kind.startswith("pg"):
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.process_group import ProcessGroupGloo

        pg = ProcessGroupGloo(timeout=T)
        pg.configure(f"127.0.0.1:{port}/pgx", "0", rank, 2)
        pg.allreduce([torch.ones(1)], dist.ReduceOp.SUM).wait()
        tr = PGTransport(pg, timeout=T, device=torch.device("cpu"),
                         state_dict=(lambda: sd) if kind == "pg_inplace" else None)
        for i in range(reps):
            pg.allreduce([torch.ones(1)], dist.ReduceOp.SUM).wait()  # line up
            t = time.perf_counter()
            if rank == 0:
                tr.send_checkpoint([1], step=i, state_dict=sd, timeout=T)
            else:
                got = tr.recv_checkpoint(0, "<n/a>", i, T)
                times.append(time.perf_counter() - t)
                ok &= all(float(got[k][0]) == 1.0 + j for j, k in enumerate(sd))
        res_meta = {}
    else:  # plain c10d broadcast over gloo, tensor by tensor (bcast) or one flat buffer (bcast_flat)
        dist.init_process_group("gloo", store=dist.PrefixStore("b", store), rank=rank, world_size=2, timeout=T)
        for i in range(reps):
            for t_ in sd.values():
                t_.fill_(1 if rank == 0 else 0)  # (the sender's cat for bcast_flat is inside the timing)
            dist.barrier()
            t = time.perf_counter()
            if kind == "bcast_flat":
                flat = torch.cat(list(sd.values())) if rank == 0 else torch.empty(total // 4)
                dist.broadcast(flat, src=0)
                if rank == 1:
                    for dst, src in zip(sd.values(), torch.split(flat, [v.numel() for v in sd.values()])):
                        dst.copy_(src)
            else:
                for t_ in sd.values():
                    dist.broadcast(t_, src=0)
            if rank == 1:
                times.append(time.perf_counter() - t)
                ok &= all(float(v[0]) == 1.0 for v in sd.values())
        dist.destroy_process_group()
        res_meta = {}
    write_out(out, {"rank": rank, "times": times, "bytes": total, "ok": bool(ok), **res_meta})


def part_transfer(args, tmp):
    import torch.distributed as dist

    for kind in ("http", "http4", "pg", "pg_inplace", "bcast", "bcast_flat"):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        outs = [os.path.join(tmp, f"xfer-{kind}-{r}.json") for r in range(2)]
        procs = [spawn("xfer", tmp, kind=kind, rank=r, port=store.port, nbytes=args.mb * 1_000_000,
                       reps=args.reps, out=outs[r]) for r in range(2)]
        reap(procs, 240)
        r0, r1 = read_out(outs[0]) or {}, read_out(outs[1]) or {}
        times = r1.get("times", [])
        b = r1.get("bytes", 0)
        emit({"part": "c", "kind": kind, "bytes": b, "times_s": [round(t, 3) for t in times],
              "median_MB_per_s": round(b / 1e6 / statistics.median(times), 1) if times else None,
              "ok": r1.get("ok"), "sender_address": r0.get("address"),
              "exit_codes": [p.returncode for p in procs]}, args.out)


# ----------------------------------------------------------------------------- main

CHILDREN = {"pg": child_pg, "mgr": child_mgr, "ddp": child_ddp, "xfer": child_xfer}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        CHILDREN[sys.argv[2]](**json.loads(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=["pg", "manager", "quorum", "transfer", "all"])
    ap.add_argument("--out", help="append the JSON lines here")
    ap.add_argument("--gloo-timeout", type=float, default=10.0)
    ap.add_argument("--heartbeat-ms", type=int, nargs="+", default=[500, 5000])
    ap.add_argument("--impl", nargs="+", help="pg: only these of ft, plain, baby")
    ap.add_argument("--abort-how", nargs="+", help="pg: only these of api, sockets")
    ap.add_argument("--hook", nargs="+", default=["torchft", "fixed"],
                    help="manager: the DDP comm hook, torchft's own or the fixed one")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (logs)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="torchft_eval_")
    print(f"# logs in {tmp}", flush=True)
    parts = {"pg": part_pg, "manager": part_manager, "quorum": part_quorum, "transfer": part_transfer}
    for name in (parts if args.part == "all" else [args.part]):
        parts[name](args, tmp)
    if not args.keep:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

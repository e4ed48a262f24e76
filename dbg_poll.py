import sys, time, tempfile, logging
sys.path.insert(0, "tests")
from test_preemption import train_steps
from _cluster import local_client, run, wait_until
if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("dask_ddp").setLevel(logging.INFO)
    for i in range(4):
        with local_client(2) as c:
            d = tempfile.mkdtemp()
            job = run(c, train_steps, 60, checkpoint_dir=d, workers=(1, 2), register=False)
            wait_until(lambda: len(job.metrics) >= 20, 120)
            c.retire_workers([job.plan.addresses[1]])
            try:
                job.result(timeout=180)
            except Exception as e:
                print("ERR", repr(e)[:300])
            print("HIST", job.history[1][3])
            if "saved step" not in job.history[1][3]:
                print("\n".join(l for l in job.logs if "frame" not in l and "Exception raised" not in l)[-5000:])
                break

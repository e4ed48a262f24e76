"""Ray Tune's side of ``bench_sweep.py``: the same trivial trials (a ``--work`` s function, its value reported
once) under Ray Tune, locally, on ``--slots`` CPUs; prints one JSON line ``{"wall", "ray", "trials"}``.

Run by ``bench_sweep.py`` with the interpreter of a separate virtual environment that has ``ray[tune]`` (Ray
pins versions that must not enter the project's environment)::

    python3 -m venv /work/bench-venv-ray && /work/bench-venv-ray/bin/pip install torch 'ray[tune]' optuna
    /work/bench-venv-ray/bin/python benchmarks/bench_sweep_ray.py --trials 200 --work 0.1

The wall time is ``Tuner.fit()`` alone (``ray.init`` before it is not counted), random search over the same
range, no scheduler (every trial runs to its end), at most ``--slots`` trials at once (one CPU each).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--work", type=float, default=0.1)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--reuse-actors", action="store_true", help="Tune's reuse_actors=True (default: Tune's own)")
    args = parser.parse_args()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray
    from ray import tune

    work = args.work

    def objective(config):
        time.sleep(work)
        tune.report({"value": config["x"] ** 2})

    ray.init(num_cpus=args.slots, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    with tempfile.TemporaryDirectory() as storage:
        tuner = tune.Tuner(tune.with_resources(objective, {"cpu": 1}), param_space={"x": tune.uniform(-1.0, 1.0)},
                           tune_config=tune.TuneConfig(num_samples=args.trials, max_concurrent_trials=args.slots,
                                                       metric="value", mode="min",
                                                       reuse_actors=True if args.reuse_actors else None),
                           run_config=tune.RunConfig(storage_path=storage, verbose=0))
        t = time.perf_counter()
        results = tuner.fit()
        wall = time.perf_counter() - t
    done = sum(1 for r in results if r.error is None)
    print(json.dumps({"wall": wall, "ray": ray.__version__, "trials": done, "reuse_actors": args.reuse_actors}),
          flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()

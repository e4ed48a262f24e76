#!/usr/bin/env bash
# The GPU checks of a session on a lent GPU machine (see the README's GPU section): the GPU tests, the demo on
# LocalCUDACluster and jobs in a row with nccl (part "checks"), then one GPU rank beside torchrun (part "bench",
# benchmarks/bench_gpu.py). Usage: bash benchmarks/gpu_session.sh [checks|bench|all]. Wheels for what the machine
# lacks are carried in .whl/.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, dask, distributed, dask_cuda; print('torch', torch.__version__, 'dask', dask.__version__, 'dask-cuda', dask_cuda.__version__)"
part=${1:-all}
if [ "$part" = checks ] || [ "$part" = all ]; then
  echo "== pytest -m gpu"
  timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_devices.py tests/test_examples.py \
    $(ls tests/test_telemetry.py tests/test_telemetry_gpu.py 2>/dev/null) 2>&1 | tail -25
  echo "== dask-ddp demo (LocalCUDACluster)"
  ( time timeout 240 python3 -m dask_ddp.cli demo ) 2>&1 | grep -v "^\[rank" | tail -20
  echo "== jobs in a row, nccl"
  timeout 200 python3 benchmarks/gpu_jobs.py --jobs 5 2>&1 | grep -v "INFO\|^\[rank" | tail -8
fi
if [ "$part" = bench ] || [ "$part" = all ]; then
  echo "== one GPU rank beside torchrun"
  timeout 540 python3 benchmarks/bench_gpu.py --images 512 --repeats 2 --out "${OUT:-/tmp}/RESULTS_gpu.md" 2>&1 \
    | grep -v "INFO\|^\[rank" | tail -30
fi

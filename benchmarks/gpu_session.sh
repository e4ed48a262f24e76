#!/usr/bin/env bash
# The GPU checks of a session on a lent GPU machine (see the README's GPU section): the GPU tests, the demo on
# LocalCUDACluster and jobs in a row with nccl. Wheels for what the machine lacks are carried in .whl/.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, dask, distributed, dask_cuda; print('torch', torch.__version__, 'dask', dask.__version__, 'dask-cuda', dask_cuda.__version__)"
echo "== pytest -m gpu"
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_devices.py tests/test_examples.py 2>&1 | tail -25
echo "== dask-ddp demo (LocalCUDACluster)"
( time timeout 240 python3 -m dask_ddp.cli demo ) 2>&1 | grep -v "^\[rank" | tail -20
echo "== jobs in a row, nccl"
timeout 200 python3 benchmarks/gpu_jobs.py --jobs 5 2>&1 | grep -v "INFO\|^\[rank" | tail -8

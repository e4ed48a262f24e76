#!/usr/bin/env bash
# The GPU checks of a session on a lent GPU machine (see docs/guide/kubernetes.md): the GPU tests and the demo on
# LocalCUDACluster (part "checks"; "tests": the GPU tests alone; "decode": the GPU decode test alone), jobs in a row with nccl ("jobs"), one GPU rank beside torchrun ("bench",
# benchmarks/bench_gpu.py), JPEG decoding on the GPU vs the CPU path ("stream", bench_streaming_gpu.py) and 200
# early-stopped sweep trials with GPU memory read by NVML ("sweep", bench_sweep_gpu.py). Usage:
# bash benchmarks/gpu_session.sh [PART ...] (default: checks stream sweep). Each part has its own time limit, so
# one that hangs leaves the others their time; logs and tables go to $OUT. Wheels for what the machine lacks are
# carried in .whl/ (see the README's GPU section for the list).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
nvidia-smi -L
python3 -c "import torch, dask, distributed, dask_cuda; print('torch', torch.__version__, 'dask', dask.__version__, 'dask-cuda', dask_cuda.__version__)"
gpu_tests() {  # the GPU tests, within $1 seconds
  timeout "$1" python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_devices.py tests/test_examples.py \
    tests/test_telemetry_gpu.py tests/test_idioms.py tests/test_gpu_decode.py tests/test_warm_cuda.py tests/test_trainers_gpu.py 2>&1 | tail -25
}
parts=${*:-checks stream sweep}
for part in $parts; do
  echo "== $(date +%T) $part"
  case $part in
    checks)
      gpu_tests 150
      echo "== $(date +%T) dask-ddp demo (LocalCUDACluster)"
      ( time timeout 90 python3 -m dask_ddp.cli demo ) 2>&1 | grep -v "^\[rank" | tail -12 ;;
    tests) gpu_tests 130 ;;
    decode) timeout 60 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_gpu_decode.py 2>&1 | tail -15 ;;
    parts) timeout 120 python3 benchmarks/gpu_turnover_parts.py --repeats 5 --frac 0.3 2>&1 | tail -30 ;;
    jobs) timeout 200 python3 benchmarks/gpu_jobs.py --jobs 5 2>&1 | grep -v "INFO\|^\[rank" | tail -8 ;;
    bench) timeout 540 python3 benchmarks/bench_gpu.py --images 512 --repeats 2 --out "$out/RESULTS_gpu.md" 2>&1 \
        | grep -v "INFO\|^\[rank" | tail -30 ;;
    stream) timeout 110 python3 benchmarks/bench_streaming_gpu.py --images 3000 --small 10000 --workers 4,12 \
        --rounds 2 --out "$out/RESULTS_streaming_gpu.md" 2>&1 | grep -v "INFO" | tail -30 ;;
    sweep) timeout 180 python3 benchmarks/bench_sweep_gpu.py --trials 200 --workers 3 --frac 0.3 \
        --out "$out/RESULTS_sweep_gpu.md" 2>&1 | grep -v "INFO\|^\[rank" | tail -40 ;;
    sweeps)  # the turnover with CUDA started ahead (the default), without it, and with a DDP model in each trial
      for v in "" --cold --ddp "--ddp --cold"; do
        timeout 120 python3 benchmarks/bench_sweep_gpu.py --trials 100 --workers 3 --frac 0.3 $v \
          --out "$out/RESULTS_sweep_gpu${v// /}.md" 2>&1 | grep -v "INFO\|^\[rank" | grep "decision\|OOM\|wall\|states"
      done ;;
    *) echo "unknown part $part" ;;
  esac
done
echo "== $(date +%T) done"

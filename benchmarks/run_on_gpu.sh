#!/usr/bin/env bash
# Build, GPU tests and the full benchmark on a CUDA machine, logs under $OUT (default ./gpu-run).
#   bash benchmarks/run_on_gpu.sh tests   # build + every GPU-marked test + a vlseq-train run
#   bash benchmarks/run_on_gpu.sh bench   # build + python -m vlseq_ext.bench (full)
#   bash benchmarks/run_on_gpu.sh dist    # build + 2 processes x 1 GPU (NCCL) vs 1 process x 2 GPUs
#   bash benchmarks/run_on_gpu.sh all
set -u
OUT=${OUT:-$PWD/gpu-run}
PY=${PYTHON:-python3}
part=${1:-all}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } > "$OUT/gpus.txt" 2>&1
if ! $PY -c "import vlseq_ext._C" 2>/dev/null; then
  $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
rc=0
if [ "$part" = tests ] || [ "$part" = all ]; then
  # pytest-xdist, when present: parallel workers, and a crashing test loses one worker, not the run.
  xdist=$($PY -c "import xdist" 2>/dev/null && echo "-n ${PYTEST_WORKERS:-6}")
  $PY -m pytest -q -p no:cacheprovider $xdist -m "requires_cuda or requires_2gpu" tests/ > "$OUT/gpu-tests.log" 2>&1 || rc=1
  tail -15 "$OUT/gpu-tests.log"
  $PY -m vlseq_ext --devices all --max-steps 600 --quiet --checkpoint-dir "$OUT/train-run" \
    --metrics "$OUT/train-metrics.jsonl" --plot "$OUT/train-loss.png" > "$OUT/train.log" 2>&1 || rc=1
  tail -20 "$OUT/train.log"
fi
if [ "$part" = dist ] || [ "$part" = all ]; then
  $PY benchmarks/distributed_check.py --out "$OUT/dist" > "$OUT/dist.log" 2>&1 || rc=1
  tail -30 "$OUT/dist.log"
fi
if [ "$part" = bench ] || [ "$part" = all ]; then
  $PY -m vlseq_ext.bench --out "$OUT/bench" > "$OUT/bench.log" 2>&1 || rc=1
  tail -80 "$OUT/bench.log"
fi
exit $rc

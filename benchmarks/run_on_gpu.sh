#!/usr/bin/env bash
# Build, then the GPU tests, the training demo and the benchmark on a CUDA machine, logs under $OUT
# (default ./gpu-run). Each part fits in a 10-minute call on 2 x H200 (tsc and tsc-cpu: estimated, not yet
# run there); `all` runs them in order.
#   bash benchmarks/run_on_gpu.sh tests    # the README's test command (whole suite, xdist when present)
#   bash benchmarks/run_on_gpu.sh train    # default vlseq-train run + vlseq-predict on its checkpoint
#   bash benchmarks/run_on_gpu.sh bench    # vlseq-bench --suite merge,flatten,diag,train (M1, M2, F1, W1, W2)
#   bash benchmarks/run_on_gpu.sh sweep    # vlseq-bench --suite sweep (W3; about 6 minutes on 2 GPUs)
#   bash benchmarks/run_on_gpu.sh dist     # 2 processes x 1 GPU (NCCL) vs 1 process x 2 GPUs
#   bash benchmarks/run_on_gpu.sh rnn      # the recurrent kernels' GPU tests, then vlseq-bench --suite rnn
#   bash benchmarks/run_on_gpu.sh tsc      # estimator tests + vlseq-bench --suite tsc on the GPU, with aeon's
#                                          # 1-NN DTW and RDST (aeon from the wheels in .whl/ when missing)
#   bash benchmarks/run_on_gpu.sh tsc-cpu  # the same suite's CPU runs of SeqClassifier (5 seeds x 2 sets)
#   bash benchmarks/run_on_gpu.sh probe    # step timings of the recurrent kernels (benchmarks/probe/step_timing.cu)
#                                          # for PROBE_CASES ("H B nc [lstm|gru] [fp32|bf16] [groups] [bt]", ';'-separated;
#                                          # built into $PROBE_BIN, again when the sources change; PROBE_PATCH=file:
#                                          # also from the sources with that diff applied, each case run on both),
#                                          # then whether their grid layout could run as clusters (benchmarks/probe/
#                                          # cluster_grid.cu) and
#                                          # what their exchange through L2 costs (benchmarks/probe/l2_exchange.cu)
#   bash benchmarks/run_on_gpu.sh windows  # what each window of a pipelined grid stack costs: the kernels of a
#                                          # replay by stream (benchmarks/probe/window_timeline.py: LSTM 1024 x 2,
#                                          # TF32, 1 and 8 samples, 1 / 4 / 8 windows) and the hidden-1024 grid
#                                          # kernels' time outside their steps (step_timing, PROBE_PATCH's kernels too,
#                                          # as in probe; WINDOW_BATCHES / WINDOW_COUNTS pick other sample
#                                          # and window counts); not part of all
#   bash benchmarks/run_on_gpu.sh exchange # the grid forward's exchange of h on its own, with its barrier and without
#                                          # (benchmarks/probe/l2_exchange.cu publish / tagged: 64 and 128 blocks,
#                                          # 2 / 16 / 32 KiB: LSTM 1024's h in fp16 at 1 / 8 / 16 samples); not part of all
#   bash benchmarks/run_on_gpu.sh products # the 16-bit forward's products phase inside one SM, its h already in shared
#                                          # memory: the landed mma.sync loop against wgmma (benchmarks/probe/
#                                          # wgmma_products.cu, 16 and 8 samples, 128 blocks); not part of all
#   bash benchmarks/run_on_gpu.sh trial    # a kernel change in one call: step timings (TRIAL_CASES) of this tree's
#                                          # kernels (and PROBE_PATCH's), the extension built (with the patch
#                                          # applied to this tree), its rnn GPU tests (TRIAL_TESTS) and, when they
#                                          # pass, vlseq-bench --suite rnn $RNN_ARGS on it; not part of all
#   bash benchmarks/run_on_gpu.sh ncu      # Nsight Compute's stall samples by step phase (benchmarks/probe/ncu_regions.py)
#                                          # of the kernels matching NCU_KERNELS (regex, default fused) in one
#                                          # step_timing run (NCU_CASE, default "64 1 1 lstm fp32 32"); not part of all
#   bash benchmarks/run_on_gpu.sh all
set -u
OUT=${OUT:-$PWD/gpu-run}
PY=${PYTHON:-python3}
part=${1:-all}
mkdir -p "$OUT"
# NVLink multicast stays off (the lent machines ask for it: it can take the host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
{ date -u; git log -1 --oneline 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'gpus', torch.cuda.device_count())"
} > "$OUT/gpus.txt" 2>&1
# Built again whenever the sources differ from those of the installed build: a machine kept warm
# between calls keeps the last call's extension, and its sources may have changed since (the
# eleventh session's last suite ran on the previous call's kernels that way).
# One sha1 of every file under the paths given (relative to the current directory).
sources_sum() { find "$@" -type f | sort | xargs sha1sum | sha1sum | cut -d' ' -f1; }
stamp=build/vlseq-sources.sha1
build_extension() {
  local sources
  sources=$(sources_sum csrc setup.py)
  if ! $PY -c "import vlseq_ext._C" 2>/dev/null || [ "$(cat "$stamp" 2>/dev/null)" != "$sources" ]; then
    MAX_JOBS=${MAX_JOBS:-32} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
      $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
    mkdir -p build && echo "$sources" > "$stamp"
  fi
  echo "extension built from sources $sources" >> "$OUT/gpus.txt"
}
# (`exchange` and `products` run probes of their own: no extension needed; `trial` builds it once its patch is applied)
[ "$part" = exchange ] || [ "$part" = products ] || [ "$part" = trial ] || build_extension
rc=0
runs() { [ "$part" = "$1" ] || [ "$part" = all ]; }
if runs tests || runs tsc || runs tsc-cpu; then
  # aeon is optional: without it, the wheels carried in .whl/ (README, "Estimators") go to /tmp/site,
  # for the tests too (the estimators' tests skip without aeon, which a suite's count hides).
  if ! $PY -c "import aeon" 2>/dev/null && ls .whl/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$OUT/aeon-install.log" 2>&1 \
      || { tail -20 "$OUT/aeon-install.log"; rc=1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  $PY -c "import aeon; print('aeon', aeon.__version__)" || { runs tests || rc=1; }
fi
if runs tests; then
  xdist=$($PY -c "import xdist" 2>/dev/null && echo "-n ${PYTEST_WORKERS:-16}")
  $PY -m pytest -q -p no:cacheprovider $xdist tests/ > "$OUT/tests.log" 2>&1 || rc=1
  tail -15 "$OUT/tests.log"
fi
if runs train; then
  rm -rf "$OUT/train-run"
  $PY -m vlseq_ext --quiet --checkpoint-dir "$OUT/train-run" --metrics "$OUT/train-metrics.jsonl" \
    --plot "$OUT/train-loss.png" > "$OUT/train.log" 2>&1 || rc=1
  tail -25 "$OUT/train.log"
  # 300 samples of the training run's own data set (synthetic draws its task from the seed and the
  # sample count): this checks the predict path on every GPU, not generalization.
  $PY -c "
from vlseq_ext import data
ds = data.synthetic()
data.save_ragged('$OUT/new.npz', [ds[i][0] for i in range(300)], [ds[i][1] for i in range(300)])" &&
  $PY -m vlseq_ext predict --checkpoint "$OUT/train-run" --data "$OUT/new.npz" --out "$OUT/predictions.csv" \
    --metrics "$OUT/predict-metrics.json" --overwrite --quiet > "$OUT/predict.log" 2>&1 || rc=1
  tail -5 "$OUT/predict.log"; cat "$OUT/predict-metrics.json" 2>/dev/null; echo
fi
if runs bench; then
  $PY -m vlseq_ext.bench --suite merge,flatten,diag,train --out "$OUT/bench" > "$OUT/bench.log" 2>&1 || rc=1
  tail -80 "$OUT/bench.log"
fi
if runs sweep; then
  $PY -m vlseq_ext.bench --suite sweep ${SWEEP_ARGS:-} --out "$OUT/sweep" > "$OUT/sweep.log" 2>&1 || rc=1
  tail -60 "$OUT/sweep.log"
fi
if runs rnn; then
  # A kernel that deadlocked would hang the call: `timeout` ends it with what the logs hold so far.
  timeout ${RNN_TEST_TIMEOUT:-300} $PY -m pytest -q -p no:cacheprovider -x tests/test_rnn_gpu.py tests/test_rnn_ops.py \
    tests/test_rnn_modules.py > "$OUT/rnn-tests.log" 2>&1 || rc=1
  tail -30 "$OUT/rnn-tests.log"
  timeout ${RNN_BENCH_TIMEOUT:-420} $PY -m vlseq_ext.bench --suite rnn ${RNN_ARGS:-} --out "$OUT/rnn" \
    > "$OUT/rnn-bench.log" 2>&1 || rc=1
  tail -40 "$OUT/rnn-bench.log"
fi
# The step-timing probe (benchmarks/probe/step_timing.cu), built into $bin (probe, windows, ncu);
# -lineinfo maps ncu's samples to source lines and leaves the SASS as it is.
# The -I flags of torch's and Python's headers, which the probes that include the kernels' headers need.
torch_includes() {
  $PY -c "import sysconfig; from torch.utils.cpp_extension import include_paths as p
print(' '.join('-I' + i for i in [*p(), sysconfig.get_paths()['include']]))"
}
bin=${PROBE_BIN:-/tmp/vlseq_step_timing}
build_probe() {  # [binary] [source tree]: the probe of the tree's kernels (default: this one's) into the binary,
  # again whenever the tree's sources differ from those it was built from (a warm machine keeps the last call's)
  local out=${1:-$bin} tree=${2:-.} sums log
  log="$OUT/$(basename "$out")-build.log"
  sums=$(cd "$tree" && sources_sum csrc benchmarks/probe)
  # (a binary that this function did not build, named by PROBE_BIN, is taken as it is)
  [ -x "$out" ] && { [ ! -e "$out.sources" ] || [ "$(cat "$out.sources")" = "$sums" ]; } && return
  rm -f "$out" "$out.sources"
  ${NVCC:-nvcc} -std=c++20 -arch=sm_90a -lineinfo -O3 -o "$out" "$tree/benchmarks/probe/step_timing.cu" \
    -I"$tree/csrc/include" -I"$tree/csrc/cuda" $(torch_includes) > "$log" 2>&1 &&
    echo "$sums" > "$out.sources" || { tail -20 "$log"; rc=1; }
}
# PROBE_PATCH=file (a diff against this tree, `git diff` style): the probe is also built from a copy of csrc and
# benchmarks/probe with the patch applied, and `probe` / `windows` run their step timings on both, the patched
# kernels' after this tree's: the A/B of a kernel change in one call, without rebuilding the extension.
bin_b=/tmp/vlseq_step_timing_patched
# A copy of the csrc and benchmarks/probe of tree $3 (default this one) in $1, with the diff $2 applied when given
# (only its changes to those two: a patch that also changes tests, as the trial's do, applies too).
copy_probe_tree() {
  local tree=$1 from=${3:-.} diff
  rm -rf "$tree" && mkdir -p "$tree/benchmarks" && cp -r "$from/csrc" "$tree/" && cp -r "$from/benchmarks/probe" "$tree/benchmarks/" ||
    return 1
  [ -z "${2:-}" ] || { diff=$(realpath "$2") && (cd "$tree" && git apply --include='csrc/*' --include='benchmarks/probe/*' "$diff"); } ||
    { echo "PROBE_PATCH $2 does not apply"; rc=1; return 1; }
}
build_probe_patched() {  # [source tree]: PROBE_PATCH applied to a copy of it (default this one)
  [ -n "${PROBE_PATCH:-}" ] || return 1
  copy_probe_tree /tmp/vlseq-probe-patched "$PROBE_PATCH" "${1:-.}" && build_probe "$bin_b" /tmp/vlseq-probe-patched
}
# Both probes at once (nvcc compiles the probe on one core for ~2 minutes) from a source tree (default this
# one); fails unless each was built.
build_probes() {
  build_probe_patched "${1:-.}" > "$OUT/probe-patched.log" 2>&1 &
  build_probe "$bin" "${1:-.}"
  wait
  cat "$OUT/probe-patched.log"
  [ -x "$bin" ] && { [ -z "${PROBE_PATCH:-}" ] || [ -x "$bin_b" ]; }
}
# Runs step_timing for each line of stdin ("H B nc ..."), on this tree's kernels and, with PROBE_PATCH, the patched.
step_timings() {
  local t=$1
  while read -r args; do
    echo "== step_timing $args"; timeout "$t" "$bin" $args < /dev/null
    if [ -n "${PROBE_PATCH:-}" ] && [ -x "$bin_b" ]; then
      echo "== step_timing $args (PROBE_PATCH)"; timeout "$t" "$bin_b" $args < /dev/null
    fi
  done
}
# The exchange probe (benchmarks/probe/l2_exchange.cu) into /tmp/vlseq_l2_exchange, nvcc's output to $OUT/$1.
build_l2_exchange() {
  ${NVCC:-nvcc} -std=c++20 -arch=sm_90a -O3 -o /tmp/vlseq_l2_exchange benchmarks/probe/l2_exchange.cu > "$OUT/$1" 2>&1
}
if runs probe; then
  build_probes || rc=1
  echo "${PROBE_CASES:-256 1 16;256 4 16;256 8 16;256 1 16 gru;256 8 16 gru;128 1 16;64 1 1;1024 32 128;1024 1 128}" | tr ';' '\n' |
    step_timings 30 > "$OUT/step-timing.log" 2>&1 || rc=1
  cat "$OUT/step-timing.log"
  # Whether the grid kernels could run as clusters (benchmarks/probe/cluster_grid.cu).
  ${NVCC:-nvcc} -std=c++20 -arch=sm_90a -o /tmp/vlseq_cluster_grid benchmarks/probe/cluster_grid.cu \
    > "$OUT/cluster-grid.log" 2>&1 && timeout 60 /tmp/vlseq_cluster_grid >> "$OUT/cluster-grid.log" 2>&1 || rc=1
  cat "$OUT/cluster-grid.log"
  # What the grid kernels' exchange through L2 costs on its own (benchmarks/probe/l2_exchange.cu).
  build_l2_exchange l2-exchange.log || rc=1
  for m in none same rotate distinct bulk write gather; do timeout 30 /tmp/vlseq_l2_exchange $m; done >> "$OUT/l2-exchange.log" 2>&1
  # Clusters of 4 and 8 at one block per SM: 30 and 15 fit on an H200 (120 blocks), so not 128.
  for bc in "128 2" "120 4" "120 8"; do read -r nb cs <<< "$bc"; timeout 30 /tmp/vlseq_l2_exchange multicast $nb 128 200 $cs; done \
    >> "$OUT/l2-exchange.log" 2>&1
  cat "$OUT/l2-exchange.log"
fi
if [ "$part" = windows ]; then
  build_probes > "$OUT/probes.log" 2>&1 &  # on the CPU while the timelines replay on the GPU
  probes=$!
  for b in ${WINDOW_BATCHES:-1 8}; do
    for w in ${WINDOW_COUNTS:-1 4 8}; do timeout 120 $PY benchmarks/probe/window_timeline.py --batch $b --windows $w $([ $w = 4 ] && echo --list); done
  done > "$OUT/window-timeline.log" 2>&1 || rc=1
  grep -v "^  " "$OUT/window-timeline.log"
  wait $probes || rc=1
  cat "$OUT/probes.log"
  printf '%s\n' "1024 1 64 lstm fp32 1" "1024 16 64 lstm fp32 2" | step_timings 60 > "$OUT/outside-steps.log" 2>&1 || rc=1
  grep -E "^==|^ [A-Za-z]|step:|outside" "$OUT/outside-steps.log"
fi
if [ "$part" = trial ]; then
  # The probes are built from a copy of the kernels as they are, made before this tree is patched (the
  # patched probe from that copy too), on single cores while the extension builds.
  copy_probe_tree /tmp/vlseq-probe-main || exit 1
  build_probes /tmp/vlseq-probe-main > "$OUT/probes.log" 2>&1 &
  probes=$!
  [ -z "${PROBE_PATCH:-}" ] || git apply "$PROBE_PATCH" || { echo "PROBE_PATCH $PROBE_PATCH does not apply"; exit 1; }
  build_extension
  wait $probes || rc=1
  cat "$OUT/probes.log"
  echo "${TRIAL_CASES:-1024 1 64 lstm fp32 1;1024 16 64 lstm fp32 2}" | tr ';' '\n' | step_timings 60 > "$OUT/trial-steps.log" 2>&1 || rc=1
  grep -E "^==|^ [A-Za-z]|step:|outside" "$OUT/trial-steps.log"
  # The patched kernels' GPU tests, then the bench (RNN_ARGS: e.g. --only rnn.lstm1024x2) on them.
  xdist=$($PY -c "import xdist" 2>/dev/null && echo "-n ${PYTEST_WORKERS:-16}")
  timeout ${RNN_TEST_TIMEOUT:-300} $PY -m pytest -q -p no:cacheprovider $xdist ${TRIAL_TESTS:-tests/test_rnn_gpu.py tests/test_rnn_pipeline.py} \
    > "$OUT/trial-tests.log" 2>&1 || rc=1
  tail -15 "$OUT/trial-tests.log"
  if [ $rc = 0 ]; then
    timeout ${RNN_BENCH_TIMEOUT:-300} $PY -m vlseq_ext.bench --suite rnn ${RNN_ARGS:-} --out "$OUT/rnn" > "$OUT/rnn-bench.log" 2>&1 || rc=1
    tail -40 "$OUT/rnn-bench.log"
  fi
fi
if [ "$part" = exchange ]; then
  if build_l2_exchange exchange.log; then
    for nb in 64 128; do
      timeout 30 /tmp/vlseq_l2_exchange none $nb 2 480
      for kib in 2 16 32; do for m in same publish tagged; do timeout 30 /tmp/vlseq_l2_exchange $m $nb $kib 480; done; done
    done >> "$OUT/exchange.log" 2>&1 || rc=1
  else
    rc=1
  fi
  cat "$OUT/exchange.log"
fi
if [ "$part" = products ]; then
  # (the probe calls the 16-bit forward's half_tile_products from the kernels' header, which includes torch's)
  if ${NVCC:-nvcc} -std=c++20 -gencode=arch=compute_90a,code=sm_90a -O3 -o /tmp/vlseq_wgmma_products \
    benchmarks/probe/wgmma_products.cu -Icsrc/include -Icsrc/cuda $(torch_includes) > "$OUT/products.log" 2>&1; then
    for ns in 16 8; do timeout 60 /tmp/vlseq_wgmma_products $ns 128 480; done >> "$OUT/products.log" 2>&1 || rc=1
  else
    rc=1
  fi
  cat "$OUT/products.log"
fi
if [ "$part" = ncu ]; then
  build_probe
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  # The kernels matched, each launched once: launch-count 2 covers a case's forward and backward.
  VLSEQ_PROBE_LAUNCHES=1 ${ncu:-ncu} --clock-control none -k "regex:${NCU_KERNELS:-fused}" --launch-count ${NCU_LAUNCHES:-2} \
    --section SourceCounters --section WarpStateStats -f -o /tmp/vlseq-ncu "$bin" ${NCU_CASE:-64 1 1 lstm fp32 32} \
    > "$OUT/ncu.log" 2>&1 || rc=1
  ${ncu:-ncu} -i /tmp/vlseq-ncu.ncu-rep --page source --csv --print-source sass > /tmp/vlseq-ncu-source.csv 2>> "$OUT/ncu.log" &&
    gzip -c /tmp/vlseq-ncu-source.csv > "$OUT/ncu-source.csv.gz" &&
    $PY benchmarks/probe/ncu_regions.py /tmp/vlseq-ncu-source.csv | tee "$OUT/ncu-regions.txt" || rc=1
fi
if runs dist; then
  $PY benchmarks/distributed_check.py --out "$OUT/dist" > "$OUT/dist.log" 2>&1 || rc=1
  tail -30 "$OUT/dist.log"
fi
if runs tsc; then
  $PY -m pytest -q -p no:cacheprovider -rs tests/test_estimators_network.py tests/test_estimators.py \
    tests/test_estimators_checks.py tests/test_estimators_bench.py > "$OUT/tsc-tests.log" 2>&1 || rc=1
  tail -15 "$OUT/tsc-tests.log"
  VLSEQ_TSC_METHODS=vlseq_gpu,knn_dtw,rdst $PY -m vlseq_ext.bench --suite tsc --out "$OUT/tsc" > "$OUT/tsc.log" 2>&1 || rc=1
  tail -30 "$OUT/tsc.log"
fi
if runs tsc-cpu; then
  VLSEQ_TSC_METHODS=vlseq_cpu $PY -m vlseq_ext.bench --suite tsc --devices cpu --out "$OUT/tsc-cpu" > "$OUT/tsc-cpu.log" 2>&1 || rc=1
  tail -20 "$OUT/tsc-cpu.log"
fi
exit $rc

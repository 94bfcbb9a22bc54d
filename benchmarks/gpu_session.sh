#!/usr/bin/env bash
# What to run on a CUDA GPU machine, from the repository root, with the machine's own torch and triton:
#   OUT=<folder for logs and results> benchmarks/gpu_session.sh [cuda-tests] [triton-tests] [bench] [compile]
#       [memory] [bench-quick] [recurrent] [tune] [step] [table1] [nonfinite] [compile-ops]
#       (default: cuda-tests triton-tests bench)
# - cuda-tests: tests/ops/test_triton_cuda.py, tests/bench/test_gpu.py and test_memory.py (CUDA tensors through the
#   public API, a lean ResNet18 trained on the GPU);
# - triton-tests: every Triton test of the suite with its kernels compiled for and run on the GPU
#   (SPIKEFUSE_TEST_TRITON=cuda; the AOT test is left out: it needs no GPU);
# - bench: `spikefuse bench gpu` into $OUT (copy the files to benchmarks/results/ to commit them);
# - compile: `spikefuse bench compile --device cuda`: the first forward+backward with empty Triton caches;
# - memory: `spikefuse bench memory --device cuda` at the CPU run's size (ResNet18, imagenet stem, T=8, B=16) and at
#   the memory-lean paper's (CIFAR stem, T=10, B=64), into $OUT/memory-cpu-size and $OUT/memory-paper-size; every
#   form in one process (the GPU's memory is read from torch's allocator per step, not from the process).
# - recurrent: the recurrent layers' CUDA tests (cuBLAS products, compiled Triton step kernels, the snnTorch drop-in)
#   and their Triton tests on the GPU, then `spikefuse bench recurrent --device cuda` into $OUT;
# - tune: benchmarks/gpu_tune_engine.py, a sweep of the engine kernels' launch configuration into $OUT;
# - step: `spikefuse bench memory --device cuda` for ResNet18 at issue 49's size (CIFAR stem, T=8, batch 64), fp32 and
#   under bf16 autocast, into $OUT/step-fp32 and $OUT/step-bf16 (STEP_ARGS=--cuda-graph: the steps replayed from CUDA
#   graphs);
# - table1: `spikefuse bench table1 --device cuda` on MNIST (full width, T=32, a timed subset) from $DATA_ROOT
#   (default .gpudata: copy ../shared/data/mnist there and carry it, since the data is not in the repository);
# - nonfinite: the NaN/inf tests with their Triton kernels compiled for the GPU;
# - compile-ops: the recurrent layer's and the spike packing's custom ops (opcheck, torch.compile against eager,
#   the recurrent Triton tests) with their Triton kernels compiled for the GPU.
# Peers and test dependencies missing there can travel as wheels in .whl/ (installed into /tmp/site; .whl/ is not
# tracked by git, so the device tool must be told to carry it: carry [".whl"]).
set -uo pipefail
OUT=${OUT:-/tmp/spikefuse-gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, triton, numba; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__, 'numba', numba.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
workers=$(( $(nproc) > 16 ? 16 : $(nproc) ))
status=0
for step in "${@:-cuda-tests triton-tests bench}"; do
  for s in $step; do
    case $s in
      cuda-tests)
        SPIKEFUSE_TEST_TRITON=cuda timeout "${CUDA_TESTS_TIMEOUT:-300}" $PY -m pytest -q -p no:cacheprovider -n 4 \
            tests/ops/test_triton_cuda.py tests/bench/test_gpu.py tests/bench/test_memory.py \
            2>&1 | tee "$OUT/pytest-cuda.log" | tail -15 || status=1 ;;
      triton-tests)
        SPIKEFUSE_TEST_TRITON=cuda timeout "${TESTS_TIMEOUT:-330}" $PY -m pytest -q -p no:cacheprovider -n "$workers" \
            --dist load -k "triton or Triton" --ignore=tests/ops/test_triton_aot.py \
            tests/ops tests/neurons tests/nn tests/batchnorm tests/test_functional.py \
            2>&1 | tee "$OUT/pytest-triton-on-cuda.log" | tail -25 || status=1 ;;
      bench)
        timeout "${BENCH_TIMEOUT:-300}" $PY -m spikefuse.cli bench gpu --out "$OUT" ${BENCH_ARGS:-} \
            2>&1 | tee "$OUT/bench-gpu.log" | tail -40 || status=1 ;;
      compile)
        $PY -m spikefuse.cli bench compile --device cuda --tag gpu --out "$OUT" 2>&1 | tail -12 || status=1 ;;
      memory)
        for size in "cpu-size:--stem imagenet -T 8 --batch-size 16" "paper-size:--stem cifar -T 10 --batch-size 64"; do
          timeout "${MEMORY_TIMEOUT:-200}" $PY -m spikefuse.cli bench memory --device cuda --in-process \
              --repeats "${MEMORY_REPEATS:-7}" ${size#*:} --results-dir "$OUT/memory-${size%%:*}" 2>&1 | tail -16 \
              || status=1
        done ;;
      recurrent)
        SPIKEFUSE_TEST_TRITON=cuda timeout "${RECURRENT_TESTS_TIMEOUT:-200}" $PY -m pytest -q -p no:cacheprovider \
            -n 4 tests/ops/test_triton_cuda.py -k "recurrent or rleaky" 2>&1 | tee "$OUT/pytest-recurrent-cuda.log" \
            | tail -8 || status=1
        SPIKEFUSE_TEST_TRITON=cuda timeout "${RECURRENT_TESTS_TIMEOUT:-200}" $PY -m pytest -q -p no:cacheprovider \
            -n "$workers" tests/ops/test_recurrent.py -k triton 2>&1 | tee -a "$OUT/pytest-recurrent-cuda.log" \
            | tail -8 || status=1
        timeout "${BENCH_TIMEOUT:-300}" $PY -m spikefuse.cli bench recurrent --device cuda --repeats 5 --out "$OUT" \
            2>&1 | tee "$OUT/bench-recurrent.log" | tail -14 || status=1 ;;
      tune)
        timeout "${TUNE_TIMEOUT:-200}" $PY benchmarks/gpu_tune_engine.py 2>&1 | tee "$OUT/tune.log" | tail -45 \
            || status=1 ;;
      step)
        for precision in fp32 bf16; do
          timeout "${STEP_TIMEOUT:-150}" $PY -m spikefuse.cli bench memory --device cuda --in-process --models resnet18 \
              --forms spikingjelly fused lean floor --stem cifar -T 8 --batch-size 64 --repeats "${STEP_REPEATS:-7}" \
              --precision $precision --results-dir "$OUT/step-$precision" ${STEP_ARGS:-} 2>&1 | tail -12 || status=1
        done ;;
      table1)
        timeout "${TABLE1_TIMEOUT:-240}" $PY -m spikefuse.cli bench table1 --device cuda --datasets mnist \
            --data-root "${DATA_ROOT:-.gpudata}" --results-dir "$OUT/table1" ${TABLE1_ARGS:-} 2>&1 \
            | tee "$OUT/table1.log" | tail -16 || status=1 ;;
      nonfinite)
        SPIKEFUSE_TEST_TRITON=cuda timeout "${NONFINITE_TIMEOUT:-150}" $PY -m pytest -q -p no:cacheprovider \
            -n "$workers" tests/ops/test_non_finite.py 2>&1 | tee "$OUT/pytest-nonfinite-cuda.log" | tail -8 \
            || status=1 ;;
      compile-ops)
        SPIKEFUSE_TEST_TRITON=cuda timeout "${OPS_TIMEOUT:-150}" $PY -m pytest -q -p no:cacheprovider -n "$workers" \
            tests/nn/test_recurrent.py tests/ops/test_bitpack.py tests/ops/test_recurrent.py \
            -k "triton or compile or opcheck" 2>&1 | tee "$OUT/pytest-compile-ops.log" | tail -8 || status=1 ;;
      bench-quick)
        $PY -m spikefuse.cli bench gpu --quick --out "$OUT" 2>&1 | tail -30 || status=1 ;;
      *) echo "unknown step $s: use cuda-tests, triton-tests, bench, compile, memory, bench-quick, recurrent, tune, step,"
         echo "table1, nonfinite or compile-ops"
         exit 2 ;;
    esac
  done
done
exit $status

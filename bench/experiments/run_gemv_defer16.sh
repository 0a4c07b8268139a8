#!/usr/bin/env bash
# gemv-defer16.patch measured in one GPU-machine call (README here): the patched build, the A/Bs (interleaved, one
# process each: the plan of the defaults, then each engine tuned itself), the tests under the switch. Logs under $OUT
# (or bench/out). ~4-5 min on an H100 / H200. It applies the patch to the working tree: run it on the GPU machine's
# copy, not in a checkout you commit from.
#   bash bench/experiments/run_gemv_defer16.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-bench/out}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"  # absolute: the A/Bs run from bench/tools
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # the GPU machine has no gguf: carried as a wheel (the device notes)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
t0=$(date +%s)
git apply bench/experiments/gemv-defer16.patch || patch -p1 -N <bench/experiments/gemv-defer16.patch || exit 1
CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=native -DTINYINFER_CUDA=ON" CMAKE_BUILD_PARALLEL_LEVEL=16 \
  python3 -m pip install --no-build-isolation --no-deps . >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
cd bench/tools
D="env.TI_GEMV_DEFER=1"
for m in smollm2-135m smollm2-360m tinyllama-1.1b; do
  timeout 100 python3 ab_decode.py $m fp16 16 "" "$D" "" "$D" --same-plan --rounds=4 2>&1 | tee -a "$out/ab-same.txt"
  timeout 100 python3 ab_decode.py $m fp16 16 "" "$D" "" "$D" --rounds=4 --gemv 2>&1 | tee -a "$out/ab-tuned.txt"
done
cd ../..
echo "a/b: $(( $(date +%s) - t0 )) s"
TI_GEMV_DEFER=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py tests/test_gpu_engine.py \
  -k "gemv or engine or greedy or logits" 2>&1 | tee "$out/tests-defer.log" | tail -2
TI_GEMV_DEFER=1 timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_persistent.py tests/test_gpu_batch.py \
  -k "tokens_match_graph or greedy_equals" 2>&1 | tee "$out/tests-defer2.log" | tail -2
timeout 40 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py -k "gemv" 2>&1 | tee "$out/tests-gemv.log" | tail -2
echo "total: $(( $(date +%s) - t0 )) s"

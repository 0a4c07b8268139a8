#!/usr/bin/env bash
# gemv-input.patch measured in one GPU-machine call (README here): the chains first (stream_chain.cu, dep 0-10: the
# bounds), the patched build beside them, then the A/Bs (interleaved, one process each) and the tests under each
# switch. Logs under $OUT (or bench/out). ~6-8 min on an H100 / H200. It applies the patch to the working tree: run it
# on the GPU machine's copy, not in a checkout you commit from.
#   bash bench/experiments/run_gemv_input.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-bench/out}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"  # absolute: the A/Bs run from bench/tools
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # the GPU machine has no gguf: carried as a wheel (the device notes)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv | tee "$out/gpu.txt"
t0=$(date +%s)
nvcc -std=c++17 -O3 -arch=sm_90 bench/tools/stream_chain.cu -o /tmp/chain || exit 1
git apply bench/experiments/gemv-input.patch || patch -p1 -N <bench/experiments/gemv-input.patch || exit 1
CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=native -DTINYINFER_CUDA=ON" CMAKE_BUILD_PARALLEL_LEVEL=16 \
  python3 -m pip install --no-build-isolation --no-deps . >"$out/build.log" 2>&1 &
build=$!
/tmp/chain tinyllama >"$out/chain.txt" 2>&1
/tmp/chain smollm2 >>"$out/chain.txt" 2>&1
# µs a layer: the best grid / U / trigger of each model and dep (room 0)
awk '$4 ~ /^[12]$/ && $8 == 0 {k = $1 " " $2 " dep" $5; if (!(k in b) || $9 < b[k]) b[k] = $9}
     END {for (k in b) print k, b[k]}' "$out/chain.txt" | sort -V | paste - - - - - - - - - - -
echo "chains: $(( $(date +%s) - t0 )) s"
wait $build || { tail -30 "$out/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"

cd bench/tools
U="env.TI_GEMV_UNSTAGED=2" S="env.TI_GEMV_STAT=1"
for m in "smollm2-135m fp16" "smollm2-360m fp16" "tinyllama-1.1b fp16"; do  # unstaged o / down: each tuned itself
  timeout 120 python3 ab_decode.py $m 16 "" "$U" "" "$U" --rounds=4 --gemv 2>&1 | tee -a "$out/ab-unstaged.txt"
done
for m in "tinyllama-1.1b fp16" "tinyllama-1.1b int4" "tinyllama-1.1b int8" "smollm2-135m fp16" "smollm2-360m fp16"; do
  timeout 120 python3 ab_decode.py $m 16 "" "$S" "" "$S" --same-plan --rounds=5 2>&1 | tee -a "$out/ab-stat.txt"
done
cd ../..
echo "a/b: $(( $(date +%s) - t0 )) s"
TI_GEMV_UNSTAGED=2 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py \
  tests/test_gpu_engine.py -k "gemv or engine or greedy or logits" 2>&1 | tee "$out/tests-unstaged.log" | tail -2
TI_GEMV_STAT=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_gpu_quant.py \
  -k "engine or greedy or logits" 2>&1 | tee "$out/tests-stat.log" | tail -2
echo "total: $(( $(date +%s) - t0 )) s"

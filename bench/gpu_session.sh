#!/usr/bin/env bash
# One whole GPU-machine session in one call (README.md, Benchmarks): build for the native arch, run the GPU tests,
# run the benchmarks, write logs / JSON under $OUT (or bench/out), print a short table last.
#   bash bench/gpu_session.sh            # everything
#   TESTS="tests/test_gpu_kernels.py" bash bench/gpu_session.sh
# Wheels in .whl/ (git-ignored) are installed first, without their dependencies: how a GPU machine with no
# network gets the test dependencies it lacks (gguf, llguidance), downloaded elsewhere with
#   pip download --no-deps gguf llguidance --python-version 3.11 --platform manylinux_2_28_x86_64 \
#     --only-binary=:all: -d .whl
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=python3

t0=$(date +%s)
if compgen -G ".whl/*.whl" >/dev/null; then
  $py -m pip install -q --no-deps .whl/*.whl >"$out/wheels.log" 2>&1 || tail -5 "$out/wheels.log"
fi
CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=native -DTINYINFER_CUDA=ON" \
  $py -m pip install --no-build-isolation --no-deps . >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

$py -m pytest -q -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee "$out/tests.log" | tail -5
$py -m pytest -q -p no:cacheprovider bench --benchmark-json="$out/bench.json" 2>&1 | tee "$out/bench.log" | tail -15
$py bench/tools/summary.py "$out/bench.json"

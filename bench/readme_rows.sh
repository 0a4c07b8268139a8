#!/usr/bin/env bash
# The decode table of bench/results/README.md, every row its own process (a first load, as a user's), in the order
# that puts the rows nearest their targets first; each row's JSON is written as it finishes, so a run cut short by
# LIMIT (seconds, default none) keeps the rows it finished. Then the table from the files (results_table.py).
#   OUT=/tmp/rows bash bench/readme_rows.sh                 # after the GPU build (README.md, GPU build)
#   LIMIT=540 ROWS="llama2-7b-fp16 tinyllama-1.1b-fp16" bash bench/readme_rows.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/out}/rows"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
limit=${LIMIT:-0}
prefix=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o 'H[0-9]*' | head -1 | tr 'H' 'h')
prefix=${prefix:-gpu}
# shape-format -> its arguments (bench/results/README.md, "Where they come from")
declare -A ARGS=(
  [llama2-7b-fp16]="--shape llama2-7b --dtype fp16 --contexts 16,1024 --prefill 512"
  [tinyllama-1.1b-fp16]="--shape tinyllama-1.1b --dtype fp16 --contexts 16,1024,4096"
  [smollm2-135m-fp16]="--shape smollm2-135m --dtype fp16 --contexts 16,1024,4096 --prefill="
  [smollm2-360m-fp16]="--shape smollm2-360m --dtype fp16 --contexts 16,1024,4096 --prefill="
  [llama2-7b-int8]="--shape llama2-7b --dtype int8 --contexts 16,1024 --prefill 512"
  [llama2-7b-int4]="--shape llama2-7b --dtype int4 --contexts 16,1024 --prefill 512"
  [tinyllama-1.1b-int8]="--shape tinyllama-1.1b --dtype int8 --contexts 16,1024,4096"
  [tinyllama-1.1b-int4]="--shape tinyllama-1.1b --dtype int4 --contexts 16,1024,4096"
)
rows=${ROWS:-"llama2-7b-fp16 tinyllama-1.1b-fp16 smollm2-135m-fp16 smollm2-360m-fp16 llama2-7b-int8 llama2-7b-int4 tinyllama-1.1b-int8 tinyllama-1.1b-int4"}
for r in $rows; do
  [ -n "${ARGS[$r]:-}" ] || { echo "unknown row $r (known: ${!ARGS[*]})"; exit 2; }
done
for r in $rows; do
  run=(python3 -m tinyinfer bench ${ARGS[$r]})
  if [ "$limit" -gt 0 ]; then
    left=$(( limit - ($(date +%s) - t0) ))
    if [ "$left" -lt 40 ]; then echo "skipped $r: ${LIMIT} s spent"; continue; fi
    run=(timeout "$left" "${run[@]}")
  fi
  echo "== $r"
  "${run[@]}" --json "$out/$prefix-$r.json" >"$out/$prefix-$r.log" 2>&1 || echo "   failed (rc $?): $out/$prefix-$r.log"
done
ls "$out"/*.json >/dev/null 2>&1 && python3 bench/tools/results_table.py "$out"/*.json

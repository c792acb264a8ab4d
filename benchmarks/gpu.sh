#!/bin/bash
# Run on the GPU box (device tool): installs the carried wheels, then runs the given steps.
# usage: bash benchmarks/gpu.sh "<run.py args>" ["<run.py args>" ...]   (each step: timeout from STEP_TIMEOUT)
set -o pipefail
export PYTHONUNBUFFERED=1
ROOT=$(pwd)
mkdir -p /tmp/site
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || echo "wheel install failed"
fi
if [ -f .whl/ck.zip ]; then python3 -m zipfile -e "$ROOT/.whl/ck.zip" /tmp/site || echo "comfy_kitchen unpack failed"; fi
# A binary comfy-kitchen (its CUDA extension: INT8 attention, CUDA RoPE) replaces the source one:
# CK=<wheel or zip> (e.g. .cache/ck/ck-0.2.40-cuda.zip, carried; 0.2.40 without its 160 MB HIP library).
if [ -n "$CK" ] && [ -f "$CK" ]; then rm -rf /tmp/site/comfy_kitchen; python3 -m zipfile -e "$CK" /tmp/site || echo "$CK unpack failed"; fi
export PYTHONPATH=/tmp/site
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$OUT/nvsmi.txt"
i=0
for step in "$@"; do
  i=$((i+1))
  timeout "${STEP_TIMEOUT:-300}" python3 benchmarks/run.py $step 2>&1 | tee "$OUT/step$i.log"
done

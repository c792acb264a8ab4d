#!/bin/bash
# On the GPU box (device tool): carried wheels -> the end-to-end matrix (benchmarks/e2e_matrix.py)
# -> $OUT/matrix.tgz (the cells' JSON, report.md, the log; refs/ stay behind: at most 8 files of
# 16 MiB come back) and $OUT/matrix_logs.tgz (each cell's full log).
# usage: bash benchmarks/gpu_matrix.sh [e2e_matrix.py args, e.g. --families flux --modes static dynamic]
# Carry .whl (comfy-aimdo, torchsde, trampoline, sageattention), .ext/comfy-slim and
# .cache/ck/ck-0.2.40-cuda.zip (comfy-kitchen with its CUDA backend, as a PyPI install has it).
# MATRIX_SECONDS (default 480): no cell starts that would end past it; MATRIX_TIMEOUT (default
# 540) stops the matrix outright, so the tarballs are written inside the device's 600 s.
# MATRIX_DIR (default /tmp/matrix): the matrix's --out; a folder of the working tree holding an
# earlier call's cells (matrix.tgz unpacked) resumes it, its cells skipped.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed"
CK_ZIP=${CK_ZIP:-.cache/ck/ck-0.2.40-cuda.zip}
[ -f "$CK_ZIP" ] && python3 -m zipfile -e "$CK_ZIP" /tmp/site && echo "comfy-kitchen from $CK_ZIP"
export PYTHONPATH=/tmp/site
OUT=${OUT:-benchmarks/results}
WORK=${MATRIX_DIR:-/tmp/matrix}
mkdir -p "$OUT" "$WORK"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$WORK/nvsmi.txt"
timeout "${MATRIX_TIMEOUT:-540}" python3 benchmarks/e2e_matrix.py --comfyui .ext/comfy-slim --out "$WORK" \
    --max-seconds "${MATRIX_SECONDS:-480}" "$@" 2>&1 | tee "$WORK/matrix.log" | grep "^\[matrix\]"
# Written again: a run stopped by the timeout wrote none, a resumed MATRIX_DIR holds an older one.
python3 benchmarks/e2e_matrix.py --report "$WORK" > "$WORK/report.md"
tar czf "$OUT/matrix.tgz" -C "$WORK" cells report.md matrix.log nvsmi.txt
tar czf "$OUT/matrix_logs.tgz" -C "$WORK" logs 2>/dev/null
cat "$WORK/report.md"

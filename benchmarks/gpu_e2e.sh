#!/bin/bash
# On the GPU box (device tool): carried wheels -> FP8 kernel check -> end-to-end ComfyUI steps.
# usage: bash benchmarks/gpu_e2e.sh [e2e_comfyui.py args, e.g. --models flux --dynamic-vram]
# Needs .whl (sageattention, comfy_kitchen as ck.zip, comfy-aimdo, torchsde, trampoline) and a
# ComfyUI tree (python files only suffice) carried in .ext/comfy-slim.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed"
# CK_ZIP: which comfy-kitchen ComfyUI imports. The default .whl/ck.zip is the source-only build
# (its CUDA backend absent, so RoPE runs in eager torch); a PyPI install has the CUDA backend,
# e.g. CK_ZIP=.cache/ck/ck-0.2.40-cuda.zip (carried), which is what a user's default runs.
CK_ZIP=${CK_ZIP:-.whl/ck.zip}
[ -f "$CK_ZIP" ] && python3 -m zipfile -e "$CK_ZIP" /tmp/site && echo "comfy-kitchen from $CK_ZIP"
export PYTHONPATH=/tmp/site
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/nvsmi.txt"
if [ -f benchmarks/check_fp8.py ]; then
    timeout "${FP8_TIMEOUT:-150}" python3 benchmarks/check_fp8.py --shapes flux,wan 2>&1 | tee "$OUT/fp8.log"
fi
# --dynamic-vram (passed on to e2e_comfyui.py like every argument): first the one-process check
# that our Linear serves, and agrees, under ComfyUI's dynamic VRAM.
case " $* " in
    *" --dynamic-vram "*)
        timeout "${DYNAMIC_VRAM_CHECK_TIMEOUT:-300}" python3 benchmarks/check_dynamic_vram.py --comfyui .ext/comfy-slim \
            2>&1 | tee "$OUT/check_dynamic_vram.log" ;;
esac
timeout "${E2E_TIMEOUT:-400}" python3 benchmarks/e2e_comfyui.py --comfyui .ext/comfy-slim --out "$OUT" "$@" 2>&1 \
    | tee "$OUT/e2e.log"

#!/bin/bash
# Device calls of sessions 30-31 (benchmarks/RESULTS.md), one stage per call, each ≤ 600 s on an H100/H200:
#   bash benchmarks/gpu_runs.sh norms       fused-norm kernels beside ComfyUI's ops; Wan e2e with and
#                                           without fused norms and lean; Flux e2e with the QK norm
#   bash benchmarks/gpu_runs.sh norms-abba  Flux ABBA with / without the QK norm, Wan again, lean loops
#   bash benchmarks/gpu_runs.sh lean        the two-block RMSNorm+RoPE; lean (fixed quantiser) beside
#                                           sm90, kernel and Wan e2e (session 31)
#   bash benchmarks/gpu_runs.sh s31         session 31's final code: the residual kernels beside
#                                           ComfyUI's ops, Wan e2e
# Carry .whl, .ext/comfy-slim and .cache/ck/ck-0.2.40-cuda.zip (RESULTS.md, session 28). Each e2e
# stage's files come back as one tarball (at most 8 files come back per call).
export PYTHONUNBUFFERED=1; set -o pipefail
R=$OUT; CK=.cache/ck/ck-0.2.40-cuda.zip
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
e2e() {  # name timeout e2e_comfyui.py args...
    local n=$1 t=$2; shift 2; mkdir -p /tmp/$n
    OUT=/tmp/$n CK_ZIP=$CK FP8_TIMEOUT=1 E2E_TIMEOUT=$t bash benchmarks/gpu_e2e.sh --fresh-process "$@" > /tmp/$n/run.log 2>&1
    grep -v "^\s*File\|^    \|UserWarning\|_warn_once" /tmp/$n/run.log | grep "^\[\|^model\|^wan\|^flux\|Error\|FAIL" | tail -40
    tar czf $R/$n.tgz -C /tmp $n
}
case $1 in
norms)
    python3 -m zipfile -e $CK /tmp/ck
    PYTHONPATH=/tmp/ck timeout 70 python3 benchmarks/fused_norms_bench.py --out $R > $R/norms.txt 2>&1; tail -16 $R/norms.txt
    e2e e2e_wan 300 --models wan --variants default ours-all+nonorms ours-all+norms ours-all+lean+norms --steps 3
    e2e e2e_flux1 170 --models flux --variants default ours-all+nonorms ours-all+norms --steps 4 ;;
norms-abba)
    e2e e2e_flux2 200 --models flux --variants default ours-all+nonorms ours-all+norms ours-all+norms ours-all+nonorms \
        default --steps 5
    e2e e2e_wan2 200 --models wan --variants default ours-all+norms ours-all+nonorms --steps 3
    timeout 150 python3 benchmarks/gluon_attention_bench.py --lite --shapes wan,flux --bf16-shapes flux \
      --configs sm90,sm90_lean,sm90_lean_rowsum --rep 100 --acc-heads 1 --small 0 --out $R > $R/gluon.txt 2>&1
    tail -30 $R/gluon.txt ;;
lean)
    python3 -m zipfile -e $CK /tmp/ck
    PYTHONPATH=/tmp/ck timeout 70 python3 benchmarks/fused_norms_bench.py --shapes wan14b,wan1.3b --out $R > $R/norms.txt 2>&1
    tail -12 $R/norms.txt
    timeout 85 python3 benchmarks/gluon_attention_bench.py --lite --shapes wan,flux --bf16-shapes "" \
      --configs sm90,sm90_lean --rep 100 --acc-heads 1 --small 0 --out $R > $R/gluon_lean.txt 2>&1
    grep -A40 "== accuracy" $R/gluon_lean.txt
    e2e e2e_wan_lean 260 --models wan --variants default ours-all ours-all+lean ours-all ours-all+lean --steps 3 ;;
s31)
    python3 -m zipfile -e $CK /tmp/ck
    PYTHONPATH=/tmp/ck timeout 70 python3 benchmarks/fused_norms_bench.py --shapes wan14b --out $R > $R/norms.txt 2>&1
    tail -14 $R/norms.txt
    e2e e2e_wan31 150 --models wan --variants default ours-all --steps 3 ;;
*)  echo "stage: norms, norms-abba, lean or s31"; exit 2 ;;
esac

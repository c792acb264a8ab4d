#!/bin/bash
# Device calls of sessions 30-33 (benchmarks/RESULTS.md), one stage per call, each ≤ 600 s on an H100/H200:
#   bash benchmarks/gpu_runs.sh norms       fused-norm kernels beside ComfyUI's ops; Wan e2e with and
#                                           without fused norms and lean; Flux e2e with the QK norm
#   bash benchmarks/gpu_runs.sh norms-abba  Flux ABBA with / without the QK norm, Wan again, lean loops
#   bash benchmarks/gpu_runs.sh lean        the two-block RMSNorm+RoPE; lean (fixed quantiser) beside
#                                           sm90, kernel and Wan e2e (session 31)
#   bash benchmarks/gpu_runs.sh s31         session 31's final code: the residual kernels beside
#                                           ComfyUI's ops, Wan e2e
#   bash benchmarks/gpu_runs.sh s32         s31 plus Wan without fused norms and Flux default/ours ABAB
#   bash benchmarks/gpu_runs.sh s32b        Flux ABBA with / without the fused QK norm; one profiled step
#                                           of each variant (E2E_KPROFILE), Wan ours-all's too
#   bash benchmarks/gpu_runs.sh s32c        session 32's final code (QK norms on by default, e4m3 rows
#                                           from the norms, residual + norm2): Wan and Flux e2e
#   bash benchmarks/gpu_runs.sh s32d        Flux default / ours-all with one cProfiled step each
#   bash benchmarks/gpu_runs.sh s32e        the norm2 pass beside what it replaces; Wan ABBA; Flux ABBA
#                                           with / without the QK norms (+blocks)
#   bash benchmarks/gpu_runs.sh s33         DirectCall agreement + host µs; Flux ABBA with / without the
#                                           fused Flux blocks (ours-all / ours-all+qk)
#   bash benchmarks/gpu_runs.sh s33c        s33's Flux ABBA again (row-kernel launch memo), one cProfiled step each
#   bash benchmarks/gpu_runs.sh s33d        one profiled Flux step with / without the fused Flux blocks; Wan
#                                           default / ours-all; Flux default / ours-all / +qk / ours-all
#   bash benchmarks/gpu_runs.sh s33e        after the DirectCall template fix: Wan default / ours-all; Flux ABBA
#                                           with / without the fused Flux blocks, one cProfiled step each
#   bash benchmarks/gpu_runs.sh s33f        session 33's final code: host µs per call; one profiled Flux step with /
#                                           without the fused blocks; Flux ABBA; Wan default / ours-all
#   bash benchmarks/gpu_runs.sh s33g        Flux: three ours-all processes interleaved with two +qk, default at both ends
#   bash benchmarks/gpu_runs.sh s34         step graphs (then off by default): Flux default / ours-all+graph / ours-all; Wan default / ours-all+graph
#   bash benchmarks/gpu_runs.sh s34b        step graphs on by default: Flux default / ours-all / ours-all+nograph / ours-all / default; Wan ours-all
#   bash benchmarks/gpu_runs.sh s35         FP8 attention with and without the outlier side operands (Flux, Wan); issue 12's
#                                           Linear table; Flux default / Patch / Patch+norope / Linear / fp8_e4m3fn_fast /
#                                           Patch / default
#   bash benchmarks/gpu_runs.sh s35w        Wan default / Patch / fp8_e4m3fn_fast (issue 12's Wan row)
#   bash benchmarks/gpu_runs.sh s35g        FP8 attention with / without the outlier side operands; Flux default / Patch /
#                                           Patch+norope / Patch / default (one call within ~450 s)
#   bash benchmarks/gpu_runs.sh s35h        s35g's Flux part alone (~300 s)
#   bash benchmarks/gpu_runs.sh s35j        after the direct-launch fix: Flux default / Patch / Patch eager (+nograph) /
#                                           default; Wan default / Patch (~250 s)
#   bash benchmarks/gpu_runs.sh s35k        s35j's Flux part alone (~90 s)
#   bash benchmarks/gpu_runs.sh s36         on an H200: s35; on any other card: the FP8 attention table (lean, 1/8 and 2/8
#                                           of P's exponentials by a polynomial), Wan default / Patch / Patch+lean_poly12,
#                                           Flux default / Patch eager (the direct-launch fix)
#   bash benchmarks/gpu_runs.sh s36h        issue 12's table in one call: Linear shapes; Flux default / Patch / Linear /
#                                           fp8_e4m3fn_fast / Patch / default; Wan default / Patch / fp8_e4m3fn_fast
#   bash benchmarks/gpu_runs.sh s36m        lean against lean_merged (one mbarrier arrive a key tile), FP8 attention table only
#   bash benchmarks/gpu_runs.sh s36w        lean against its polynomial-exponential variants, then s35w
#   bash benchmarks/gpu_runs.sh s37         s36m; then on an H200 s36h (issue 12's table), on any other card Wan and
#                                           Flux default / Patch / Patch+lean_merged
#   bash benchmarks/gpu_runs.sh s37b        the FP8 Linear's split tail: Linear tables with the split-tail table; Flux
#                                           default / Patch / Patch+nosplit / Linear / fp8_e4m3fn_fast / Patch+nosplit /
#                                           Patch / default; Wan default / Patch / fp8_e4m3fn_fast (issue 12's table)
#   bash benchmarks/gpu_runs.sh s37c        s37b after the split's cost was measured (K = 3072 no longer split); Wan only
#                                           on an H200 (issue 12's table in one run there)
#   bash benchmarks/gpu_runs.sh s37h        only on an H200 (any other card: exits at once): issue 12's table in one run
#                                           with the split tail (Linear tables; Flux default / Patch / Linear /
#                                           fp8_e4m3fn_fast / Patch+nosplit; Wan default / Patch / fp8_e4m3fn_fast)
#   bash benchmarks/gpu_runs.sh s37l        only on an H200: the Linear tables with the split tail (~80 s)
#   bash benchmarks/gpu_runs.sh s38a        on an H200 s37h; on any other card the FP8 attention's quantisation
#                                           kernels timed (fp8_quant_bench.py, Flux and Wan)
#   bash benchmarks/gpu_runs.sh s38b        FP8 attention: lean against FlashAttention-3's loop order (sm90_pv_behind) and
#                                           its ping-pong (sm90_pingpong), kernel table and accuracy; then on an H200 s37h
#   bash benchmarks/gpu_runs.sh s38c        s38b at Flux and Wan after acc's rescale left the turn; then on an H200 s37h
#   bash benchmarks/gpu_runs.sh s38d        the FP8 quantisation's statistics on 1 row in 8 of Q and K: fp8_quant_bench.py
#                                           --sweep (Flux, Wan, HunyuanVideo), lean's accuracy table; then on an H200 s37h
#   bash benchmarks/gpu_runs.sh s39a        on an H200 s37h first; then FP8 attention: lean as a persistent kernel
#                                           (sm90_lean_persistent) beside lean, kernel table, accuracy, bit-equality
#   bash benchmarks/gpu_runs.sh s39b        on an H200 s37h first; then the FP8 kernel over whole and partial waves
#                                           (gluon_waves_bench.py: the last wave's cost against a CTA tile's fixed cost)
#   bash benchmarks/gpu_runs.sh s39c        on an H200 s37h first; then fp8_quant_bench.py --sweep and lean's accuracy and
#                                           call table (session 39 ran it with the finalisation fused into the statistics,
#                                           since removed: the sweep now times the separate kernels)
#   bash benchmarks/gpu_runs.sh s39d        on an H200 s37h; on any other card Wan 2.1 14B and Flux 12B end to end
#                                           (ComfyUI default against Triton Accel Patch)
#   bash benchmarks/gpu_runs.sh s39e        on an H200 s37h first; then Nsight Compute's counters of the FP8 kernel at
#                                           Flux, Wan and Flux-in-whole-waves sizes (benchmarks/fp8_attention_ncu.py)
#   bash benchmarks/gpu_runs.sh s39f        Nsight Compute's warp states of lean against lean_merged (Flux, Wan)
#   bash benchmarks/gpu_runs.sh s39g        lean against lean_merged with do_bench (kernel alone, call, graph), lean again last
#   bash benchmarks/gpu_runs.sh s41         on whichever card came (named in the first line): issue 12's table in one
#                                           run (s37h's load)
#   bash benchmarks/gpu_runs.sh s41a        FP8 attention with V's mean rounding error taken out: the quantisation
#                                           kernels with and without it (fp8_quant_bench.py --sweep), lean's accuracy
#                                           and call table
#   bash benchmarks/gpu_runs.sh s41c        s41a (accuracy at the benchmark shapes only), then s41, in one call
#   bash benchmarks/gpu_runs.sh s41d        s41a at the benchmark shapes only (the correction summed in fp32 per block)
#   bash benchmarks/gpu_runs.sh s42a        on an H200 s37h then s41d; on any other card s41d then Wan 2.1 14B default /
#                                           Patch (the step with the V-mean correction)
#   bash benchmarks/gpu_runs.sh s42b        the V-mean correction's block sums as plain stores, added by a launch of its
#                                           own (session 42's second version): on an H200 s37h first; s41d's tables; on
#                                           any other card Flux 12B default / Patch
#   bash benchmarks/gpu_runs.sh s42e        the quantisation sweep and lean's accuracy only (~70 s; session 42's final
#                                           V-mean correction, which reads VT8 back)
#   bash benchmarks/gpu_runs.sh s43a        on an H200 s37h first; then FP8 attention: lean against its P.V issued in 4 / 2
#                                           slices of P (sm90_lean_pvsplit4 / pvsplit2), kernel, call and graph tables,
#                                           accuracy at the benchmark and small shapes, lean again last (drift)
#   bash benchmarks/gpu_runs.sh s43b        Wan 2.1 14B and Flux 12B end to end: default / Patch / Patch+pvsplit4
#   bash benchmarks/gpu_runs.sh s43c        issue 11's side-by-side table: benchmarks/run.py at Flux, Wan 2.1 and
#                                           HunyuanVideo (bf16) beside cuDNN, flash, flex, SageAttention 1.0.6 and
#                                           comfy-kitchen 0.2.40 (carry .whl and the ck zip)
#   bash benchmarks/gpu_runs.sh s44a        s43c's side-by-side table (issue 11's targets are defined on an H200), then
#                                           the quantisation's device time per kernel (fp8_quant_bench.py --sweep)
#   bash benchmarks/gpu_runs.sh s44b        FP8 kernel at Flux and Wan with and without its outlier side operands (@n0), lean
#                                           timed again last for the run's drift; accuracy at the benchmark shapes
#   bash benchmarks/gpu_runs.sh s45c        (ran in session 45) Triton 3.9 (carry .carry/triton-3.9.0.tar.xz, made by
#                                           benchmarks/carry_triton.sh 3.9.0): triton_release_check.py; the machine's
#                                           release on its timed sections, then again with FP fusion left to
#                                           TRITON_DEFAULT_FP_FUSION=0 (Triton 3.10's default); gpu_check.py under 3.9
#   bash benchmarks/gpu_runs.sh s45d        Triton 3.9 (carried, with its CUDA 13.4 Hopper ptxas): every kernel family,
#                                           then the Gluon FP8 kernel's loop options one by one (accuracy)
#   bash benchmarks/gpu_runs.sh s45f        the least of s45d (~150 s): lean and sm90 (and BF16) at Flux and the small
#                                           shapes under 3.9
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
# Triton 3.9 from the carried package (benchmarks/carry_triton.sh) first on the path, with its own kernel cache.
t39() { PYTHONPATH=/tmp/t39 TRITON_CACHE_DIR=/tmp/tc39 "$@"; }
carried_39() {
    python3 -c "import tarfile; tarfile.open('.carry/triton-3.9.0.tar.xz').extractall('/tmp/t39')" || return 1
    t39 python3 -c "import triton; print('carried', triton.__version__, triton.__file__)"
    t39 /tmp/t39/triton/backends/nvidia/bin/ptxas --version | tail -1
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
s32)
    python3 -m zipfile -e $CK /tmp/ck
    PYTHONPATH=/tmp/ck timeout 70 python3 benchmarks/fused_norms_bench.py --shapes wan14b --out $R > $R/norms.txt 2>&1
    tail -14 $R/norms.txt
    e2e e2e_wan32 230 --models wan --variants default ours-all ours-all+nonorms ours-all --steps 3
    e2e e2e_flux32 170 --models flux --variants default ours-all default ours-all --steps 4 ;;
s32b)
    export E2E_KPROFILE=/tmp/kprof; mkdir -p /tmp/kprof
    e2e e2e_flux32b 260 --models flux --variants default ours-all ours-all+norms ours-all+norms ours-all default --steps 5
    e2e e2e_wan32b 100 --models wan --variants ours-all --steps 2
    tar czf $R/kprof.tgz -C /tmp kprof; grep -h "device total\|timeline" /tmp/kprof/*.txt ;;
s32c)
    export E2E_KPROFILE=/tmp/kprof; mkdir -p /tmp/kprof
    e2e e2e_wan32c 260 --models wan --variants default ours-all ours-all --steps 3
    E2E_KPROFILE= e2e e2e_flux32c 230 --models flux --variants default ours-all ours-all default ours-all --steps 5
    tar czf $R/kprof.tgz -C /tmp kprof; grep -h "device total\|timeline" /tmp/kprof/*.txt
    grep -h "_quant_rows_fp8\|_layer_norm_modulate\|_gated_residual_norm\|CUDAFunctor_add<c10::BFloat16>" \
        /tmp/kprof/kprofile_wan_ours-all.txt | cut -c1-90 ;;
s32d)
    mkdir -p /tmp/cprof
    E2E_CPROFILE=/tmp/cprof e2e e2e_flux32d 150 --models flux --variants default ours-all --steps 3
    tar czf $R/cprof.tgz -C /tmp cprof; head -3 /tmp/cprof/*.txt ;;
s32e)
    python3 -m zipfile -e $CK /tmp/ck
    PYTHONPATH=/tmp/ck timeout 70 python3 benchmarks/fused_norms_bench.py --shapes wan14b --out $R > $R/norms.txt 2>&1
    tail -17 $R/norms.txt
    e2e e2e_wan32e 260 --models wan --variants default ours-all ours-all default --steps 3
    e2e e2e_flux32e 240 --models flux --variants default ours-all ours-all+blocks ours-all+blocks ours-all default \
        --steps 5 ;;
s33)
    timeout 100 python3 benchmarks/host_overhead.py --calls 200 --rounds 3 --profile 200 --out $R > $R/host.txt 2>&1
    grep -i "bit_equal\|us\b\|per call" $R/host.txt | head -30
    e2e e2e_flux33 330 --models flux --variants default ours-all ours-all+qk ours-all+qk ours-all default --steps 5 ;;
s33d)
    export E2E_KPROFILE=/tmp/kprof; mkdir -p /tmp/kprof
    e2e e2e_flux33d 150 --models flux --variants ours-all+qk ours-all --steps 3
    E2E_KPROFILE= e2e e2e_wan33d 190 --models wan --variants default ours-all --steps 3
    tar czf $R/kprof.tgz -C /tmp kprof; grep -h "device total\|timeline" /tmp/kprof/*.txt
    E2E_KPROFILE= e2e e2e_flux33d2 180 --models flux --variants default ours-all ours-all+qk ours-all --steps 4 ;;
s33e)
    mkdir -p /tmp/cprof
    e2e e2e_wan33e 200 --models wan --variants default ours-all --steps 3
    E2E_CPROFILE=/tmp/cprof e2e e2e_flux33e 330 --models flux --variants default ours-all ours-all+qk ours-all+qk \
        ours-all default --steps 5
    tar czf $R/cprof.tgz -C /tmp cprof; head -1 /tmp/cprof/*.txt ;;
s33f)
    timeout 80 python3 benchmarks/host_overhead.py --calls 200 --rounds 3 --profile 0 --out $R > $R/host.txt 2>&1
    grep -A14 "host time per call" $R/host.txt; grep -c "'ok': True" $R/host.txt
    export E2E_KPROFILE=/tmp/kprof; mkdir -p /tmp/kprof
    e2e e2e_flux33f 120 --models flux --variants ours-all+qk ours-all --steps 3
    tar czf $R/kprof.tgz -C /tmp kprof; grep -h "device total\|timeline" /tmp/kprof/*.txt
    export E2E_KPROFILE=
    e2e e2e_flux33f2 280 --models flux --variants default ours-all ours-all+qk ours-all+qk ours-all default --steps 5
    e2e e2e_wan33f 170 --models wan --variants default ours-all --steps 3 ;;
s33g)
    e2e e2e_flux33g 330 --models flux --variants default ours-all ours-all+qk ours-all ours-all+qk ours-all default \
        --steps 5 ;;
s33c)
    mkdir -p /tmp/cprof
    E2E_CPROFILE=/tmp/cprof e2e e2e_flux33c 330 --models flux --variants default ours-all ours-all+qk ours-all+qk \
        ours-all default --steps 5
    tar czf $R/cprof.tgz -C /tmp cprof; head -3 /tmp/cprof/*.txt ;;
s34)
    e2e e2e_flux34 280 --models flux --variants default ours-all+graph ours-all ours-all+graph default --steps 6
    grep -h "stays eager\|recorded as a CUDA graph" /tmp/e2e_flux34/run.log | sort | uniq -c | head
    e2e e2e_wan34 170 --models wan --variants default ours-all+graph --steps 3
    grep -h "stays eager\|recorded as a CUDA graph" /tmp/e2e_wan34/run.log | sort | uniq -c | head ;;
s34b)
    e2e e2e_flux34b 280 --models flux --variants default ours-all ours-all+nograph ours-all default --steps 6
    grep -h "stays eager\|recorded as a CUDA graph" /tmp/e2e_flux34b/run.log | sort | uniq -c | head
    e2e e2e_wan34b 120 --models wan --variants ours-all --steps 3
    grep -h "stays eager\|recorded as a CUDA graph" /tmp/e2e_wan34b/run.log | sort | uniq -c | head ;;
s35)
    timeout 100 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan --bf16-shapes "" \
      --configs sm90_lean,sm90_lean@n0 --rep 100 --acc-heads 1 --small 0 --out $R > $R/gluon.txt 2>&1
    grep -A40 "== accuracy" $R/gluon.txt
    timeout 60 python3 benchmarks/linear_bench.py --no-sweep --out $R > $R/linear.txt 2>&1; tail -30 $R/linear.txt
    e2e e2e_flux35 380 --models flux --variants default ours-all ours-all+norope ours-linear comfy-fp8-fast ours-all \
        default --steps 5
    grep -h "stays eager\|recorded as a CUDA graph" /tmp/e2e_flux35/run.log | sort | uniq -c | head ;;
s35g)
    timeout 100 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan --bf16-shapes "" \
      --configs sm90_lean,sm90_lean@n0 --rep 100 --acc-heads 1 --small 0 --out $R > $R/gluon.txt 2>&1
    grep -A40 "== accuracy" $R/gluon.txt
    e2e e2e_flux35g 300 --models flux --variants default ours-all ours-all+norope ours-all default --steps 5
    grep -h "stays eager\|recorded as a CUDA graph\|fused norms\|go to ComfyUI" /tmp/e2e_flux35g/run.log | sort | uniq -c \
        | head ;;
s35h)
    e2e e2e_flux35h 330 --models flux --variants default ours-all ours-all+norope ours-all default --steps 5
    grep -h "stays eager\|recorded as a CUDA graph\|fused norms\|go to ComfyUI" /tmp/e2e_flux35h/run.log | sort | uniq -c \
        | head ;;
s35j)
    e2e e2e_flux35j 150 --models flux --variants default ours-all ours-all+nograph default --steps 5
    grep -h "direct kernel launch\|recorded as a CUDA graph" /tmp/e2e_flux35j/run.log | sort | uniq -c | head -5
    e2e e2e_wan35j 200 --models wan --variants default ours-all --steps 3 ;;
s35k)
    e2e e2e_flux35k 150 --models flux --variants default ours-all ours-all+nograph default --steps 5
    grep -h "direct kernel launch\|recorded as a CUDA graph" /tmp/e2e_flux35k/run.log | sort | uniq -c | head -5 ;;
s36)  # whichever card came: an H200 runs issue 12's table (s35), anything else the polynomial-exponential table
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then exec bash "$0" s35; fi
    timeout 140 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan --bf16-shapes "" \
      --configs sm90_lean,sm90_lean_poly12,sm90_lean_poly25 --rep 100 --acc-heads 1 --small 0 \
      --out $R > $R/gluon.txt 2>&1
    grep -A40 "== accuracy" $R/gluon.txt
    e2e e2e_wan36 290 --models wan --variants default ours-all ours-all+lean_poly12 --steps 3
    e2e e2e_flux36 110 --models flux --variants default ours-all+nograph --steps 5
    grep -h "direct kernel launch" /tmp/e2e_flux36/run.log | sort | uniq -c | head -5 ;;
s36w)  # the FP8 loop with part of P's exponentials on the FMA pipe; then issue 12's Wan row (s35w)
    timeout 150 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan --bf16-shapes "" \
      --configs sm90_lean,sm90_lean_poly12,sm90_lean_poly25 --rep 100 --acc-heads 1 --small 0 \
      --out $R > $R/gluon.txt 2>&1
    grep -A40 "== accuracy" $R/gluon.txt
    exec bash "$0" s35w ;;
s36h)  # issue 12's "the H200, one run" in one call (session 36's H100 call took 185 s for a comparable load)
    timeout 60 python3 benchmarks/linear_bench.py --no-sweep --out $R > $R/linear.txt 2>&1; tail -30 $R/linear.txt
    e2e e2e_flux36h 230 --models flux --variants default ours-all ours-linear comfy-fp8-fast ours-all default --steps 5
    e2e e2e_wan36h 280 --models wan --variants default ours-all comfy-fp8-fast --steps 3 ;;
s36m)  # one "slot free" signal per key tile (sm90_lean_merged) against lean, kernel table only (~60 s)
    timeout 110 python3 benchmarks/gluon_attention_bench.py --lite --shapes wan,flux --bf16-shapes "" \
      --configs sm90_lean,sm90_lean_merged --rep 100 --acc-heads 1 --small 0 --out $R > $R/gluon.txt 2>&1
    grep -A40 "== accuracy" $R/gluon.txt ;;
s37)  # session 37: the merged-barrier timing first, then whatever the card that came can settle
    bash "$0" s36m
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then exec bash "$0" s36h; fi
    e2e e2e_wan37 290 --models wan --variants default ours-all ours-all+lean_merged --steps 3
    e2e e2e_flux37 120 --models flux --variants default ours-all ours-all+lean_merged --steps 5 ;;
s37b)  # the split tail (kernels/linear_fp8.tail_split) beside whole tiles, with issue 12's whole table
    timeout 110 python3 benchmarks/linear_bench.py --no-sweep --out $R > $R/linear.txt 2>&1; tail -14 $R/linear.txt
    e2e e2e_flux37b 300 --models flux --variants default ours-all ours-all+nosplit ours-linear comfy-fp8-fast \
        ours-all+nosplit ours-all default --steps 5
    e2e e2e_wan37b 280 --models wan --variants default ours-all comfy-fp8-fast --steps 3 ;;
s37c)  # s37b with the measured split cost; Wan (unchanged by the split) only where the card is an H200
    timeout 110 python3 benchmarks/linear_bench.py --no-sweep --out $R > $R/linear.txt 2>&1; tail -14 $R/linear.txt
    e2e e2e_flux37c 300 --models flux --variants default ours-all ours-all+nosplit ours-linear comfy-fp8-fast \
        ours-all+nosplit ours-all default --steps 5
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
        e2e e2e_wan37c 280 --models wan --variants default ours-all comfy-fp8-fast --steps 3
    fi ;;
s37h)  # issue 12 names the H200: spend nothing on another card
    if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then echo "not an H200: nothing run"; exit 0; fi
    timeout 110 python3 benchmarks/linear_bench.py --no-sweep --out $R > $R/linear.txt 2>&1; tail -14 $R/linear.txt
    e2e e2e_flux37h 200 --models flux --variants default ours-all ours-linear comfy-fp8-fast ours-all+nosplit --steps 5
    e2e e2e_wan37h 280 --models wan --variants default ours-all comfy-fp8-fast --steps 3 ;;
s37l)  # the kernel half of issue 12's table on the H200, when too little device time is left for e2e
    if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then echo "not an H200: nothing run"; exit 0; fi
    timeout 110 python3 benchmarks/linear_bench.py --no-sweep --out $R > $R/linear.txt 2>&1; tail -45 $R/linear.txt ;;
s38a)  # on an H200: s37h; on any other card: where the FP8 attention's quantisation time goes (flux, wan)
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then exec bash "$0" s37h; fi
    timeout 200 python3 benchmarks/fp8_quant_bench.py --shapes flux,wan --out $R > $R/quant.txt 2>&1; tail -30 $R/quant.txt ;;
s38b)  # FlashAttention-3's loop order and ping-pong beside lean (kernel table + small-shape accuracy); then on an H200 s37h
    timeout 240 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan,hunyuan --bf16-shapes "" \
      --configs sm90_lean,sm90_pv_behind,sm90_pingpong --rep 100 --acc-heads 1 --small 1 --out $R > $R/gluon.txt 2>&1
    echo "rc $?"; grep -A60 "== accuracy" $R/gluon.txt | head -80
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then exec bash "$0" s37h; fi ;;
s38c)  # s38b's two loops again with acc's rescale moved out of the turn (kernel table, Flux and Wan); then on an H200 s37h
    timeout 150 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan --bf16-shapes "" \
      --configs sm90_lean,sm90_pv_behind,sm90_pingpong --rep 100 --acc-heads 1 --small 1 --out $R > $R/gluon.txt 2>&1
    echo "rc $?"; grep -A80 "== accuracy" $R/gluon.txt | grep -v "(1, 2, \|(2, 3, \|(1, 1, "
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then exec bash "$0" s37h; fi ;;
s38d)  # the statistics reading 1 row in 8 of Q and K: quantisation kernels swept and timed, accuracy of lean; then on an H200 s37h
    timeout 200 python3 benchmarks/fp8_quant_bench.py --shapes flux,wan,hunyuan --sweep --out $R > $R/quant.txt 2>&1
    echo "rc $?"; grep -A30 "^| shape | tuning" $R/quant.txt
    timeout 120 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan,hunyuan --bf16-shapes "" \
      --configs sm90_lean --rep 100 --acc-heads 1 --small 1 --out $R > $R/gluon.txt 2>&1
    echo "rc $?"; grep -A40 "== accuracy" $R/gluon.txt
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then exec bash "$0" s37h; fi ;;
s39a)  # on an H200: s37h first; then the persistent lean kernel beside lean (kernel table, accuracy, bit-equality)
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash "$0" s37h; fi
    timeout 240 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan --bf16-shapes "" \
      --configs sm90_lean,sm90_lean_persistent --rep 100 --acc-heads 1 --small 1 --out $R > $R/gluon.txt 2>&1
    echo "rc $?"; grep -A60 "== accuracy" $R/gluon.txt | grep -v "(1, 2, \|(2, 3, \|(1, 1, " ;;
s39b)  # on an H200: s37h first; then the FP8 kernel over whole and partial waves (gluon_waves_bench.py)
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash "$0" s37h; fi
    timeout 150 python3 benchmarks/gluon_waves_bench.py --configs sm90_lean,sm90_lean_persistent --out $R \
      > $R/waves.txt 2>&1; echo "rc $?"; grep -A20 "== kernel alone" $R/waves.txt ;;
s39c)  # on an H200: s37h first; then the quantisation kernels swept, the whole call and accuracy
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash "$0" s37h; fi
    timeout 200 python3 benchmarks/fp8_quant_bench.py --shapes flux,wan,hunyuan --sweep --out $R > $R/quant.txt 2>&1
    echo "rc $?"; grep -A30 "^| shape | tuning" $R/quant.txt
    timeout 120 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan,hunyuan --bf16-shapes "" \
      --configs sm90_lean --rep 100 --acc-heads 1 --small 1 --out $R > $R/gluon.txt 2>&1
    echo "rc $?"; grep -A40 "== accuracy" $R/gluon.txt ;;
s39d)  # on an H200: s37h; on any other card: this release's end-to-end check, Wan 2.1 14B and Flux 12B (default / Patch)
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then exec bash "$0" s37h; fi
    e2e e2e_wan39 300 --models wan --variants default ours-all --steps 3
    e2e e2e_flux39 200 --models flux --variants default ours-all --steps 5 ;;
s39e)  # on an H200: s37h first; then Nsight Compute's counters of the FP8 kernel (lean) at Flux and Wan sizes
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash "$0" s37h; fi
    for shape in flux wan flux_whole_waves; do
      timeout 150 ncu --clock-control none -k regex:_attn_fp8_gluon_fwd --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
        --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --print-details all \
        python3 benchmarks/fp8_attention_ncu.py --shape $shape > $R/ncu_$shape.txt 2>&1
      echo "== $shape rc $?"; grep -v "^==PROF==" $R/ncu_$shape.txt | grep -iv "warning\|^    ---" | tail -n +1 | head -150
    done
    timeout 100 ncu --clock-control none -k regex:_attn_fp8_gluon_fwd --launch-skip 3 --launch-count 1 \
      --metrics sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second \
      python3 benchmarks/fp8_attention_ncu.py --shape flux > $R/ncu_pipes.txt 2>&1; echo "== pipes rc $?"; grep -v "^==PROF==" $R/ncu_pipes.txt | tail -20 ;;
s39f)  # Nsight Compute's warp states of lean against lean_merged (one mbarrier arrive, one bar.sync a tile fewer)
    for cfg in sm90_lean sm90_lean_merged; do for shape in flux wan; do
      timeout 120 ncu --clock-control none -k regex:_attn_fp8_gluon_fwd --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
        python3 benchmarks/fp8_attention_ncu.py --shape $shape --config $cfg > $R/ncu_${cfg}_$shape.txt 2>&1
      echo "== $cfg $shape rc $?"; grep -E "Duration|Elapsed Cycles|Issue Slots Busy|Warp Cycles Per Issued|Stall (Barrier|Wait|Long|GMMA|Not Sel|Short|Dispatch|MIO|Math)" \
        $R/ncu_${cfg}_$shape.txt | sed 's/  */ /g'
    done; done ;;
s39g)  # lean against lean_merged with do_bench, lean timed again last (sm90_lean@n16: the same config) for the drift
    timeout 240 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan,hunyuan --bf16-shapes "" \
      --configs sm90_lean,sm90_lean_merged,sm90_lean@n16 --rep 200 --acc-heads 1 --small 0 --out $R > $R/gluon.txt 2>&1
    echo "rc $?"; grep -A40 "== TFLOP" $R/gluon.txt ;;
s41)  # s37h's load on any card (the card is the first line of the output)
    timeout 110 python3 benchmarks/linear_bench.py --no-sweep --out $R > $R/linear.txt 2>&1; tail -14 $R/linear.txt
    e2e e2e_flux41 200 --models flux --variants default ours-all ours-linear comfy-fp8-fast --steps 5
    e2e e2e_wan41 280 --models wan --variants default ours-all comfy-fp8-fast --steps 3 ;;
s41a)  # V's mean rounding error out of vmean: quantisation kernels with / without, lean's accuracy and call table
    timeout 200 python3 benchmarks/fp8_quant_bench.py --shapes flux,wan,hunyuan --sweep --out $R > $R/quant.txt 2>&1
    echo "rc $?"; grep -A30 "^| shape | tuning" $R/quant.txt
    timeout 160 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan,hunyuan --bf16-shapes "" \
      --configs sm90_lean --rep 100 --acc-heads 1 --small 1 --out $R > $R/gluon.txt 2>&1
    echo "rc $?"; grep -A40 "== accuracy" $R/gluon.txt ;;
s41c)  # s41a without the small shapes, then issue 12's table (s41): both in one call when machines are scarce
    timeout 130 python3 benchmarks/fp8_quant_bench.py --shapes flux,wan,hunyuan --sweep --out $R > $R/quant.txt 2>&1
    echo "rc $?"; grep -A30 "^| shape | tuning" $R/quant.txt
    timeout 120 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan,hunyuan --bf16-shapes "" \
      --configs sm90_lean --rep 100 --acc-heads 1 --small 0 --out $R > $R/gluon.txt 2>&1
    echo "rc $?"; grep -A40 "== accuracy" $R/gluon.txt
    exec bash "$0" s41 ;;
s41d)  # the V-mean correction summed in fp32 per block: quantisation kernels with / without, lean's accuracy
    timeout 100 python3 benchmarks/fp8_quant_bench.py --shapes flux,wan,hunyuan --sweep --out $R > $R/quant.txt 2>&1
    echo "rc $?"; grep -A12 "^| shape | tuning" $R/quant.txt
    timeout 100 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan,hunyuan --bf16-shapes "" \
      --configs sm90_lean --rep 100 --acc-heads 1 --small 0 --out $R > $R/gluon.txt 2>&1
    echo "rc $?"; grep -A40 "== accuracy" $R/gluon.txt ;;
s42a)  # on an H200: issue 12's table (s37h) then s41d; on any other card: s41d, then Wan default / Patch after the V-mean fix
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash "$0" s37h; bash "$0" s41d; exit 0; fi
    bash "$0" s41d
    e2e e2e_wan42 280 --models wan --variants default ours-all --steps 3 ;;
s42b)  # the V-mean correction's block sums added by a launch of its own: on an H200 s37h first; then s41d; Flux default / Patch
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash "$0" s37h; fi
    timeout 100 python3 benchmarks/fp8_quant_bench.py --shapes flux,wan,hunyuan --sweep --out $R > $R/quant.txt 2>&1
    echo "rc $?"; grep -A12 "^| shape | tuning" $R/quant.txt; tail -4 $R/quant.txt
    timeout 100 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan,hunyuan --bf16-shapes "" \
      --configs sm90_lean --rep 100 --acc-heads 1 --small 0 --out $R > $R/gluon.txt 2>&1
    echo "rc $?"; grep -A40 "== accuracy" $R/gluon.txt
    if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
        e2e e2e_flux42 200 --models flux --variants default ours-all --steps 5
    fi ;;
s42e)  # the least device time: the quantisation sweep (with the whole call against cuDNN), then lean's accuracy
    timeout 90 python3 benchmarks/fp8_quant_bench.py --shapes flux,wan,hunyuan --sweep --out $R > $R/quant.txt 2>&1
    echo "rc $?"; grep -A12 "^| shape | tuning" $R/quant.txt; tail -4 $R/quant.txt
    timeout 75 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan,hunyuan --bf16-shapes "" \
      --configs sm90_lean --rep 50 --acc-heads 1 --small 0 --out $R > $R/gluon.txt 2>&1
    echo "rc $?"; grep -A40 "== accuracy" $R/gluon.txt ;;
s43a)  # PV_SPLIT: lean against its P.V issued in slices; on an H200 s37h first
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash "$0" s37h; fi
    timeout 280 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan,hunyuan --bf16-shapes "" \
      --configs sm90_lean,sm90_lean_pvsplit4,sm90_lean_pvsplit2,sm90_lean@n16 --rep 100 --acc-heads 1 --small 1 \
      --out $R > $R/gluon.txt 2>&1
    echo "rc $?"; grep -A80 "== accuracy" $R/gluon.txt ;;
s43b)  # the sliced P.V end to end (Wan: FP8 attention on; Flux: auto decides per shape)
    e2e e2e_wan43 300 --models wan --variants default ours-all ours-all+pvsplit4 --steps 3
    e2e e2e_flux43 200 --models flux --variants default ours-all ours-all+pvsplit4 --steps 5 ;;
s43c)  # issue 11's table: our FP8 / INT8 / BF16 attention beside every baseline, one run, quantisation included
    OUT=$R CK=$CK STEP_TIMEOUT=420 bash benchmarks/gpu.sh \
      "--only flux_4608_d128,wan14b_32760_d128,hunyuan_33390_d128 --dtypes bf16 --name s43_baselines" > $R/run.txt 2>&1
    echo "rc $?"; tail -60 $R/run.txt ;;
s44a)  # issue 11's side-by-side table with this release's code, then where the quantisation's time goes
    bash "$0" s43c
    timeout 100 python3 benchmarks/fp8_quant_bench.py --shapes flux,wan,hunyuan --sweep --out $R > $R/quant.txt 2>&1
    echo "rc $?"; grep -A12 "^| shape | tuning" $R/quant.txt; tail -4 $R/quant.txt ;;
s44b)  # what the outlier side operands cost: lean, lean without them, lean again
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 240 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux,wan --bf16-shapes "" \
      --configs sm90_lean,sm90_lean@n0,sm90_lean@n16 --rep 100 --acc-heads 1 --small 0 --out $R > $R/gluon.txt 2>&1
    echo "rc $?"; grep -A60 "== accuracy" $R/gluon.txt ;;
s45c)  # Triton 3.9 everything; the machine's release and unpinned on the timed sections; gpu_check.py under 3.9
    carried_39 || exit 1
    t39 timeout 200 python3 benchmarks/triton_release_check.py --out $R > $R/release_39.txt 2>&1; echo "rc $?"
    timeout 120 python3 benchmarks/triton_release_check.py --sections attention,linear,rows --out $R \
      > $R/release_own.txt 2>&1; echo "rc $?"
    timeout 100 python3 benchmarks/triton_release_check.py --tag unpinned --unpinned --sections attention,linear \
      --out $R > $R/release_unpinned.txt 2>&1; echo "rc $?"
    python3 benchmarks/triton_release_check.py --compare $R/release_3.*.json $R/release_unpinned.json > $R/compare.txt 2>&1
    cat $R/compare.txt
    t39 timeout 60 python3 benchmarks/gpu_check.py --jobs 14 > $R/gpu_check_39.txt 2>&1; echo "rc $?"
    tail -3 $R/gpu_check_39.txt ;;
s45d)  # Triton 3.9 with its own Hopper ptxas (13.4): every kernel family; then the Gluon FP8 loop options one by one
    carried_39 || exit 1
    t39 timeout 190 python3 benchmarks/triton_release_check.py --out $R > $R/release_39.txt 2>&1; echo "rc $?"
    grep -v "^{" $R/release_39.txt | grep -v "nanobind\| - leaked\|^See" | tail -40
    t39 timeout 150 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux --bf16-shapes "" \
      --configs sm90_lean,sm90,sm90_permp --rep 30 --acc-heads 1 --small 1 --out $R \
      > $R/gluon_39.txt 2>&1; echo "rc $?"; grep -A40 "== accuracy" $R/gluon_39.txt | head -60 ;;
s45f)  # the least device time: under Triton 3.9 (own ptxas), lean and sm90 at Flux and the small shapes, accuracy
    carried_39 || exit 1
    t39 timeout 150 python3 benchmarks/gluon_attention_bench.py --lite --shapes flux --bf16-shapes flux \
      --configs sm90_lean,sm90 --rep 20 --acc-heads 1 --small 1 --out $R \
      > $R/gluon_39.txt 2>&1; echo "rc $?"; grep -A30 "== accuracy" $R/gluon_39.txt | head -40 ;;
s35w)
    e2e e2e_wan35 380 --models wan --variants default ours-all comfy-fp8-fast --steps 3 ;;
*)  echo "stage: norms, norms-abba, lean, s31, s32, s32b, s32c, s32d, s32e, s33, s33c-s33g, s34, s34b, s35, s35g, s35h, s35j, s35k, s35w, s36, s36h, s36m, s36w, s37, s37b, s37c, s37h, s37l, s38a, s38b, s38c, s38d, s39a, s39b, s39c, s39d, s39e, s39f, s39g, s41, s41a, s41c, s41d, s42a, s42b, s42e, s43a, s43b, s43c, s44a, s44b, s45c, s45d, s45f"; exit 2 ;;
esac

#!/bin/bash
# Pack one Triton release small enough to travel with a device call (64 MiB with the working
# tree), built for the device's Python (3.12 there; the wheels are per CPython version up to
# 3.9's cp312-abi3, and a cp311 libtriton.so segfaults on import under 3.12): the wheel from the
# package registry, its NVIDIA backend only (no AMD code generator, no CUPTI, no profiler, no
# cuobjdump / nvdisasm, one ptxas: the lent cards are Hopper), libtriton.so without
# its debug sections, xz. Triton 3.9.0: 286 MB wheel -> ~51 MB. Unpack there with
#   python3 -c "import tarfile; tarfile.open('.carry/triton-3.9.0.tar.xz').extractall('/tmp/t39')"
# and put /tmp/t39 first on PYTHONPATH (with TRITON_CACHE_DIR pointing at a cache of its own).
#   bash benchmarks/carry_triton.sh 3.9.0 [python version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: carry_triton.sh X.Y.Z [python version]}
py=${2:-3.12}
python=${PYTHON:-python3}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$stage/wheel" "triton==$version"
"$python" -m zipfile -e "$stage"/wheel/triton-*.whl "$stage/tree"
cd "$stage/tree"
rm -rf triton/backends/amd/lib/libtriton_amd_codegen.so triton/backends/nvidia/lib/cupti* triton/_C/libproton.so \
    triton/instrumentation/*.so triton/backends/nvidia/bin/cuobjdump triton/backends/nvidia/bin/nvdisasm
# Releases with a second ptxas (3.9: ptxas-blackwell, CUDA 13.4) compile sm_90 and newer with
# it, and the first (12.9) only below sm_90: keep the one a Hopper card uses, the other a link.
bin=triton/backends/nvidia/bin
if [ -f $bin/ptxas-blackwell ]; then rm $bin/ptxas; ln -s ptxas-blackwell $bin/ptxas; fi
chmod +x $bin/ptxas*
strip --strip-unneeded triton/_C/libtriton.so
cd - >/dev/null
mkdir -p .carry
tar cf - -C "$stage/tree" . | xz -6 -T0 > ".carry/triton-$version.tar.xz"
ls -l ".carry/triton-$version.tar.xz"

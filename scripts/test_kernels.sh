#!/usr/bin/env bash
# Run the test suite once per CPU kernel level, as on older x86-64 CPUs: the same machine made to use the
# kernels (and so the float summation orders) of another instruction set. Stops non-zero at the first level
# that fails. Extra arguments go to pytest. Levels come from VSE_KERNELS (default "native default avx2"):
#   native   whatever this CPU picks (no variables set)
#   avx2     AVX2 kernels: a Haswell..Zen 3 class CPU without AVX-512
#   default  no vector extensions beyond the x86-64-v2 baseline (SSE4.2): ATen's scalar "default" kernels
#   avx512   AVX-512 kernels (only on a CPU that has them)
# The variables: ATEN_CPU_CAPABILITY (torch's own kernels), MKL_ENABLE_INSTRUCTIONS (torch's MKL GEMMs),
# OPENBLAS_CORETYPE (numpy's and FAISS's OpenBLAS), NPY_DISABLE_CPU_FEATURES (numpy's dispatched loops).
# `VSE_KERNELS="native default avx2" bash scripts/test.sh` does the same after setup and lint.
set -euo pipefail
cd "$(dirname "$0")/.."
export VSE_ARTIFACTS="${VSE_ARTIFACTS:-artifacts}"
mkdir -p "$VSE_ARTIFACTS"
for level in ${VSE_KERNELS:-native default avx2}; do
  case "$level" in
    native) vars=() ;;
    avx512) vars=(ATEN_CPU_CAPABILITY=avx512 MKL_ENABLE_INSTRUCTIONS=AVX512 OPENBLAS_CORETYPE=SkylakeX) ;;
    avx2) vars=(ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 OPENBLAS_CORETYPE=Haswell
                NPY_DISABLE_CPU_FEATURES=X86_V4,AVX512_ICL,AVX512_SPR) ;;
    default) vars=(ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 OPENBLAS_CORETYPE=Nehalem
                   NPY_DISABLE_CPU_FEATURES=X86_V3,X86_V4,AVX512_ICL,AVX512_SPR) ;;
    *) echo "VSE_KERNELS: unknown level '$level' (choose from native default avx2 avx512)" >&2; exit 2 ;;
  esac
  echo "== CPU kernels: $level ${vars[*]+${vars[*]}}"
  if ! env ${vars[@]+"${vars[@]}"} .venv/bin/python -m pytest -q "$@"; then
    echo "== the suite failed under CPU kernels: $level ${vars[*]+(${vars[*]})}" >&2
    exit 1
  fi
done

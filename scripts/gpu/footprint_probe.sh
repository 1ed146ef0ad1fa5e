#!/usr/bin/env bash
# Diagnostic: where device memory that no allocation call names appears (modules, the
# device heap, stack and printf limits, green contexts, multicast), natively, with lazy and
# eager module loading. Not part of the matrix; output to the console.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
B=/tmp/cb-gpu
mkdir -p "$B"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
"$NVCC" -O2 -cubin -arch=sm_90 -o "$B/big_module.cubin" "$HERE/cuda/big_module.cu" || exit 1
"$NVCC" -O2 -o "$B/footprint_probe" "$HERE/cuda/footprint_probe.cu" -lcuda || exit 1
for mode in LAZY EAGER; do
  echo "=== CUDA_MODULE_LOADING=$mode"
  CUDA_MODULE_LOADING=$mode timeout 120 "$B/footprint_probe" "$B/big_module.cubin"
done

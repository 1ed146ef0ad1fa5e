#!/usr/bin/env bash
# A module with 1.5 GiB of `__device__` globals in a compressed fatbinary, loaded 20 times
# (as a module, and as a library up to its first look-up) under a 1 GiB budget, is refused
# every time and never appears on the card, as an outside NVML sampler sees it; natively
# it loads and the sampler sees it. Builds the images with nvcc for the device's own
# architecture, cubin only:
#   all        -Xfatbin=-compress-all                         (PyTorch's build does this)
#   size       --compress-mode=size                           (nvcc 12.8 on; may store cubins as they are: SKIP then)
#   all-speed  -Xfatbin=-compress-all --compress-mode=speed   (nvcc 12.8 on: LZ4)
# then runs scripts/gpu/cases/compressed_fatbin.py on them.
#
#   bash scripts/gpu/compressed_fatbin.sh [--lib PATH] [--python PY] [--loads N]
#
# Prints PASS/FAIL/SKIP/INFO lines and a last line "compressed_fatbin: passed|FAILED"
# (run_all.sh runs it as the case compressed_fatbin). Exit status 0 iff no check FAILed.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
LIB="${CB_LIB:-$ROOT/target/release/libcudabudget.so}"
PY="${PYTHON:-python3}"
LOADS=20
while [[ $# -gt 0 ]]; do
  case "$1" in
    --lib) LIB="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --loads) LOADS="$2"; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "compressed_fatbin.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
WORK="$(mktemp -d /tmp/cb-compressed-fatbin-XXXXXX)"

# The device's compute capability, as nvcc spells it (9.0: 90).
CC=$(CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
  head -n 1 | tr -d ' .\r')
if ! [[ $CC =~ ^[0-9]+$ ]]; then
  echo "FAIL compressed_fatbin/setup: no compute capability from nvidia-smi ('$CC')"
  echo "compressed_fatbin: FAILED (work dir $WORK)"
  exit 1
fi

cat >"$WORK/big.cu" <<'EOF'
__device__ char big[1536ull << 20];
extern "C" __global__ void touch(unsigned long long i) { big[i % (1536ull << 20)] = 1; }
EOF

IMAGES=()
BUILD_FAILED=()
build() {  # build NAME NVCC-FLAGS...
  local name=$1
  shift
  if timeout 180 "$NVCC" -fatbin -gencode "arch=compute_$CC,code=sm_$CC" "$@" \
    -o "$WORK/$name.fatbin" "$WORK/big.cu" >"$WORK/nvcc-$name.log" 2>&1; then
    IMAGES+=("$name=$WORK/$name.fatbin")
  else
    echo "FAIL compressed_fatbin[$name]/build: nvcc $*: $(tail -c 400 "$WORK/nvcc-$name.log" | tr '\n' ' ')"
    BUILD_FAILED=(--build-failed)
  fi
}
echo "INFO compressed_fatbin: $("$NVCC" --version | tail -n 1), sm_$CC, work dir $WORK"
build all -Xfatbin=-compress-all
if "$NVCC" --help 2>/dev/null | grep -q -- '--compress-mode'; then
  build size --compress-mode=size
  build all-speed -Xfatbin=-compress-all --compress-mode=speed
else
  echo "SKIP compressed_fatbin[size]: this nvcc has no --compress-mode (CUDA 12.8 on)"
fi

"$PY" "$HERE/cases/compressed_fatbin.py" --lib "$LIB" --loads "$LOADS" --work "$WORK" \
  ${BUILD_FAILED[@]+"${BUILD_FAILED[@]}"} ${IMAGES[@]+"${IMAGES[@]}"}

#!/usr/bin/env bash
# Builds dist/: cudabudget for any Linux with glibc 2.17 or newer, from this machine,
# with only what the package registries provide.
#
#   dist/libcudabudget.so, dist/cudabudget, dist/cudabudget-node     x86_64, glibc >= 2.17
#   dist/aarch64/{libcudabudget.so,cudabudget,cudabudget-node}       aarch64, glibc >= 2.17
#   dist/cudabudget-VERSION-ARCH-linux.tar.gz     the library, the CLI, the node services'
#                                                 binary (webhook, exporter, device
#                                                 plugin) + licenses, per arch
#   dist/cudabudget-VERSION-py3-none-manylinux_2_17_ARCH.manylinux2014_ARCH.whl
#                                                 the library and the CLI (the user's)
#
# How: cargo-zigbuild with Zig from the Python package `ziglang` (both from PyPI, into a
# virtual environment, .dist-venv/ by default), `--target <triple>.2.17`, which links
# against glibc 2.17's symbol versions whatever the host has. The wheel is made by
# scripts/wheel.py (standard library only). Then it checks what it built:
#   - the glibc versions the binaries need (tests/install/glibc_versions.rs, CB_REQUIRE_DIST=1;
#     objdump -T shows the same),
#   - the wheels with `auditwheel show` (manylinux_2_17 / manylinux2014),
#   - the x86_64 wheel in a fresh virtual environment: `cudabudget run --limit 1Gi --`
#     preloads a library that exists, `python -m cudabudget` works, and, against the
#     fake driver (tests/fake_driver, needs a C compiler), a 2 GiB allocation is refused
#     under the 1 GiB budget and the card reads 1 GiB,
#   - part of the test suite against dist/libcudabudget.so (CB_TEST_LIB),
#   - where qemu-user-static and libc6-arm64-cross (Debian) are installed, the aarch64
#     library under emulation against an aarch64 build of the fake driver.
#
# Usage: bash scripts/dist.sh [--arch x86_64|aarch64|all] [--no-wheel] [--no-checks]
#   --arch      what to build (default: all; aarch64 is skipped with a note when rustup
#               cannot add its target)
#   --no-wheel  binaries and tarballs only
#   --no-checks build only
# Environment: DIST_VENV (tool environment, default .dist-venv), DIST_PYTHON (python3),
# CARGO_TARGET_DIR (as cargo), DIST_PIP_SPECS (the tool versions, pinned below).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

ARCHES=(x86_64 aarch64)
WHEEL=1
CHECKS=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --arch)
      case "${2:-}" in
        all) ARCHES=(x86_64 aarch64) ;;
        x86_64|aarch64) ARCHES=("$2") ;;
        *) echo "dist.sh: --arch x86_64|aarch64|all" >&2; exit 2 ;;
      esac
      shift 2 ;;
    --no-wheel) WHEEL=0; shift ;;
    --no-checks) CHECKS=0; shift ;;
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    *) echo "dist.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

say() { printf '\n== %s\n' "$*"; }
PYTHON=${DIST_PYTHON:-python3}
VENV=${DIST_VENV:-$ROOT/.dist-venv}
PIP_SPECS=${DIST_PIP_SPECS:-ziglang==0.17.1 cargo-zigbuild==0.24.1 auditwheel==6.8.2}
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
VERSION=$(sed -n 's/^version *= *"\(.*\)"/\1/p' Cargo.toml | head -1)
DIST=$ROOT/dist

say "tools: $PIP_SPECS in $VENV"
if [[ ! -x $VENV/bin/python ]]; then
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check $PIP_SPECS
export PATH="$VENV/bin:$PATH"   # cargo-zigbuild finds zig through `python -m ziglang`
cargo --version
cargo-zigbuild --version
echo "zig $("$VENV/bin/python" -m ziglang version)"

rm -rf "$DIST"
mkdir -p "$DIST"
BUILT=()
for arch in "${ARCHES[@]}"; do
  triple=$arch-unknown-linux-gnu
  if ! rustup target list --installed 2>/dev/null | grep -qx "$triple"; then
    say "rustup target add $triple"
    if ! rustup target add "$triple"; then
      if [[ $arch == x86_64 ]]; then
        echo "dist.sh: cannot add the $triple target" >&2
        exit 1
      fi
      echo "dist.sh: rustup cannot add $triple here; skipping $arch" >&2
      continue
    fi
  fi
  say "build $arch (glibc 2.17): cargo zigbuild --release --target $triple.2.17"
  cargo zigbuild --release --locked --target "$triple.2.17" --lib --bin cudabudget
  say "build $arch (glibc 2.17): cargo zigbuild --release --target $triple.2.17 -p cudabudget-node"
  cargo zigbuild --release --locked --target "$triple.2.17" -p cudabudget-node --bin cudabudget-node
  out=$TARGET_DIR/$triple/release
  dest=$DIST
  [[ $arch == x86_64 ]] || dest=$DIST/$arch
  mkdir -p "$dest"
  cp "$out/libcudabudget.so" "$out/cudabudget" "$out/cudabudget-node" "$dest/"
  tardir=cudabudget-$VERSION-$arch-linux
  mkdir -p "$DIST/.tar/$tardir"
  cp "$dest/libcudabudget.so" "$dest/cudabudget" "$dest/cudabudget-node" LICENSE-MIT LICENSE-APACHE \
    "$DIST/.tar/$tardir/"
  tar -C "$DIST/.tar" --owner=0 --group=0 --numeric-owner --sort=name \
    --mtime=@0 -czf "$DIST/$tardir.tar.gz" "$tardir"
  rm -rf "$DIST/.tar"
  if [[ $WHEEL == 1 ]]; then
    "$VENV/bin/python" scripts/wheel.py --version "$VERSION" --arch "$arch" \
      --cli "$dest/cudabudget" --lib "$dest/libcudabudget.so" --out "$DIST" \
      --license LICENSE-MIT --license LICENSE-APACHE >/dev/null
  fi
  BUILT+=("$arch")
done

say "dist/"
(cd "$DIST" && find . -type f -printf '%10s  %p\n' | sort -k2)

[[ $CHECKS == 1 ]] || exit 0

say "glibc versions (objdump -T: newest GLIBC_ needed)"
for f in "$DIST"/{,aarch64/}{libcudabudget.so,cudabudget,cudabudget-node}; do
  [[ -f $f ]] || continue
  if command -v objdump >/dev/null; then
    printf '%-28s %s\n' "${f#"$ROOT"/}" \
      "$(objdump -T "$f" | grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -1)"
  fi
done
GLOG=$(mktemp)
if CB_REQUIRE_DIST=1 CB_DIST_DIR="$DIST" cargo test --locked --test tests install::glibc_versions -- --nocapture >"$GLOG" 2>&1; then
  grep -E 'newest glibc|test result' "$GLOG"
  rm -f "$GLOG"
else
  grep -vE '^ *(Compiling|Downloaded|Downloading)' "$GLOG" | tail -40
  echo "dist.sh: tests/install/glibc_versions.rs failed: a binary in dist/ would not load on glibc 2.17" >&2
  exit 1
fi

if [[ $WHEEL == 1 ]]; then
  say "auditwheel show"
  for w in "$DIST"/*.whl; do
    auditwheel show "$w" | tr -s '\n' | head -4
  done
fi

# The fake driver, for the checks below (a C compiler is needed for this part only).
FAKE=$(mktemp -d)
trap 'rm -rf "$FAKE"' EXIT
HAVE_FAKE=0
if cc -std=gnu11 -O2 -shared -fPIC -Wl,-soname,libcuda.so.1 -pthread -Itests/fake_driver \
    -o "$FAKE/libcuda.so.1" tests/fake_driver/fake_cuda.c 2>"$FAKE/cc.log"; then
  HAVE_FAKE=1
else
  echo "dist.sh: no fake driver (C compiler failed: $(head -c 300 "$FAKE/cc.log")); skipping the budget checks" >&2
fi

# A ctypes client: what the process sees and whether 2 GiB is refused. Prints one line.
CLIENT='
import ctypes, os
cuda = ctypes.CDLL("libcuda.so.1")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
free, total = ctypes.c_size_t(), ctypes.c_size_t()
assert cuda.cuInit(0) == 0
assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
assert cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
small = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(256 << 20))
big = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(2 << 30))
print("total=%d small_rc=%d big_rc=%d preload=%s" % (total.value, small, big, os.environ.get("LD_PRELOAD", "")))
'

FAILED=0
verdict() {  # verdict NAME DETAIL COMMAND...: PASS when COMMAND succeeds
  local name=$1 detail=$2
  shift 2
  if "$@"; then echo "PASS $name $detail"; else echo "FAIL $name $detail"; FAILED=1; fi
}

if [[ $WHEEL == 1 && " ${BUILT[*]} " == *" x86_64 "* && $(uname -m) == x86_64 ]]; then
  say "the x86_64 wheel in a fresh virtual environment"
  # Not under /tmp: `cudabudget run` preloads nothing from a directory other users may
  # write (sticky or not), and the wheel's CLI finds its library beside it in the venv.
  mkdir -p "$ROOT/target"
  # A clone under a directory others may write (/tmp): the venv goes where nobody else
  # can (root's /var/lib), as the test suite's copies do.
  CHECK_PARENT="$ROOT/target"
  dir=$(cd "$CHECK_PARENT" && pwd -P)
  while [[ -n $dir ]]; do
    if [[ -n $(find "$dir" -maxdepth 0 -perm /022 2>/dev/null) ]]; then
      if [[ $(id -u) == 0 ]]; then CHECK_PARENT=/var/lib; else
        echo "dist.sh: $dir may be written by others: the wheel check needs a clone outside it (or root)" >&2
        exit 1
      fi
      break
    fi
    [[ $dir == / ]] && break
    dir=$(dirname "$dir")
  done
  VCHECK=$(mktemp -d "$CHECK_PARENT/cudabudget-dist-check.XXXXXX")
  trap 'rm -rf "$FAKE" "$VCHECK"' EXIT
  "$PYTHON" -m venv "$VCHECK/venv"
  "$VCHECK/venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-index \
    "$DIST"/cudabudget-"$VERSION"-*x86_64*.whl
  "$VCHECK/venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null | grep -i '^cudabudget'
  # LD_PRELOAD as the CLI sets it, for a command that is not a CUDA program.
  pre=$(env -u CUDABUDGET_LIB "$VCHECK/venv/bin/cudabudget" run --limit 1Gi -- \
    sh -c 'printf %s "$LD_PRELOAD"' 2>&1 || true)
  verdict wheel/cli_preloads_a_library_that_exists "[LD_PRELOAD=$pre]" \
    test -f "$pre" -a "${pre#"$VCHECK"/venv/}" != "$pre"
  got=$(env -u CUDABUDGET_LIB "$VCHECK/venv/bin/python" -m cudabudget run --limit 1Gi -- \
    sh -c 'printf "%s %s" "$CUDABUDGET_LIMIT" "$LD_PRELOAD"' 2>&1 || true)
  verdict wheel/python_-m_cudabudget "[$got]" test "$got" = "1Gi $pre"
  if [[ $HAVE_FAKE == 1 ]]; then
    got=$(env -u CUDABUDGET_LIB LD_LIBRARY_PATH="$FAKE" "$VCHECK/venv/bin/cudabudget" run --limit 1Gi -- \
      "$VCHECK/venv/bin/python" -c "$CLIENT" 2>&1 | tail -1 || true)
    verdict wheel/budget_applies_on_the_fake_driver "[$got]" \
      test "${got%% preload=*}" = "total=1073741824 small_rc=0 big_rc=2"
    got=$(env -u LD_PRELOAD LD_LIBRARY_PATH="$FAKE" "$VCHECK/venv/bin/python" -c "$CLIENT" 2>&1 | tail -1 || true)
    verdict wheel/without_it_2GiB_fits "[$got]" test "${got%% preload=*}" = "total=85899345920 small_rc=0 big_rc=0"
  fi
fi

if [[ " ${BUILT[*]} " == *" x86_64 "* && $(uname -m) == x86_64 ]]; then
  say "the test suite's budget, view, loader, allocation-path, fork/capture and footprint tests against dist/libcudabudget.so"
  if CB_TEST_LIB="$DIST/libcudabudget.so" cargo test --locked \
      --test tests -- budgets:: views:: loaders:: allocation_paths:: fork_and_capture:: footprint:: --skip live_budgets:: \
      >"$FAKE/suite.log" 2>&1; then
    verdict suite/dist_library "[$(grep '^test result' "$FAKE/suite.log" | awk '{s+=$4} END {print s}') tests passed]" true
  else
    verdict suite/dist_library "[see below]" false
    grep -vE '^ *(Compiling|Downloaded|Downloading)' "$FAKE/suite.log" | tail -40
  fi
fi

if [[ " ${BUILT[*]} " == *" aarch64 "* ]] && command -v qemu-aarch64-static >/dev/null \
    && [[ -e /usr/aarch64-linux-gnu/lib/ld-linux-aarch64.so.1 ]]; then
  say "aarch64 under qemu-user (the glibc of libc6-arm64-cross): fake driver and C client built by zig cc"
  A64=$FAKE/aarch64
  mkdir -p "$A64"
  ZCC=("$VENV/bin/python" -m ziglang cc -target aarch64-linux-gnu.2.17 -std=gnu11 -O2 -Itests/fake_driver)
  if "${ZCC[@]}" -shared -fPIC -Wl,-soname,libcuda.so.1 -pthread -o "$A64/libcuda.so.1" tests/fake_driver/fake_cuda.c \
      && ln -sf libcuda.so.1 "$A64/libcuda.so" \
      && "${ZCC[@]}" -o "$A64/client" tests/fake_driver/client.c -ldl -pthread \
      && "${ZCC[@]}" -DLINKED -L"$A64" -o "$A64/client_linked" tests/fake_driver/client.c -lcuda -ldl -pthread; then
    Q=(qemu-aarch64-static -L /usr/aarch64-linux-gnu -E LD_LIBRARY_PATH="$A64"
       -E LD_PRELOAD="$DIST/aarch64/libcudabudget.so" -E CUDABUDGET_LIMIT=8Gi -E CUDABUDGET_LOG=off)
    for mode in gpa linked dlsym; do
      bin=$A64/client
      [[ $mode == linked ]] && bin=$A64/client_linked
      got=$("${Q[@]}" "$bin" $mode alloc:5Gi alloc:4Gi info 2>&1 | grep -E '^(alloc|info)' | tr '\n' ' ' || true)
      rcs=$(grep -o 'alloc rc=[0-9]*' <<<"$got" | tr '\n' ' ')
      verdict "aarch64/${mode}_budget_applies" "[$got]" test "$rcs" = "alloc rc=0 alloc rc=2 "
    done
    # The exported dlsym forwards RTLD_NEXT with the caller's return address intact: a
    # third-party preload after ours that wraps getpagesize through RTLD_NEXT still
    # reaches libc's (else it would find itself and recurse until the stack overflows).
    if "${ZCC[@]}" -shared -fPIC -o "$A64/libthirdparty.so" tests/fake_driver/thirdparty.c -ldl; then
      QT=(qemu-aarch64-static -L /usr/aarch64-linux-gnu -E LD_LIBRARY_PATH="$A64"
          -E LD_PRELOAD="$DIST/aarch64/libcudabudget.so:$A64/libthirdparty.so" -E CUDABUDGET_LIMIT=8Gi -E CUDABUDGET_LOG=off)
      got=$("${QT[@]}" "$A64/client" dlsym pagesize alloc:9Gi 2>&1 | grep -E '^(pagesize|alloc)' | tr '\n' ' ' || true)
      verdict aarch64/rtld_next_preload_still_works "[$got]" \
        bash -c '[[ $1 =~ pagesize\ .*value=[1-9] && $1 == *"alloc rc=2"* ]]' _ "$got"
    fi
  else
    echo "dist.sh: zig cc could not build the aarch64 fake driver; skipping the emulated check" >&2
  fi
fi

say "done"
if [[ $FAILED != 0 ]]; then
  echo "dist.sh: some checks FAILED" >&2
  exit 1
fi

#!/bin/sh
# cudabudget container entrypoint: runs the command under the device-memory budget
# that the environment gives, or refuses to run it at all.
#
#   entrypoint.sh CMD [ARG...]   exec `cudabudget run -- CMD ARG...`
#   entrypoint.sh --check        only check that the library and the CLI work here
#
# The budget comes from CUDABUDGET_LIMIT / CUDABUDGET_LIMIT_<N>, or, when none of those
# is set, from HAMi's CUDA_DEVICE_MEMORY_LIMIT / CUDA_DEVICE_MEMORY_LIMIT_<N>.
# `cudabudget run` validates every value before anything starts; this script adds
# what only the container knows: the files are there and the library loads in this
# image. It never runs a command unbudgeted: every failure exits non-zero before the
# command starts with 125, as `cudabudget run` and `docker run` do for their own failures
# (no budget, no command, a value the library refuses, cudabudget cannot work here);
# a command that cannot be executed exits 126, one not found 127.
#
# The library and the CLI are looked up next to this script (/opt/cudabudget in the
# image); CUDABUDGET_LIB names another library, as for `cudabudget run`.
set -eu

here=$(dirname -- "$0")
cli="$here/cudabudget"
lib="${CUDABUDGET_LIB:-$here/libcudabudget.so}"

refuse() {
    status=$1
    shift
    printf 'cudabudget entrypoint: %s\n' "$*" >&2
    exit "$status"
}

if [ ! -f "$lib" ]; then
    refuse 125 "the library $lib is missing, so the command cannot be budgeted; nothing was run (install it there, or set CUDABUDGET_LIB to its path)"
fi
if [ ! -x "$cli" ]; then
    refuse 125 "the cudabudget CLI $cli is missing or not executable; nothing was run"
fi

# A library the dynamic loader cannot preload (a glibc older than the one it was built
# against, another architecture, a musl image) is skipped by ld.so with one line, and
# the program would run unbudgeted: try it on a program that does nothing first.
probe=
for candidate in /usr/bin/true /bin/true; do
    if [ -x "$candidate" ]; then
        probe=$candidate
        break
    fi
done
if [ -z "$probe" ]; then
    refuse 125 "no /usr/bin/true or /bin/true to check that $lib loads in this image; nothing was run"
fi
if ! loader=$(LD_PRELOAD="$lib" "$probe" 2>&1) || [ -n "$loader" ]; then
    refuse 125 "$lib cannot be preloaded in this image, so the command would run unbudgeted; nothing was run. The loader said: $loader"
fi
if ! version=$("$cli" --version 2>&1); then
    refuse 125 "$cli does not run in this image: $version; nothing was run"
fi

if [ "${1-}" = "--check" ]; then
    if [ "$#" -ne 1 ]; then
        refuse 125 "--check takes no arguments"
    fi
    printf 'cudabudget entrypoint: %s works here; %s preloads\n' "$version" "$lib"
    exit 0
fi

if [ "$#" -eq 0 ]; then
    refuse 125 "no command given; usage: entrypoint.sh CMD [ARG...]"
fi

# A budget variable must be present; `cudabudget run` then checks its value (and
# refuses HAMi's "0", which means no limit).
if ! env | grep -Eq '^(CUDABUDGET_LIMIT|CUDA_DEVICE_MEMORY_LIMIT)(_[0-9]+)?='; then
    refuse 125 "no budget in the environment: set CUDABUDGET_LIMIT (e.g. -e CUDABUDGET_LIMIT=20Gi), CUDABUDGET_LIMIT_<N> for device N, or HAMi's CUDA_DEVICE_MEMORY_LIMIT; nothing was run"
fi

exec "$cli" run -- "$@"

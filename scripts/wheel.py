#!/usr/bin/env python3
"""Builds the cudabudget wheel from a CLI and a library built elsewhere (scripts/dist.sh).

    python3 scripts/wheel.py --version 0.1.0 --arch x86_64 \
        --cli dist/cudabudget --lib dist/libcudabudget.so --out dist/

The wheel holds one Python package, `cudabudget`, with both binaries side by side:

    cudabudget/__init__.py         main(): exec the CLI; binary(), library(): their paths
    cudabudget/__main__.py         python -m cudabudget
    cudabudget/bin/cudabudget      the CLI
    cudabudget/bin/libcudabudget.so

and a console script `cudabudget` = `cudabudget:main`, so `pip install` puts `cudabudget`
on PATH. The CLI looks for the library next to its own executable, where it is here: no
variable to set, no CLI change. (maturin's `bindings = "bin"` would put the CLI alone in the
environment's bin/ directory, away from the library.)

Tagged `py3-none-manylinux_2_17_<arch>.manylinux2014_<arch>`: the launcher is pure Python
(3.6+), and both binaries need glibc 2.17 at most, which scripts/dist.sh checks before it
calls this. Only the standard library is used; the archive is reproducible (fixed
timestamps, sorted entries).
"""

import argparse
import base64
import hashlib
import os
import sys
import zipfile

NAME = "cudabudget"
SUMMARY = (
    "Hard per-process device-memory budgets for CUDA, enforced by interposing the driver API"
)
HOMEPAGE_NOTE = "The LD_PRELOAD library and the `cudabudget` CLI, for x86_64 and aarch64 Linux."
# The zip's entry dates (zip cannot store earlier than 1980).
EPOCH = (1980, 1, 1, 0, 0, 0)

INIT = '''"""cudabudget: hard device-memory budgets for CUDA processes.

`cudabudget run --limit 20Gi -- python train.py` runs a command with the budget; the
library it preloads is `library()`, for LD_PRELOAD lines of your own.
"""

import os
import sys

__version__ = "{version}"

_BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin")


def binary():
    """The path of the `cudabudget` CLI inside this package."""
    return os.path.join(_BIN, "cudabudget")


def library():
    """The path of `libcudabudget.so` inside this package (what the CLI preloads)."""
    return os.path.join(_BIN, "libcudabudget.so")


def main():
    """Replaces this process by the CLI, with the same arguments.

    The CLI finds the library next to its own executable, so nothing else is needed.
    """
    exe = binary()
    try:
        os.execv(exe, ["cudabudget"] + sys.argv[1:])
    except OSError as e:
        sys.stderr.write("cudabudget: cannot run {{}}: {{}}\\n".format(exe, e))
        sys.exit(127)
'''

MAIN = '''from cudabudget import main

main()
'''


def record_hash(data):
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def metadata(version, readme):
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {NAME}",
        f"Version: {version}",
        f"Summary: {SUMMARY}",
        "License: MIT OR Apache-2.0",
        "Requires-Python: >=3.6",
        "Platform: Linux",
        "Classifier: Operating System :: POSIX :: Linux",
        "Classifier: Environment :: GPU :: NVIDIA CUDA",
        "Classifier: License :: OSI Approved :: MIT License",
        "Classifier: License :: OSI Approved :: Apache Software License",
        "Description-Content-Type: text/markdown",
        "",
        readme,
    ]
    return "\n".join(lines)


def build(version, arch, cli, lib, out, licenses):
    tag = f"py3-none-manylinux_2_17_{arch}.manylinux2014_{arch}"
    wheel_name = f"{NAME}-{version}-{tag}.whl"
    dist_info = f"{NAME}-{version}.dist-info"
    readme = (
        f"# cudabudget {version}\n\n{SUMMARY}.\n\n{HOMEPAGE_NOTE}\n\n"
        "```sh\ncudabudget run --limit 20Gi -- python train.py\n"
        "python -m cudabudget run --limit 20Gi -- python train.py\n"
        "python -c 'import cudabudget; print(cudabudget.library())'   # for LD_PRELOAD\n```\n"
    )

    entries = []  # (name, bytes, executable)

    def add(name, data, executable=False):
        if isinstance(data, str):
            data = data.encode("utf-8")
        entries.append((name, data, executable))

    def read(path):
        with open(path, "rb") as f:
            return f.read()

    add(f"{NAME}/__init__.py", INIT.format(version=version))
    add(f"{NAME}/__main__.py", MAIN)
    add(f"{NAME}/bin/cudabudget", read(cli), executable=True)
    add(f"{NAME}/bin/libcudabudget.so", read(lib), executable=True)
    add(f"{dist_info}/METADATA", metadata(version, readme))
    add(
        f"{dist_info}/WHEEL",
        "Wheel-Version: 1.0\n"
        "Generator: cudabudget scripts/wheel.py\n"
        "Root-Is-Purelib: false\n"
        f"Tag: py3-none-manylinux_2_17_{arch}\n"
        f"Tag: py3-none-manylinux2014_{arch}\n",
    )
    add(f"{dist_info}/entry_points.txt", f"[console_scripts]\n{NAME} = {NAME}:main\n")
    add(f"{dist_info}/top_level.txt", f"{NAME}\n")
    for path in licenses:
        add(f"{dist_info}/licenses/{os.path.basename(path)}", read(path))

    record_name = f"{dist_info}/RECORD"
    record = "".join(f"{n},{record_hash(d)},{len(d)}\n" for n, d, _ in entries)
    record += f"{record_name},,\n"
    add(record_name, record)

    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, wheel_name)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data, executable in entries:
            info = zipfile.ZipInfo(name, date_time=EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            # Unix mode in the high 16 bits: pip gives executable entries their x bits.
            info.external_attr = ((0o100755 if executable else 0o100644) & 0xFFFF) << 16
            z.writestr(info, data)
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--version", required=True)
    p.add_argument("--arch", required=True, choices=["x86_64", "aarch64"])
    p.add_argument("--cli", required=True, help="the cudabudget binary")
    p.add_argument("--lib", required=True, help="libcudabudget.so")
    p.add_argument("--out", required=True, help="directory for the .whl")
    p.add_argument("--license", action="append", default=[], help="a license file (repeatable)")
    a = p.parse_args()
    print(build(a.version, a.arch, a.cli, a.lib, a.out, a.license))


if __name__ == "__main__":
    sys.exit(main())

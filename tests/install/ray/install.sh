#!/usr/bin/env bash
# Installs Ray from PyPI into a virtual environment under DIR (default target/ray), for
# tests/install/ray.rs, and prints the variable the test reads:
#
#   ray 2.60.0    plain `ray` (no extras: no dashboard, no autoscaler's cloud providers)
#
# Needs python3 with venv and pip. Never touches the system's python.
#
#   bash tests/install/ray/install.sh [DIR]
#   eval "$(bash tests/install/ray/install.sh DIR | grep '^export ')"
set -euo pipefail

DIR=$(mkdir -p "${1:-target/ray}" && cd "${1:-target/ray}" && pwd)
RAY=ray==2.60.0

if [[ ! -x $DIR/venv/bin/python ]]; then
  python3 -m venv "$DIR/venv"
fi
"$DIR/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$RAY"

"$DIR/venv/bin/ray" --version >&2
echo "export CB_RAY_VENV=$DIR/venv"

#!/usr/bin/env bash
# Install the fork from this offline kit, with no network.
#   bash install.sh VENV [--python PY] [--system-site-packages] [--check]
# VENV is created if missing (with PY, default python3 on PATH; it must be the
# Python the kit was made for, kit.json says which) and the kit's wheels are
# installed into it with pip --no-index --require-hashes. A split kit's parts
# are checked against MANIFEST.json and joined first: a missing or corrupt part
# is named and nothing is installed. A kit made with --use-system-torch uses the
# box's torch: a new VENV then sees the system's packages, and an existing one
# must already have that torch. A VENV this script created is removed again if
# the install fails.
#   --python PY              the interpreter for a new VENV (a command or a path)
#   --system-site-packages   let a new VENV see the system's packages (implied by
#                            a kit made with --use-system-torch)
#   --check                  only verify the kit (parts, hashes, interpreter); install nothing
set -euo pipefail
KIT=$(cd "$(dirname "$0")" && pwd)
PY=python3
ARGS=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --python) PY=${2:?--python needs an interpreter, e.g. python3.12}; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "install.sh: no interpreter '$PY': name the kit's Python with --python (kit.json says which version)" >&2
  exit 2
fi
exec "$PY" "$KIT/install_kit.py" --kit "$KIT" "${ARGS[@]}"

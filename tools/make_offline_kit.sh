#!/usr/bin/env bash
# Make an offline install kit of the fork: its wheel, every dependency wheel for
# one interpreter and platform, a lock of their sha256 hashes and an installer.
#   bash tools/make_offline_kit.sh [--python 3.12] [--target cuda|cpu] [--use-system-torch]
#        [--with-requirements FILE]... [--split 60M] OUT
# Run it on a machine with network, the same CPU architecture as the box and a
# glibc no newer than the box's (pip picks the wheels this machine could run).
# On the box: `bash OUT/install.sh VENV [--python PY]` (OUT/install.sh --help).
#   --python X.Y          the box's Python (default: this machine's python3); found on
#                         PATH as pythonX.Y or under pyenv's versions
#   --target cuda|cpu     which build of the fork (default cuda)
#   --use-system-torch    leave out torch and what only torch needs: the box's own torch
#                         (e.g. 2.11.0+cu130 in its image) serves instead
#   --with-requirements F also resolve the requirement file F (repeatable), e.g.
#                         tests/requirements.txt to run the suite or tools/run_gpu_checks.sh
#   --split SIZE          the kit as numbered parts of at most SIZE (e.g. 60M, 1G) plus a
#                         manifest with each part's sha256, for transfers in pieces
# The kit also carries this checkout's tracked files (src.tar), so the box has
# tests/ and tools/ of the very version it installs. Nothing is left at OUT on
# failure: the kit is made beside it and moved into place when complete.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }
PY_VERSION="" TARGET=cuda SYSTEM_TORCH=0 SPLIT="" OUT="" REQS=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --python) PY_VERSION=${2:?--python needs a version, e.g. 3.12}; shift 2 ;;
    --target) TARGET=${2:?--target needs cuda or cpu}; shift 2 ;;
    --use-system-torch) SYSTEM_TORCH=1; shift ;;
    --with-requirements) REQS+=("$(realpath -m "${2:?--with-requirements needs a file}")"); shift 2 ;;
    --split) SPLIT=${2:?--split needs a size, e.g. 60M}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "make_offline_kit.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) [ -z "$OUT" ] || { echo "make_offline_kit.sh: one OUT directory only (got $OUT and $1)" >&2; exit 2; }
       OUT=$1; shift ;;
  esac
done
[ -n "$OUT" ] || { echo "make_offline_kit.sh: say where the kit goes: make_offline_kit.sh [options] OUT" >&2; exit 2; }
case "$TARGET" in cuda|cpu) ;; *) echo "make_offline_kit.sh: unknown target '$TARGET': use cuda or cpu" >&2; exit 2 ;; esac
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT" 2>/dev/null || echo file)" ]; then
  echo "make_offline_kit.sh: $OUT already exists and is not empty: remove it or name a new directory" >&2
  exit 2
fi
for req in "${REQS[@]}"; do [ -f "$req" ] || { echo "make_offline_kit.sh: no requirement file $req" >&2; exit 2; }; done

# The interpreter the kit is for: markers such as python_version are evaluated
# by the Python that resolves, so the resolution runs on that very version.
source tools/lib/find_python.sh
PY=$(find_python "$PY_VERSION") || {
  echo "make_offline_kit.sh: no Python $PY_VERSION here (neither python$PY_VERSION on PATH nor under pyenv's versions): install it, or name another with --python" >&2
  exit 2
}

mkdir -p "$(dirname "$OUT")"
OUT=$(realpath -m "$OUT")
WORK=$(mktemp -d "$(dirname "$OUT")/.$(basename "$OUT").partial.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
printf '==> making the %s kit for %s in %s\n' "$TARGET" "$("$PY" -V 2>&1)" "$OUT" >&2
# The maker's own venv (pip new enough for --report, and packaging): not part of the kit.
"$PY" -m venv "$WORK/maker"
"$WORK/maker/bin/python" -m pip install -q --disable-pip-version-check --upgrade "pip>=24" "packaging>=23"

ARGS=(--kit "$WORK/kit" --target "$TARGET" --root "$ROOT")
[ "$SYSTEM_TORCH" = 1 ] && ARGS+=(--use-system-torch)
[ -n "$SPLIT" ] && ARGS+=(--split "$SPLIT")
for req in "${REQS[@]}"; do ARGS+=(--with-requirements "$req"); done
"$WORK/maker/bin/python" tools/offline_kit/make.py "${ARGS[@]}"

rmdir "$OUT" 2>/dev/null || true
mv "$WORK/kit" "$OUT"
printf '==> kit ready: %s (%s); on the box: bash %s/install.sh VENV\n' "$OUT" "$(du -sh "$OUT" | cut -f1)" "$OUT" >&2

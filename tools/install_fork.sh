#!/usr/bin/env bash
# Build this checkout's fork wheel and install it into a virtual environment.
#   bash tools/install_fork.sh [--reinstall | --check] [cuda|cpu|auto] [extra requirement files...]
# auto (default): cuda when an NVIDIA GPU answers nvidia-smi, else cpu.
# An install that is up to date (same target, sources, patches and pins as the last one
# in this venv, and the same requirement files unless none are given) is kept as it is.
#   --reinstall   build and install it again even so
#   --check       only say whether it is up to date (exit 0 up to date, 3 not)
# Env (docs/settings.md): VLLM_FORK_VENV (default .venv), PYTHON (default python3), and the
# build's own VLLM_FORK_BASE_WHEEL / VLLM_FORK_OFFLINE for offline machines.
# VLLM_FORK_VENV_SYSTEM_SITE=1 creates the venv with --system-site-packages,
# so an image's own torch (e.g. a CUDA build on an offline GPU box) is used.
# VLLM_FORK_INSTALLER=uv|pip|auto (default auto: uv unless offline) installs the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VLLM_FORK_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
for gone in VLLM_FORK_REINSTALL VLLM_FORK_INSTALL_CHECK; do
  if [ -n "${!gone:-}" ]; then
    echo "install_fork.sh: $gone is no longer read: pass --reinstall or --check instead (unset $gone)" >&2
    exit 2
  fi
done
REINSTALL=0 CHECK_ONLY=0 POSITIONAL=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --reinstall) REINSTALL=1 ;;
    --check) CHECK_ONLY=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "install_fork.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) POSITIONAL+=("$1") ;;
  esac
  shift
done
if [ "$REINSTALL" = 1 ] && [ "$CHECK_ONLY" = 1 ]; then
  echo "install_fork.sh: --reinstall and --check exclude each other" >&2
  exit 2
fi
set -- "${POSITIONAL[@]+"${POSITIONAL[@]}"}"
TARGET=${1:-auto}
shift || true
step() { printf '\n==> %s\n' "$*" >&2; }

if [ "$TARGET" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then TARGET=cuda; else TARGET=cpu; fi
fi
case "$TARGET" in
  cuda|cpu) ;;
  *) echo "unknown target '$TARGET': use cuda, cpu or auto" >&2; exit 2 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV"
  VENV_ARGS=()
  if [ "${VLLM_FORK_VENV_SYSTEM_SITE:-0}" = 1 ]; then VENV_ARGS+=(--system-site-packages); fi
  "$PYTHON" -m venv "${VENV_ARGS[@]}" "$VENV"
fi

# What the wheel and its installation are made from. When none of it changed
# since this venv's last install and that wheel is still there, the install is
# up to date: nothing is built or installed again (--reinstall does).
# The extra requirement files count apart: an install asked for without them
# keeps one made with them (tools/serve.sh after tools/run_tests.sh), since
# reinstalling the fork under running engines breaks their imports.
fingerprint() {
  "$VENV/bin/python" - "$TARGET" "$@" <<'PY'
import hashlib, os, sys
from pathlib import Path

h = hashlib.sha256(sys.argv[1].encode())
files = [Path("pyproject.toml")]
for folder in ("forkbuild", "patches", "vllm"):
    files += sorted(p for p in Path(folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
for path in files:
    h.update(f"{path}\0".encode())
    h.update(path.read_bytes() if path.is_file() else b"(missing)")
for name in ("VLLM_FORK_BASE_WHEEL", "VLLM_FORK_INSTALLER", "VLLM_FORK_VENV_SYSTEM_SITE"):
    h.update(f"{name}={os.environ.get(name, '')}\0".encode())
print(h.hexdigest())
PY
}
requirements_fingerprint() {
  if [ $# -eq 0 ]; then echo none; return; fi
  "$VENV/bin/python" - "$@" <<'PY'
import hashlib, sys
from pathlib import Path

h = hashlib.sha256()
for name in sys.argv[1:]:
    path = Path(name)
    h.update(f"{path}\0".encode())
    h.update(path.read_bytes() if path.is_file() else b"(missing)")
print(h.hexdigest())
PY
}
STAMP="$VENV/.vllm-fork-install"
FINGERPRINT=$(fingerprint)
REQS_FINGERPRINT=$(requirements_fingerprint "$@")
up_to_date() {
  [ "$REINSTALL" != 1 ] && [ -f "$STAMP" ] && [ "$(sed -n 1p "$STAMP")" = "$FINGERPRINT" ] || return 1
  [ "$REQS_FINGERPRINT" = none ] || [ "$(sed -n 3p "$STAMP")" = "$REQS_FINGERPRINT" ] || return 1
  WHEEL=$(sed -n 2p "$STAMP")
  [ -f "$WHEEL" ] && "$VENV/bin/python" -c 'import importlib.metadata as m, sys, vllm.fork.info
sys.exit(m.version("vllm") != sys.argv[1])' "$(basename "$WHEEL" | cut -d- -f2)" 2>/dev/null
}
if up_to_date; then
  step "up to date: $(basename "$WHEEL") is installed in $VENV and nothing it is made from changed (--reinstall installs it again)"
  echo "$WHEEL"
  exit 0
fi
# --check: only say whether the install is up to date (exit 0 above, else 3).
if [ "$CHECK_ONLY" = 1 ]; then
  step "not up to date: $VENV needs the fork built and installed"
  exit 3
fi
rm -f "$STAMP"

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade "pip>=24"

step "building the fork's $TARGET wheel (first run downloads the pinned base)"
OUT="$ROOT/build/wheels/$TARGET"
rm -rf "$OUT"
VLLM_TARGET_DEVICE=$TARGET "${PIP[@]}" wheel -q --no-deps -w "$OUT" .
WHEEL=$(ls "$OUT"/vllm-*.whl)

REQS=()
for file in "$@"; do REQS+=(-r "$file"); done
# uv fetches and unpacks the ~3 GB of torch and CUDA-library wheels in parallel
# and links them from its cache on later runs (pip: one at a time, copied each
# time). pip remains for machines set up through pip's own settings (an offline
# box's PIP_NO_INDEX/PIP_FIND_LINKS, which uv does not read) or without uv.
CHOICE=${VLLM_FORK_INSTALLER:-auto}
get_uv() { "$VENV/bin/python" -m uv --version >/dev/null 2>&1 || "${PIP[@]}" install -q "uv>=0.5"; }
# install_with uv|pip: the wheel with its dependencies, then this very build
# again (an equal version string does not reinstall).
install_with() {
  case "$1" in
    uv)
      # --compile-bytecode: write the .pyc files as pip does. Without them, on a
      # machine with PYTHONDONTWRITEBYTECODE=1 (or a read-only venv) every
      # process compiles what it imports again: `from vllm import LLM` took
      # 21 s instead of 8 s, in every engine worker, server and test process.
      local UV=("$VENV/bin/python" -m uv pip install -q --compile-bytecode --python "$VENV/bin/python")
      "${UV[@]}" "$WHEEL" "${REQS[@]}" && "${UV[@]}" --no-deps --reinstall "$WHEEL" ;;
    pip)
      "${PIP[@]}" install -q "$WHEEL" "${REQS[@]}" && "${PIP[@]}" install -q --no-deps --force-reinstall "$WHEEL" ;;
  esac
}
case "$CHOICE" in
  auto)
    INSTALLER=pip
    if [ -z "${PIP_NO_INDEX:-}" ] && [ "${VLLM_FORK_OFFLINE:-0}" != 1 ] && get_uv >/dev/null 2>&1; then
      INSTALLER=uv
    fi ;;
  uv) get_uv; INSTALLER=uv ;;
  pip) INSTALLER=pip ;;
  *) echo "VLLM_FORK_INSTALLER=$CHOICE: use uv, pip or auto" >&2; exit 2 ;;
esac
step "installing $(basename "$WHEEL") with its dependencies by $INSTALLER (first run downloads torch, ~3 GB)"
if ! install_with "$INSTALLER"; then
  if [ "$CHOICE" != auto ] || [ "$INSTALLER" = pip ]; then exit 1; fi
  step "uv could not install it; trying pip (VLLM_FORK_INSTALLER=pip skips uv)"
  install_with pip
fi
"$VENV/bin/python" -m vllm.fork.info >&2
printf '%s\n%s\n%s\n' "$FINGERPRINT" "$WHEEL" "$REQS_FINGERPRINT" > "$STAMP"
echo "$WHEEL"

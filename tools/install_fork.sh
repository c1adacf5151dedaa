#!/usr/bin/env bash
# Build this checkout's fork wheel and install it into a virtual environment.
#   bash tools/install_fork.sh [cuda|cpu|auto] [extra requirement files...]
# auto (default): cuda when an NVIDIA GPU answers nvidia-smi, else cpu.
# Env: VLLM_FORK_VENV (default .venv), PYTHON (default python3), and the
# build's own VLLM_FORK_BASE_WHEEL / VLLM_FORK_OFFLINE for offline machines.
# VLLM_FORK_VENV_SYSTEM_SITE=1 creates the venv with --system-site-packages,
# so an image's own torch (e.g. a CUDA build on an offline GPU box) is used.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VLLM_FORK_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
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
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade "pip>=24"

step "building the fork's $TARGET wheel (first run downloads the pinned base)"
OUT="$ROOT/build/wheels/$TARGET"
rm -rf "$OUT"
VLLM_TARGET_DEVICE=$TARGET "${PIP[@]}" wheel -q --no-deps -w "$OUT" .
WHEEL=$(ls "$OUT"/vllm-*.whl)

REQS=()
for file in "$@"; do REQS+=(-r "$file"); done
step "installing $(basename "$WHEEL") with its dependencies (first run downloads torch, ~2 GB)"
"${PIP[@]}" install -q "$WHEEL" "${REQS[@]}"
# An equal version string does not reinstall: make sure this very build is what runs.
"${PIP[@]}" install -q --no-deps --force-reinstall "$WHEEL"
"$VENV/bin/python" -m vllm.fork.info >&2
echo "$WHEEL"

#!/usr/bin/env bash
# Proof that the offline kits are complete: make a CPU and a CUDA kit of this
# checkout for Python 3.12, each split into 60 MiB parts, and install and run
# each with no network at all (`unshare -n`: a network namespace without
# interfaces but loopback, so a dependency missing from a kit fails here, not on the box).
#   bash tools/ci/check_offline_kits.sh [WORK_DIR]      (default build/offline-kits)
#   CPU kit (torch included):  install.sh, then tools/ci/smoke_fork.py (DFlash + fp8 KV)
#   CUDA kit (README's: --use-system-torch, the test and benchmark requirements): into a venv that
#     already has torch 2.11.0, as a GPU image does; then import vllm,
#     vllm --version (without a GPU it stops at inferring the device: that
#     error, after its imports, is accepted), python -m vllm.fork.info and
#     pytest tests/gpu (its CUDA modules skip, each with its reason)
# Needs root (or a user namespace) for `unshare -n`, `ip` (iproute2), Python 3.12 (PATH or
# pyenv), network to make the kits, and ~25 GB of disk. Prints each phase's
# time. CI: .github/workflows/offline-kit.yml.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
WORK=$(realpath -m "${1:-build/offline-kits}")
PY_VERSION=3.12

if ! unshare -n true 2>/dev/null; then
  echo "check_offline_kits.sh: \`unshare -n\` does not work here: run as root (or in a container started with --network none, running the install steps by hand)" >&2
  exit 2
fi
source tools/lib/find_python.sh
PY=$(find_python "$PY_VERSION") || PY=""
[ -n "$PY" ] || { echo "check_offline_kits.sh: no Python $PY_VERSION that runs (PATH or pyenv)" >&2; exit 2; }

source tools/lib/stage_timer.sh
trap 'stage_report "phase times"' EXIT
# No network but loopback, as on an air-gapped box (a new namespace's lo is down;
# vLLM's workers meet over 127.0.0.1).
offline() { unshare -n sh -c 'ip link set lo up && exec "$@"' offline "$@"; }
step() { printf '\n==> %s\n' "$*"; }

rm -rf "$WORK"
mkdir -p "$WORK"

step "CPU kit: make (torch included, 60 MiB parts)"
bash tools/make_offline_kit.sh --python "$PY_VERSION" --target cpu --split 60M "$WORK/cpu-kit"
stage_done "make the CPU kit ($(du -sh "$WORK/cpu-kit" | cut -f1), $(ls "$WORK/cpu-kit/parts" | wc -l) parts)"
step "CPU kit: install with no network"
offline bash "$WORK/cpu-kit/install.sh" "$WORK/cpu-venv" --python "$PY"
stage_done "install the CPU kit, no network"
step "CPU kit: DFlash + fp8 KV smoke test with no network"
(cd "$WORK" && offline "$WORK/cpu-venv/bin/python" "$WORK/cpu-venv/vllm-fork-src/tools/ci/smoke_fork.py")
stage_done "smoke test (DFlash + fp8 KV), no network"
rm -rf "$WORK/cpu-venv"

step "CUDA kit: make (system torch, with the test and benchmark requirements, 60 MiB parts)"
# The README's command, word for word but the directory.
bash tools/make_offline_kit.sh --python "$PY_VERSION" --target cuda --use-system-torch \
  --with-requirements tests/requirements.txt --with-requirements benchmarks/requirements.txt \
  --split 60M "$WORK/cuda-kit"
stage_done "make the CUDA kit ($(du -sh "$WORK/cuda-kit" | cut -f1), $(ls "$WORK/cuda-kit/parts" | wc -l) parts)"
step "a venv with torch 2.11.0 already in it, as a GPU image has (network)"
TORCH=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["torch"])' "$WORK/cuda-kit/kit.json")
"$PY" -m venv "$WORK/cuda-venv"
"$WORK/cuda-venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$TORCH"
stage_done "the image's torch $TORCH (network)"
step "CUDA kit: install with no network"
offline bash "$WORK/cuda-kit/install.sh" "$WORK/cuda-venv"
stage_done "install the CUDA kit, no network"
step "CUDA kit: import vllm, vllm --version, vllm.fork.info, pytest tests/gpu with no network"
SRC=$WORK/cuda-venv/vllm-fork-src
offline "$WORK/cuda-venv/bin/python" -c 'import vllm; print("import vllm:", vllm.__version__)'
# Without a GPU the CUDA build's CLI stops at inferring its device (upstream's behaviour, after
# every import it needs): that error is the expected outcome here; any other failure is not.
if version=$(offline "$WORK/cuda-venv/bin/vllm" --version 2>&1); then
  echo "vllm --version: $version"
elif grep -q "Failed to infer device type" <<<"$version"; then
  echo "vllm --version: stopped at 'Failed to infer device type' (no GPU here), after its imports"
else
  echo "$version" >&2
  exit 1
fi
offline "$WORK/cuda-venv/bin/python" -m vllm.fork.info
offline "$WORK/cuda-venv/bin/python" -c 'import matplotlib, pytest, openai; print("benchmark plot and test requirements: importable")'
(cd "$SRC" && offline "$WORK/cuda-venv/bin/python" -m pytest -ra -p no:cacheprovider tests/gpu)
stage_done "CUDA kit checks (tests/gpu skip without a GPU), no network"
rm -rf "$WORK/cuda-venv"
echo
echo "offline kits: both installed and ran with no network; kits in $WORK"

#!/usr/bin/env bash
# GPU check: install the CUDA build of the fork and run the suite on the GPU.
#   bash tools/run_gpu_checks.sh [REPORT_DIR]
# Writes REPORT_DIR/report.xml (JUnit) and REPORT_DIR/log.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:-gpu-report}
mkdir -p "$REPORT"
VENV=${VLLM_FORK_VENV:-$PWD/.venv-cuda}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L; then
  echo "no NVIDIA GPU answers nvidia-smi: run the CPU suite (bash tools/run_tests.sh) instead" >&2
  exit 2
fi
VLLM_FORK_VENV=$VENV bash tools/install_fork.sh cuda tests/requirements.txt >/dev/null
"$VENV/bin/python" -m vllm.fork.info | tee "$REPORT/log.txt"
"$VENV/bin/python" -m pytest -ra tests/cpu_e2e \
  --junitxml="$REPORT/report.xml" "${@:2}" 2>&1 | tee -a "$REPORT/log.txt"
exit "${PIPESTATUS[0]}"

#!/usr/bin/env bash
# The test command: from nothing to a passed suite on a CPU machine.
#   bash tools/run_tests.sh [pytest args...]
# Creates .venv, builds the fork's CPU wheel from this checkout (downloading and
# verifying the pinned base on first use), installs it with the test
# requirements, and runs the whole suite against the installed wheel.
# CI (.ci/run) runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_FORK_VENV:-$PWD/.venv}
WHEEL=$(bash tools/install_fork.sh cpu tests/requirements.txt)
export VLLM_FORK_WHEEL=$WHEEL

printf '\n==> running the test suite\n'
set +e
# Default: everything but the tests marked slow (real CUDA base download, per-patch necessity rebuilds); pass -m "" to include them.
if [ $# -eq 0 ]; then set -- -m "not slow"; fi
"$VENV/bin/python" -m pytest -ra "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "no tests ran: that is a failure" >&2
  exit 1
fi
exit "$status"

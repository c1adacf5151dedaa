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
# No arguments: the whole suite, necessity proofs included (what CI runs).
# Quicker local loops: -m "not slow", or a path such as tests/kernels.
"$VENV/bin/python" -m pytest -ra "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "no tests ran: that is a failure" >&2
  exit 1
fi
exit "$status"

#!/usr/bin/env bash
# The test command: from nothing to a passed suite on a CPU machine.
#   bash tools/run_tests.sh [pytest args...]
# Creates .venv, builds the fork's CPU wheel from this checkout (downloading and
# verifying the pinned base on first use), installs it with its dependencies,
# and runs the whole suite against the installed wheel. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VLLM_FORK_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
step() { printf '\n==> %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade "pip>=24"

step "building the fork's CPU wheel"
rm -rf build/wheels
VLLM_TARGET_DEVICE=cpu "${PIP[@]}" wheel --no-deps -w build/wheels .
WHEEL=$(ls build/wheels/vllm-*.whl)

step "installing $(basename "$WHEEL") and its dependencies (first run downloads torch, ~2 GB)"
"${PIP[@]}" install -q "$WHEEL" -r tests/requirements.txt
# Same version string, different content while developing: make sure this build is what runs.
"${PIP[@]}" install -q --no-deps --force-reinstall "$WHEEL"
"$VENV/bin/python" -m vllm.fork.info

step "running the test suite"
export VLLM_FORK_WHEEL="$ROOT/$WHEEL"
set +e
"$VENV/bin/python" -m pytest tests -ra "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "no tests ran: that is a failure" >&2
  exit 1
fi
exit "$status"

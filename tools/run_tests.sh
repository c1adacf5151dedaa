#!/usr/bin/env bash
# The test command: from nothing to a passed suite on a CPU machine.
#   bash tools/run_tests.sh [pytest args...]
# Creates .venv, builds the fork's CPU wheel from this checkout (downloading and
# verifying the pinned base on first use), installs it with the test
# requirements, and runs the whole suite against the installed wheel.
# CI (.ci/run) runs exactly this.
#
# With no arguments, on a CPU with AVX-512 or AMX, a second pass runs the
# checks of the fp8 KV path that AVX2-only CPUs take (the kernel tests, the
# fp8 e2e guards and the necessity proofs of the patches they guard) with
# VLLM_FORK_TEST_NO_AVX512=1, so that path is tested on every machine; on an
# AVX2-only CPU the first pass already is that run.
# VLLM_FORK_REPORT_DIR=DIR writes a JUnit XML file per pass into DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_FORK_VENV:-$PWD/.venv}
WHEEL=$(bash tools/install_fork.sh cpu tests/requirements.txt)
export VLLM_FORK_WHEEL=$WHEEL
PYTEST=("$VENV/bin/python" -m pytest -ra)

junit() {
  if [ -n "${VLLM_FORK_REPORT_DIR:-}" ]; then
    mkdir -p "$VLLM_FORK_REPORT_DIR"
    echo "--junitxml=$VLLM_FORK_REPORT_DIR/$1.xml"
  fi
}

# pytest exit status 5 (nothing collected) is a failure too.
run_pass() {
  local status=0
  "${PYTEST[@]}" "$@" || status=$?
  if [ "$status" -eq 5 ]; then
    echo "no tests ran: that is a failure" >&2
    status=1
  fi
  return "$status"
}

printf '\n==> running the test suite\n'
status=0
# No arguments: the whole suite, necessity proofs included (what CI runs).
# Quicker local loops: -m "not slow", or a path such as tests/kernels.
if [ "$#" -gt 0 ]; then
  run_pass "$@" || status=$?
  exit "$status"
fi
run_pass $(junit suite) || status=$?

if "$VENV/bin/python" -c 'import sys, torch; sys.exit(not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()))'; then
  printf '\n==> again as on a CPU without AVX-512 or AMX (VLLM_FORK_TEST_NO_AVX512=1)\n'
  NECESSITY=tests/necessity/test_patches_are_needed.py::test_build_without_patch_fails_its_tests
  no_avx512=0
  VLLM_FORK_TEST_NO_AVX512=1 run_pass $(junit no-avx512) \
    tests/kernels/test_cpu_torch_fp8_kv.py tests/kernels/test_cpu_noncausal_attention.py \
    tests/cpu_e2e/test_dflash_kv.py \
    "$NECESSITY[0001]" "$NECESSITY[0002]" "$NECESSITY[0003]" "$NECESSITY[0004]" \
    "$NECESSITY[0005]" "$NECESSITY[0012]" || no_avx512=$?
  [ "$status" -ne 0 ] || status=$no_avx512
else
  printf '\n==> this CPU has neither AVX-512 nor AMX: the run above took the AVX2 paths\n'
fi
exit "$status"

#!/usr/bin/env bash
# The test command: from nothing to a passed suite on a CPU machine.
#   bash tools/run_tests.sh [pytest args...]
# Creates .venv, builds the fork's CPU wheel from this checkout (downloading and
# verifying the pinned base on first use), installs it with the test
# requirements, and runs the whole suite against the installed wheel.
# CI (.ci/run) runs exactly this.
#
# The suite runs on pytest-xdist workers (--dist loadgroup;
# tests/support/parallel_workers.py says what stays together): one per core,
# at most one per 8 GiB of memory and at most 4 (engines take ~4 GiB each).
# VLLM_FORK_TEST_WORKERS=N (or -n N among the arguments) overrides that
# (0: no workers, one process). Arguments select tests as in pytest
# (tools/run_tests.sh tests/kernels, -m "not slow", -k 0003, ...).
# On a CPU with AVX-512 or AMX, a second pass runs the checks of the fp8 KV
# path that AVX2-only CPUs take (the kernel tests, the fp8 e2e guards and, when
# the arguments name tests/necessity, the necessity proofs of the patches they
# guard) with VLLM_FORK_TEST_NO_AVX512=1,
# so that path is tested on every machine; on an AVX2-only CPU the first pass
# already is that run. Each stage's time is printed at the end.
# VLLM_FORK_REPORT_DIR=DIR writes a JUnit XML file per pass into DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_FORK_VENV:-$PWD/.venv}

source tools/lib/stage_timer.sh
trap stage_report EXIT

bash tools/install_fork.sh cpu tests/requirements.txt >/dev/null
stage_done "install (venv, fork wheel, test requirements)" ok
# --durations: the slowest tests (with xdist, a unit's engine start shows on its first test).
PYTEST=("$VENV/bin/python" -m pytest -ra --durations=15)

workers() {
  if [ -n "${VLLM_FORK_TEST_WORKERS:-}" ]; then echo "$VLLM_FORK_TEST_WORKERS"; return; fi
  "$VENV/bin/python" - <<'PY'
import os
cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
print(max(1, min(cpus, int(mem_gib // 8), 4)))
PY
}
WORKERS=$(workers)
# --no-loadscope-reorder: hand units out in the order tests/support/parallel_workers.py puts
# them (longest first), not by their number of tests.
PARALLEL=(-n "$WORKERS" --dist loadgroup --no-loadscope-reorder)
if [ "$WORKERS" = 0 ]; then PARALLEL=(); fi

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

# Arguments select tests as pytest's own do (a path, -k, -m, --ignore, -n 0
# for one process); both passes get them. A -m expression is joined to the
# second pass's own marker.
ARGS=() MARKEXPR=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    -m) MARKEXPR=$2; shift 2 ;;
    -m*) MARKEXPR=${1#-m}; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
# Tests marked `extended` run only when the expression names them (-m extended).
what="the test suite"
if [ "${#ARGS[@]}" -gt 0 ] || [ -n "$MARKEXPR" ]; then what="pytest ${MARKEXPR:+-m \"$MARKEXPR\" }${ARGS[*]}"; fi
case "$MARKEXPR" in
  "") MARKEXPR="not extended" ;;
  *extended*) ;;
  *) MARKEXPR="($MARKEXPR) and not extended" ;;
esac
FIRST_M=(-m "$MARKEXPR") SECOND_M=(-m "no_avx512_pass and ($MARKEXPR)")

status=0
printf '\n==> running %s on %s worker(s)\n' "$what" "$WORKERS"
run_pass "${PARALLEL[@]}" $(junit suite) "${FIRST_M[@]}" "${ARGS[@]}" || status=$?
stage_done "$what ($WORKERS workers)" "$([ "$status" -eq 0 ] && echo passed || echo FAILED)"

if "$VENV/bin/python" -c 'import sys, torch; sys.exit(not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()))'; then
  printf '\n==> again as on a CPU without AVX-512 or AMX (VLLM_FORK_TEST_NO_AVX512=1)\n'
  # The selected tests marked no_avx512_pass (tests/support/no_avx512_pass.py says which);
  # a selection without any is no failure here.
  # The necessity proofs of this pass rebuild the fork once per patch (about 4 minutes of
  # both cores): they run when the arguments name tests/necessity (cpu.yml's necessity
  # jobs do, one patch each), not in every commit's whole-suite run.
  SECOND_ONLY=()
  case " ${ARGS[*]:-} " in
    *tests/necessity*) ;;
    *) SECOND_ONLY=(--deselect tests/necessity/test_patches_are_needed.py)
       echo "    (its necessity proofs: bash tools/run_tests.sh tests/necessity/test_patches_are_needed.py -m no_avx512_pass)" ;;
  esac
  no_avx512=0
  VLLM_FORK_TEST_NO_AVX512=1 "${PYTEST[@]}" "${PARALLEL[@]}" $(junit no-avx512) \
    "${SECOND_M[@]}" "${SECOND_ONLY[@]}" "${ARGS[@]}" || no_avx512=$?
  [ "$no_avx512" -ne 5 ] || no_avx512=0
  stage_done "as without AVX-512/AMX ($WORKERS workers)" "$([ "$no_avx512" -eq 0 ] && echo passed || echo FAILED)"
  [ "$status" -ne 0 ] || status=$no_avx512
else
  printf '\n==> this CPU has neither AVX-512 nor AMX: the run above took the AVX2 paths\n'
fi
exit "$status"

#!/usr/bin/env bash
# GPU check: install the CUDA build of the fork, run the CUDA suite (tests/gpu)
# on the generated tiny pairs and a short DFlash x fp8 benchmark, within a time
# budget (default 8 minutes, VLLM_FORK_GPU_BUDGET_S).
#   bash tools/run_gpu_checks.sh [REPORT_DIR] [extra pytest args...]
# Writes to REPORT_DIR (default gpu-report):
#   report.xml         JUnit of tests/gpu
#   log.txt            fork info, nvidia-smi, pytest output, benchmark output (last 3000 lines)
#   gpu_matrix.json    per backend x kv dtype case: outcome of every check + measurements
#   bench/bench_dflash_fp8.json, bench/bench_dflash_fp8.png (plot if matplotlib installed)
#   bench/raw.tar.gz   each `vllm bench serve` result and server log of the benchmark
#   summary.md         phase and per-module times, the tables, for the CI job summary
# Env: VLLM_FORK_KIT (install from this offline kit, tools/make_offline_kit.sh,
# instead of building; nothing is fetched), VLLM_FORK_VENV (default .venv-cuda), VLLM_FORK_GPU_MATRIX (quick|full,
# default quick), VLLM_FORK_GPU_BENCH_ARGS (replaces the benchmark's sweep
# arguments), VLLM_FORK_REAL_TARGET/VLLM_FORK_REAL_DRAFT (also run the
# real-model checks; they need more than the default budget).
set -euo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:-gpu-report}
mkdir -p "$REPORT"
REPORT=$(cd "$REPORT" && pwd)
VENV=${VLLM_FORK_VENV:-$PWD/.venv-cuda}
BUDGET=${VLLM_FORK_GPU_BUDGET_S:-480}
BENCH_S=${VLLM_FORK_GPU_BENCH_S:-170}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L; then
  echo "no NVIDIA GPU answers nvidia-smi: run the CPU suite (bash tools/run_tests.sh) instead" >&2
  exit 2
fi
LOG=$REPORT/log.txt
: >"$LOG"
left() { echo $((BUDGET - SECONDS)); }
note() { printf '\n==> %s (%ss left of %ss)\n' "$*" "$(left)" "$BUDGET" | tee -a "$LOG"; }

source tools/lib/stage_timer.sh
if [ -n "${VLLM_FORK_KIT:-}" ]; then
  # An offline kit (tools/make_offline_kit.sh) brings every wheel: nothing is fetched.
  note "installing the offline kit $VLLM_FORK_KIT into $VENV"
  bash "$VLLM_FORK_KIT/install.sh" "$VENV" >>"$LOG" 2>&1
  "$VENV/bin/python" -c 'import matplotlib' 2>/dev/null \
    || echo "matplotlib not in the kit (--with-requirements benchmarks/requirements.txt): the benchmark writes no PNG" | tee -a "$LOG"
else
  note "installing the CUDA build into $VENV"
  VLLM_FORK_VENV=$VENV bash tools/install_fork.sh cuda tests/requirements.txt >>"$LOG" 2>&1
  # The plot is optional: without matplotlib (e.g. offline) the benchmark says so and goes on.
  "$VENV/bin/python" -m pip install -q -r benchmarks/requirements.txt >>"$LOG" 2>&1 \
    || echo "matplotlib not installed: the benchmark writes no PNG" | tee -a "$LOG"
fi
stage_done "install"
"$VENV/bin/python" -m vllm.fork.info 2>&1 | tee -a "$LOG"
nvidia-smi >>"$LOG" 2>&1 || true

TESTS_S=$(( $(left) - BENCH_S ))
if [ "$TESTS_S" -lt 60 ]; then TESTS_S=60; fi
note "tests/gpu (matrix ${VLLM_FORK_GPU_MATRIX:-quick}, at most ${TESTS_S}s)"
set +e
VLLM_FORK_GPU_MATRIX=${VLLM_FORK_GPU_MATRIX:-quick} VLLM_FORK_GPU_REPORT_DIR=$REPORT \
  timeout --signal=INT --kill-after=30 "$TESTS_S" \
  "$VENV/bin/python" -m pytest -ra tests/gpu --junitxml="$REPORT/report.xml" "${@:2}" 2>&1 | tee -a "$LOG"
tests_status=${PIPESTATUS[0]}
set -e
if [ "$tests_status" -eq 124 ]; then echo "tests/gpu ran out of its ${TESTS_S}s" | tee -a "$LOG"; fi
stage_done "tests/gpu"

BENCH_LEFT=$(left)
if [ "$BENCH_LEFT" -lt 60 ]; then BENCH_LEFT=60; fi
# Tiny pair, eager (no compile per server), two levels: short, and the ratios still come from one run.
read -r -a BENCH_ARGS <<<"${VLLM_FORK_GPU_BENCH_ARGS:---enforce-eager --concurrency 1,16 --input-len 128 --output-len 128 --prompts-per-level 4 --max-prompts 64}"
note "benchmark (at most ${BENCH_LEFT}s): ${BENCH_ARGS[*]}"
set +e
timeout --signal=INT --kill-after=30 "$BENCH_LEFT" \
  "$VENV/bin/python" benchmarks/bench_dflash_fp8.py --out "$REPORT/bench" "${BENCH_ARGS[@]}" 2>&1 \
  | tee "$REPORT/bench.txt" | tee -a "$LOG"
bench_status=${PIPESTATUS[0]}
set -e
stage_done "benchmark"

{
  echo "# GPU check: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  echo
  echo "tests/gpu exit status: $tests_status; benchmark exit status: $bench_status; ${SECONDS}s"
  echo
  echo "Phase times (budget ${BUDGET}s):"
  echo '```'
  printf '%s\n' "${STAGES[@]}"
  # Each test module's time, from the JUnit report: what to plan the next budget by.
  "$VENV/bin/python" - "$REPORT/report.xml" <<'PY' || true
import collections, sys, xml.etree.ElementTree as ET
times = collections.Counter()
for case in ET.parse(sys.argv[1]).iter("testcase"):
    times[case.get("classname", "?").rsplit(".", 1)[0]] += float(case.get("time") or 0)
for module, seconds in times.most_common():
    if module != "?" and module:
        print(f"  {module:<38} {seconds:6.0f}s")
PY
  echo '```'
  echo
  echo '```'
  grep '^\[gpu\]' "$LOG" || true
  sed -n '/^== KV capacity/,$p' "$REPORT/bench.txt" || true
  echo '```'
} >"$REPORT/summary.md"
# The report is brought back from the GPU box: keep the log's tail, put the benchmark's
# raw results and server logs into one archive and drop bench.txt (log.txt has it), so
# the report is at most 7 files.
tail -n 3000 "$LOG" >"$LOG.tail" && mv "$LOG.tail" "$LOG"
rm -f "$REPORT/bench.txt"
if [ -d "$REPORT/bench" ]; then
  (
    cd "$REPORT/bench"
    shopt -s nullglob
    loose=(server-*.log)
    if [ -d raw ]; then loose+=(raw); fi
    if [ "${#loose[@]}" -gt 0 ]; then
      tar -czf raw.tar.gz "${loose[@]}" && rm -rf "${loose[@]}" \
        || echo "could not archive the benchmark's raw results: left as they are" | tee -a "$LOG"
    fi
  )
fi
note "done: $REPORT"
if [ "$tests_status" -ne 0 ]; then exit "$tests_status"; fi
exit "$bench_status"

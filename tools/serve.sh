#!/usr/bin/env bash
# The main command: install the fork for this machine and serve DFlash with an fp8 KV cache.
#   bash tools/serve.sh [OPTIONS]                         # embedded tiny target + DFlash pair (offline)
#   bash tools/serve.sh [OPTIONS] TARGET DRAFT [vllm serve args...]
#   e.g. bash tools/serve.sh Qwen/Qwen3-8B z-lab/Qwen3-8B-DFlash-b16 --max-model-len 8192
#   bash tools/serve.sh --help                  # this text
# Options (before TARGET):
#   --device auto|cuda|cpu  the fork's build to install: auto (default) is CUDA if nvidia-smi sees a GPU
#   --reinstall             build and install the fork again even if it is up to date
# The embedded pair is a tiny target trained on The Zen of Python and a DFlash drafter trained
# against it: it goes on with a line of that text, and its drafts are mostly accepted. The
# first run trains it (about 80 s on 2 cores, in .cache/default-pair) and builds and
# installs the fork into .venv; later runs keep both while nothing they are made from changed.
# Env:
#   PORT                    port on 127.0.0.1 (8000)
#   NUM_SPEC_TOKENS         draft tokens per step (the drafter's block_size - 1, else 15)
#   VLLM_CPU_KVCACHE_SPACE  KV cache in GiB on CPU (2 here; vLLM's default wants 92 % of memory)
#   VLLM_FORK_VENV          the virtual environment (.venv)
# plus everything tools/install_fork.sh and vllm serve read.
set -euo pipefail
for gone in VLLM_FORK_TARGET VLLM_FORK_REINSTALL; do
  if [ -n "${!gone:-}" ]; then
    echo "serve.sh: $gone is no longer read: pass --device or --reinstall instead (unset $gone)" >&2
    exit 2
  fi
done
DEVICE=auto INSTALL_OPTIONS=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --device) DEVICE=${2:?--device needs auto, cuda or cpu}; shift 2 ;;
    --reinstall) INSTALL_OPTIONS+=(--reinstall); shift ;;
    *) break ;;
  esac
done
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VLLM_FORK_VENV:-$ROOT/.venv}
PORT=${PORT:-8000}
bash tools/install_fork.sh "${INSTALL_OPTIONS[@]+"${INSTALL_OPTIONS[@]}"}" "$DEVICE" >/dev/null
PY="$VENV/bin/python"

if [ $# -ge 2 ]; then
  TARGET_MODEL=$1 DRAFT_MODEL=$2
  shift 2
elif [ $# -eq 0 ]; then
  PAIR="$ROOT/.cache/default-pair"
  printf '\n==> the embedded default pair in %s (trained on the first run)\n' "$PAIR"
  "$PY" -m vllm.fork.tiny_pairs --out "$PAIR" --acceptance text | tail -n 1
  TARGET_MODEL=$PAIR/target DRAFT_MODEL=$PAIR/draft
else
  echo "usage: bash tools/serve.sh [--device auto|cuda|cpu] [--reinstall] [TARGET DRAFT [vllm serve args...]]" >&2
  exit 2
fi

if [ -z "${NUM_SPEC_TOKENS:-}" ]; then
  NUM_SPEC_TOKENS=$("$PY" -c 'import json,sys,os; p=os.path.join(sys.argv[1],"config.json"); print(json.load(open(p))["block_size"]-1 if os.path.isfile(p) else 15)' "$DRAFT_MODEL")
fi
SPEC=$(printf '{"method":"dflash","model":"%s","num_speculative_tokens":%s}' "$DRAFT_MODEL" "$NUM_SPEC_TOKENS")
if "$PY" -c 'import sys, vllm.fork.info as i; sys.exit(i.provenance()["target"] != "cpu")'; then
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
fi

printf '\n==> vllm serve %s (DFlash draft %s, %s speculative tokens, fp8 KV cache)\n' \
  "$TARGET_MODEL" "$DRAFT_MODEL" "$NUM_SPEC_TOKENS"
"$VENV/bin/vllm" serve "$TARGET_MODEL" --host 127.0.0.1 --port "$PORT" \
  --speculative-config "$SPEC" --kv-cache-dtype fp8 "$@" &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER' INT TERM
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
  kill -0 $SERVER 2>/dev/null || { wait $SERVER; exit $?; }
  sleep 2
done
if [ -n "${PAIR:-}" ]; then PROMPT="Beautiful is better than"; else PROMPT="The capital of France is"; fi
cat <<MSG

==> ready: http://127.0.0.1:$PORT/v1  (Ctrl-C stops the server)
curl -s http://127.0.0.1:$PORT/v1/completions -H 'Content-Type: application/json' \\
  -d '{"model": "$TARGET_MODEL", "prompt": "$PROMPT", "max_tokens": 64, "temperature": 0}'
curl -s http://127.0.0.1:$PORT/metrics | grep -E '^vllm:spec_decode_num_(drafts|accepted_tokens)_total'
MSG
wait $SERVER

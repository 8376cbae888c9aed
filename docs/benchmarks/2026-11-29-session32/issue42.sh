#!/usr/bin/env bash
# Issue 42: tfserve (bfloat16, Q4_1 default, float32) against vLLM 0.32 CPU bfloat16, SmolLM2-135M-Instruct,
# one server at a time, each server twice in alternating order; plus a 2000-token prefill (1 token out,
# random ids, no prefix-cache hit, median of three) against tfserve bf16 and vLLM bf16.
#
#   bash /work/bench/issue42.sh                      # the full run (run it on a quiet machine)
#   SMOKE=1 bash /work/bench/issue42.sh              # tiny settings: every server launches, every JSON is written
#
# Knobs (env): DRY=1 (print the order, run nothing), OUT (results folder), PORT, PASSES (1 or 2), MAX_TOKENS, PPC (--prompts-per-concurrency),
# SWEEP, PREFILL_TOKENS, PREFILL_RUNS, ONLY (space-separated subset of: tfs-bf16 tfs-q41 tfs-f32 vllm-bf16 prefill
# prefill-tfs-bf16 prefill-vllm-bf16)
set -uo pipefail

PORT=${PORT:-8077}
URL=http://127.0.0.1:$PORT
export TFSERVE_HOME=${TFSERVE_HOME:-$HOME/.cache/tfserve}
H=$TFSERVE_HOME/models/smollm2-135m-instruct          # HF directory (config, tokenizer, float32 safetensors)
STORE_NAME=smollm2-135m-instruct                       # tfserve's default model (its GGUF: Q4_1 blocks)
VENV=/work/peers/vllm-venv
BENCH=/work/bench
if [[ -n "${SMOKE:-}" ]]; then
  OUT=${OUT:-$BENCH/issue42-smoke}; MAX_TOKENS=${MAX_TOKENS:-8}; PPC=${PPC:-1}; SWEEP=${SWEEP:-concurrency=1,2}
  PREFILL_TOKENS=${PREFILL_TOKENS:-64}; PREFILL_RUNS=${PREFILL_RUNS:-1}; PASSES=${PASSES:-1}
else
  OUT=${OUT:-$BENCH/issue42-$(date -u +%Y%m%d-%H%M)}; MAX_TOKENS=${MAX_TOKENS:-128}; PPC=${PPC:-2}
  SWEEP=${SWEEP:-concurrency=1,32}; PREFILL_TOKENS=${PREFILL_TOKENS:-2000}; PREFILL_RUNS=${PREFILL_RUNS:-3}
  PASSES=${PASSES:-2}
fi
ONLY=${ONLY:-tfs-bf16 tfs-q41 tfs-f32 tfs-int8 vllm-bf16 prefill}
mkdir -p "$OUT"
LOG=$OUT/run.log
exec > >(tee -a "$LOG") 2>&1

# vLLM's CPU environment, as in docs/benchmarks.md "Commands": both cores, 4 GiB of KV cache.
VLLM_ENV="env VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1"
VLLM_CMD="$VLLM_ENV $VENV/bin/python -m vllm.entrypoints.openai.api_server --model {model} --dtype bfloat16 --max-model-len 4096 --port $PORT"
TFS_CMD="tfserve serve --model {model} --port $PORT"

declare -A LAUNCH MODEL
LAUNCH[tfs-bf16]="$TFS_CMD --dtype bfloat16";  MODEL[tfs-bf16]=$STORE_NAME
LAUNCH[tfs-q41]="$TFS_CMD";                    MODEL[tfs-q41]=$STORE_NAME
LAUNCH[tfs-f32]="$TFS_CMD --dtype float32";    MODEL[tfs-f32]=$STORE_NAME
LAUNCH[tfs-int8]="$TFS_CMD --quantization int8"; MODEL[tfs-int8]=$STORE_NAME
LAUNCH[vllm-bf16]="$VLLM_CMD";                 MODEL[vllm-bf16]=$H

wanted() { [[ " $ONLY " == *" $1 "* ]]; }
stamp() { echo "=== $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
port_free() {
  if ss -ltn "sport = :$PORT" | grep -q LISTEN; then echo "port $PORT is busy: stop whatever listens there"; exit 1; fi
}

# The record: machine, code, settings.
{
  date -u; uname -a; nproc; free -g | head -2
  grep -m1 'model name' /proc/cpuinfo
  grep -m1 -o -w -E 'avx512f|avx512_bf16|avx512_vnni|avx_vnni|amx_bf16|amx_int8|amx_tile' /proc/cpuinfo | tr '\n' ' '
  echo; grep -m1 '^flags' /proc/cpuinfo
  (cd /work/main && git log --oneline -1 && git status --short | head -20)
  python -c 'import torch; print("tfserve torch", torch.__version__)'
  "$VENV/bin/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null
  echo "MAX_TOKENS=$MAX_TOKENS PPC=$PPC SWEEP=$SWEEP PREFILL_TOKENS=$PREFILL_TOKENS PREFILL_RUNS=$PREFILL_RUNS PASSES=$PASSES"
} > "$OUT/machine.txt" 2>&1

FAILED=()

bench() {  # bench NAME TAG: one sweep with bench serve launching and stopping the server
  local name=$1 tag=$2
  wanted "$name" || return 0
  [[ -n "${DRY:-}" ]] && { echo "DRY bench $name-$tag: ${LAUNCH[$name]} --models ${MODEL[$name]}"; return 0; }
  port_free
  stamp "bench $name ($tag): ${LAUNCH[$name]} [model ${MODEL[$name]}]"
  local t0=$SECONDS
  if ! tfserve bench serve --url "$URL" --launch "${LAUNCH[$name]}" --models "${MODEL[$name]}" \
      --sweep "$SWEEP" --prompts-per-concurrency "$PPC" --max-tokens "$MAX_TOKENS" --ignore-eos --launch-timeout 900 \
      -o "$OUT/$name-$tag.json"; then
    FAILED+=("$name-$tag"); echo "!!! $name-$tag failed"
  fi
  [[ -s "$OUT/$name-$tag.json" ]] || { FAILED+=("$name-$tag(no json)"); echo "!!! $OUT/$name-$tag.json not written"; }
  stamp "done $name ($tag) in $((SECONDS - t0)) s"
}

SERVER_PID=
stop_server() {
  [[ -n "$SERVER_PID" ]] || return 0
  kill -TERM -- "-$SERVER_PID" 2>/dev/null
  for _ in $(seq 60); do kill -0 -- "-$SERVER_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$SERVER_PID" 2>/dev/null
  wait "$SERVER_PID" 2>/dev/null
  SERVER_PID=
}
trap stop_server EXIT INT TERM

prefill() {  # prefill NAME TAG: start the server, wait for /health (200 once loaded), run prefill.py, stop it
  local name=$1 tag=$2
  wanted prefill || wanted "prefill-$name" || return 0
  [[ -n "${DRY:-}" ]] && { echo "DRY prefill $name-$tag"; return 0; }
  port_free
  local cmd=${LAUNCH[$name]//\{model\}/${MODEL[$name]}}
  stamp "prefill $name ($tag): $cmd"
  local t0=$SECONDS
  setsid bash -c "exec $cmd" > "$OUT/prefill-$name-$tag.server.log" 2>&1 &
  SERVER_PID=$!
  local up=
  for _ in $(seq 900); do
    if curl -sf "$URL/health" > /dev/null && curl -sf "$URL/v1/models" > /dev/null; then up=1; break; fi  # tfserve: /health 503 while loading
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 1
  done
  if [[ -z "$up" ]]; then
    echo "!!! $name did not come up; its log:"; tail -30 "$OUT/prefill-$name-$tag.server.log"
    FAILED+=("prefill-$name-$tag"); stop_server; return
  fi
  echo "up in $((SECONDS - t0)) s"
  if ! python "$BENCH/prefill.py" --url "$URL" --tokens "$PREFILL_TOKENS" --runs "$PREFILL_RUNS" --warmup 1 \
      --label "$name" -o "$OUT/prefill-$name-$tag.json"; then
    FAILED+=("prefill-$name-$tag"); echo "!!! prefill $name-$tag failed"
  fi
  stop_server
  stamp "done prefill $name ($tag) in $((SECONDS - t0)) s"
}

T0=$SECONDS
stamp "start: out $OUT"
ORDER=(tfs-bf16 vllm-bf16 tfs-q41 tfs-f32 tfs-int8)
for pass in $(seq "$PASSES"); do
  if (( pass % 2 == 1 )); then order=("${ORDER[@]}"); pre=(tfs-bf16 vllm-bf16 tfs-q41)
  else order=(); for ((i=${#ORDER[@]}-1; i>=0; i--)); do order+=("${ORDER[i]}"); done; pre=(tfs-q41 vllm-bf16 tfs-bf16); fi
  for name in "${order[@]}"; do bench "$name" "p$pass"; done
  for name in "${pre[@]}"; do prefill "$name" "p$pass"; done
done
stamp "all done in $((SECONDS - T0)) s"
python "$BENCH/summarize.py" "$OUT" | tee "$OUT/summary.md"
if ((${#FAILED[@]})); then echo "FAILED: ${FAILED[*]}"; exit 1; fi
echo "all ok"

#!/usr/bin/env bash
# The prepared GPU session (issue 39): jaxserve end to end at real model size on one
# H100 in at most 9 minutes, every step under its own time limit so a slow one cannot
# lose the rest, and never past the session's deadline. Results: $OUT (the device
# tool's folder; else ./gpu_out) gets summary.json, summary.md and details.tar.gz (every
# step's JSON and log), rewritten after each step; each figure carries device name, jax
# version, commit and command.
#   1. roofline: donated best-of copy bandwidth, bf16 and fp8 matmul peaks
#   2. llama-3.1-8b dummy bf16: offline throughput, input 1024 / output 128, 1 / 64 / 256
#      concurrent rows; batch-1 TTFT and TPOT; warmup seconds and programs;
#      compilations after warmup (0 expected)
#   3. the same with --quantization fp8 --kv-cache-dtype fp8
#   4. qwen3.6-27b --quantization fp8: batch-1 TPOT and 64-row throughput
#   5. transformers, same GPU, same shape, random weights, static cache + torch.compile:
#      batch 1 and 64
#   6. the HTTP server (benchmarks/serving/serve.py: vLLM's bench serve metrics), 8B, 64 concurrent
#   7. engine correctness, bf16: llama, qwen3.5 hybrid, gemma 4 through the Pallas path vs
#      the XLA path vs the float32 reference, with agreement floors
# Usage, from the repository root:
#   bash benchmarks/gpu_session.sh           # on the device machine
#   bash benchmarks/gpu_session.sh --tiny    # tiny CPU mode: every step on tiny models (CI)
# The server step needs the web stack the GPU image lacks: run benchmarks/gpu_wheels.sh
# here once and carry .whl (device tool: carry [".whl"]); without it the step is skipped.
# Limits (seconds) can be overridden: SESSION_S (all), T_ROOFLINE, T_LLAMA, T_LLAMA_FP8,
# T_QWEN, T_TORCH, T_SERVE, T_CHECK (each correctness case).
set -u
MODE=full
[ "${1:-}" = "--tiny" ] && MODE=tiny
OUT=${OUT:-gpu_out}
WORK=${WORK:-/tmp/jaxserve-gpu-session}
CACHE=${CACHE:-/tmp/jaxserve-gpu-session-xla}   # shared by the steps: the server reuses 2.'s
rm -rf "$WORK"; mkdir -p "$OUT" "$WORK/status" "$CACHE"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
START=$(date +%s)
RESERVE=10   # kept for the last summary
PY=${PYTHON:-python3}

if [ "$MODE" = tiny ]; then
  export JAX_PLATFORMS=cpu
  SESSION_S=${SESSION_S:-900}
  T_ROOFLINE=${T_ROOFLINE:-120} T_LLAMA=${T_LLAMA:-240} T_LLAMA_FP8=${T_LLAMA_FP8:-240}
  T_QWEN=${T_QWEN:-240} T_TORCH=${T_TORCH:-120} T_SERVE=${T_SERVE:-240} T_CHECK=${T_CHECK:-240}
else
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu}
  SESSION_S=${SESSION_S:-540}
  T_ROOFLINE=${T_ROOFLINE:-25} T_LLAMA=${T_LLAMA:-110} T_LLAMA_FP8=${T_LLAMA_FP8:-80}
  T_QWEN=${T_QWEN:-85} T_TORCH=${T_TORCH:-70} T_SERVE=${T_SERVE:-55} T_CHECK=${T_CHECK:-35}
fi
DEADLINE=$((START + SESSION_S))

summarise() {
  $PY -m benchmarks.gpu.gpu_session summary --work "$WORK" --out "$OUT" --mode "$MODE" \
    >>"$WORK/summary.log" 2>&1 || echo "(summary failed: see summary.log)"
}

# step NAME LIMIT COMMAND...: COMMAND under min(LIMIT, what the session has left);
# status/NAME gets "exit-status seconds limit", status/NAME.cmd the command.
step() {
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - $(date +%s) - RESERVE))
  printf '%q ' "$@" >"$WORK/status/$name.cmd"
  if [ "$left" -lt 5 ]; then
    echo "== $name: skipped, the session's $SESSION_S s are spent"
    echo "-2 0 0" >"$WORK/status/$name"; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit $limit s)"
  local t0; t0=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  echo "$rc $(($(date +%s) - t0)) $limit" >"$WORK/status/$name"
  grep -v -e "Writing model shards" -e "^WARNING" "$WORK/$name.log" | tail -6
  summarise
}

{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head
  $PY -c "import jax; print('jax', jax.__version__)"; } >"$WORK/env.log" 2>&1
cat "$WORK/env.log"

if [ "$MODE" = tiny ]; then
  # The same steps on tiny models, seconds each: only the code paths, no figure worth keeping.
  MODELS=$($PY -m benchmarks.gpu.gpu_session tiny-models --dir "$WORK/models") || exit 1
  LLAMA=$(echo "$MODELS" | sed -n 1p) QWEN=$(echo "$MODELS" | sed -n 2p)
  SHAPE="--input-len 16 --output-len 4 --iters 1 --max-num-batched-tokens 16"
  ENGINE="--max-model-len 32 --compilation-cache-dir $CACHE"
  step roofline "$T_ROOFLINE" $PY -m benchmarks.shared.roofline --output-dir "$WORK" --copy-mib 1 \
    --matmul-sizes 64 --dtype float32,float8_e4m3fn --iters 1
  step llama_bf16 "$T_LLAMA" $PY -m benchmarks.gpu.gpu_engine_bench --model "$LLAMA" \
    --dtype bfloat16 --rows 1,2,4 $SHAPE $ENGINE --output "$WORK/llama_bf16.json"
  step llama_fp8 "$T_LLAMA_FP8" $PY -m benchmarks.gpu.gpu_engine_bench --model "$LLAMA" \
    --dtype bfloat16 --quantization fp8 --kv-cache-dtype fp8 --rows 1,2,4 $SHAPE $ENGINE \
    --output "$WORK/llama_fp8.json"
  step qwen_fp8 "$T_QWEN" $PY -m benchmarks.gpu.gpu_engine_bench --model "$QWEN" \
    --quantization fp8 --rows 1,2 $SHAPE $ENGINE --output "$WORK/qwen_fp8.json"
  step transformers "$T_TORCH" $PY -m benchmarks.gpu.gpu_torch_bench --model "$LLAMA" \
    --batch-sizes 1,2 --input-len 16 --output-len 4 --iters 1 --dtype float32 \
    --output "$WORK/transformers.json"
  step serve_8b "$T_SERVE" $PY -m benchmarks.gpu.gpu_serve_bench --server-args "$LLAMA \
    --load-format dummy --dtype bfloat16 --max-num-seqs 4 --max-num-batched-tokens 16 \
    $ENGINE" --num-prompts 4 --max-concurrency 2 --input-len 16 --output-len 4 \
    --output "$WORK/serve_8b.json"
  step check_llama-tiny "$T_CHECK" $PY -m benchmarks.gpu.gpu_engine_check --cases llama-tiny \
    --prompt-lens 3,9,17 --new-tokens 4 --name engine_check_llama-tiny --out-dir "$WORK" \
    --compilation-cache-dir "$CACHE"
  summarise; cat "$OUT/summary.md"; exit 0
fi

# Full mode, on the device machine.
$PY -m pip install -q --no-deps --no-build-isolation -e . >"$WORK/install.log" 2>&1 \
  || { echo "install failed"; cat "$WORK/install.log"; }
IO="--input-len 1024 --output-len 128"
ENGINE="--load-format dummy --compilation-cache-dir $CACHE"
XLA_PYTHON_CLIENT_PREALLOCATE=false step roofline "$T_ROOFLINE" $PY -m benchmarks.shared.roofline \
  --output-dir "$WORK" --copy-mib 1024,4096 --matmul-sizes 4096,8192 \
  --dtype bfloat16,float8_e4m3fn --iters 10
step llama_bf16 "$T_LLAMA" $PY -m benchmarks.gpu.gpu_engine_bench --model llama-3.1-8b \
  --dtype bfloat16 --rows 1,64,256 $IO $ENGINE --output "$WORK/llama_bf16.json"
step llama_fp8 "$T_LLAMA_FP8" $PY -m benchmarks.gpu.gpu_engine_bench --model llama-3.1-8b \
  --dtype bfloat16 --quantization fp8 --kv-cache-dtype fp8 --rows 1,64,256 $IO $ENGINE \
  --output "$WORK/llama_fp8.json"
step qwen_fp8 "$T_QWEN" $PY -m benchmarks.gpu.gpu_engine_bench --model qwen3.6-27b \
  --quantization fp8 --rows 1,64 $IO $ENGINE --output "$WORK/qwen_fp8.json"
step transformers "$T_TORCH" $PY -m benchmarks.gpu.gpu_torch_bench --model llama-3.1-8b \
  --batch-sizes 1,64 $IO --output "$WORK/transformers.json"
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/jaxserve-site .whl/*.whl >"$WORK/wheels.log" 2>&1
  # Step 2's engine exactly (max_num_seqs 256, max_model_len 1152): its programs come
  # from the compilation cache.
  PYTHONPATH=/tmp/jaxserve-site${PYTHONPATH:+:$PYTHONPATH} step serve_8b "$T_SERVE" \
    $PY -m benchmarks.gpu.gpu_serve_bench --server-args "llama-3.1-8b --dtype bfloat16 \
    --max-num-seqs 256 --max-model-len 1152 $ENGINE" --num-prompts 128 \
    --max-concurrency 64 $IO --output "$WORK/serve_8b.json"
else
  echo "== serve_8b: skipped, no .whl/ (benchmarks/gpu_wheels.sh, then carry .whl)"
  echo "-2 0 0" >"$WORK/status/serve_8b"
fi
for case in llama-h128 qwen3_5-h256 gemma4-h256-h512; do
  step "check_$case" "$T_CHECK" $PY -m benchmarks.gpu.gpu_engine_check --cases "$case" \
    --new-tokens 16 --name "engine_check_$case" --out-dir "$WORK" --compilation-cache-dir "$CACHE"
done
summarise
cat "$OUT/summary.md"

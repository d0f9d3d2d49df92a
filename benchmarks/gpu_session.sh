#!/usr/bin/env bash
# The prepared GPU session (issue 39): jaxserve end to end at real model size on one
# H100 in at most 9 minutes, every step under its own time limit so a slow one cannot
# lose the rest, and never past the session's deadline. Results: $OUT (the device
# tool's folder; else ./gpu_out) gets summary.json, summary.md and details.tar.gz (every
# step's JSON and log, the profiles' traces), rewritten after each step; each figure
# carries device name, jax version, commit and command.
# Steps, in the order they run (the first session, fd1fab1 on an H100, needed ~15 min for
# all: give the ones a session should run as arguments; the default runs them in this
# order until the 9 minutes are spent, the most wanted first):
#   tpot_base    llama-3.1-8b dummy bf16, batch-1 TTFT and TPOT and a profile only (8 rows,
#                token buckets up to 512: a short warmup), the engine's defaults: the
#                baseline of the tpot_* A/B steps below, same engine, same run
#   tpot_async   tpot_base with --async-scheduling (the host's per-step work overlapped)
#   tpot_nomerge tpot_base with XLA's dot merger off (the third session's H200 profile: an
#                `input_concatenate_fusion` of 24 us a layer before the q/k/v gemm, i.e.
#                XLA concatenating the three weights every step to run one gemm)
#   tpot_cmdbuf  tpot_base with command buffers over the while loop and conditionals, at a
#                minimum graph size of 1 (the third session: the flag alone changed nothing,
#                the loop still ran from the host, its body one CUDA graph per layer)
#   host_tier    benchmarks/cache/host_tier_copies.py: the host KV tier's offload and
#                restore bandwidth (llama-3.1-8b's KV pages) against the link's (issue 44)
#   qwen_w8a8    qwen3.6-27b --quantization fp8 --activation-quantization dynamic, batch 1
#                (tpot_base's engine sizes): fp8 x fp8 gemms that cuBLAS could run in place
#   qwen_tpot    the same without --activation-quantization (w8a16, Triton: the third
#                session's profile spent 49 % of a step copying weights out of the stack)
#   llama_bf16   llama-3.1-8b dummy bf16: batch-1 TTFT and TPOT, a jax.profiler trace of
#                decode steps at 1 and 64 rows summarised per kernel (where a step's
#                time goes), offline throughput at input 1024 / output 128 for 1 / 64 /
#                256 rows; warmup seconds and programs; compilations after warmup (0)
#   qwen_fp8     qwen3.6-27b --quantization fp8: batch 1 (TPOT, profile) and 64 rows
#   llama_fp8    llama_bf16 with --quantization fp8 --kv-cache-dtype fp8
#   checks       engine correctness, bf16: llama, qwen3.5 hybrid, gemma 4 through the
#                Pallas path vs the XLA path vs the float32 reference, with agreement
#                floors; the three cases at once (separate processes, a quarter of the
#                GPU each: their time is compiling, on the CPU)
#   transformers transformers, same GPU, same shape, random weights, static cache +
#                torch.compile: batch 1 and 64
#   serve_8b     the HTTP server (benchmarks/serving/serve.py: vLLM's bench serve
#                metrics), 8B, 64 concurrent
#   tpot_triton  tpot_base with XLA's Triton gemms (the engine's GPU default is cuBLAS for
#                16-bit weights, jaxserve/build/gpu_xla_flags.py: this is the A/B)
#   roofline     donated best-of copy bandwidth, bf16 and fp8 matmul peaks
#   scan_probe   benchmarks/gpu/scan_weights_probe.py: an 8B-shaped layer stack as
#                jax.lax.scan and as a Python loop under a few XLA flags (the second
#                session found Triton gemms copying each layer's weights out of the
#                stack: 16.1 ms a step, against 7.2 with cuBLAS or unrolled)
# Usage, from the repository root:
#   bash benchmarks/gpu_session.sh [STEP ...]         # on the device machine
#   bash benchmarks/gpu_session.sh --tiny [STEP ...]  # tiny CPU mode: tiny models (CI)
# The server step needs the web stack the GPU image lacks: run benchmarks/gpu_wheels.sh
# here once and carry .whl (device tool: carry [".whl"]); without it the step is skipped.
# Limits (seconds) can be overridden: SESSION_S (all), T_ROOFLINE, T_LLAMA, T_LLAMA_FP8,
# T_TPOT (each variant), T_QWEN_TPOT, T_QWEN, T_TORCH, T_SERVE, T_CHECKS.
set -u
MODE=full
[ "${1:-}" = "--tiny" ] && { MODE=tiny; shift; }
ALL_STEPS="tpot_base tpot_async tpot_nomerge tpot_cmdbuf host_tier qwen_w8a8 qwen_tpot llama_bf16"
ALL_STEPS="$ALL_STEPS qwen_fp8 llama_fp8"
ALL_STEPS="$ALL_STEPS checks transformers serve_8b tpot_triton roofline scan_probe"
STEPS=${*:-$ALL_STEPS}
for s in $STEPS; do
  case " $ALL_STEPS " in *" $s "*) ;; *) echo "unknown step $s (steps: $ALL_STEPS)"; exit 2;; esac
done
wanted() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
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
  T_QWEN=${T_QWEN:-240} T_TORCH=${T_TORCH:-120} T_SERVE=${T_SERVE:-240} T_CHECKS=${T_CHECKS:-240}
  T_TPOT=${T_TPOT:-240} T_PROBE=${T_PROBE:-240} T_QWEN_TPOT=${T_QWEN_TPOT:-240}
  T_HOST=${T_HOST:-120}
else
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu}
  SESSION_S=${SESSION_S:-540}
  # Measured in the first session (H100, cold caches): roofline 45 s, llama_bf16 107 s
  # (+ ~20 s of profile), llama_fp8 > 80 s, qwen_fp8 > 85 s (23 programs of ~40 s each
  # compiling on 16 cores), transformers > 70 s, serve_8b > 55 s, each check case > 35 s.
  # Second (5cd6e5d, cold): llama_bf16 125 s with its profiles, tpot_* 42 s, the three
  # checks at once 122 s, scan_probe 59 s, roofline 47 s.
  T_ROOFLINE=${T_ROOFLINE:-55} T_LLAMA=${T_LLAMA:-135} T_LLAMA_FP8=${T_LLAMA_FP8:-130}
  T_QWEN=${T_QWEN:-220} T_TORCH=${T_TORCH:-120} T_SERVE=${T_SERVE:-90} T_CHECKS=${T_CHECKS:-150}
  # Third (87a97ce, H200, cold): tpot_cmdbuf 38 s, qwen_fp8 172 s (warmup 84 s).
  T_TPOT=${T_TPOT:-90} T_PROBE=${T_PROBE:-70} T_QWEN_TPOT=${T_QWEN_TPOT:-160}
  T_HOST=${T_HOST:-45}   # not yet measured on a GPU
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
  [ -z "${NO_SUMMARY:-}" ] && summarise
  return 0
}

# checks CASE...: the correctness cases at once, each its own step and process with a
# share of the GPU's memory (their time is XLA compiling on the CPU).
checks() {
  local share=$(awk "BEGIN {print 0.9 / $#}") case
  for case in "$@"; do
    XLA_PYTHON_CLIENT_MEM_FRACTION=$share NO_SUMMARY=1 step "check_$case" "$T_CHECKS" \
      $PY -m benchmarks.gpu.gpu_engine_check --cases "$case" $CHECK_ARGS \
      --name "engine_check_$case" --out-dir "$WORK" --compilation-cache-dir "$CACHE" &
  done
  wait
  summarise
}

{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head
  $PY -c "import jax; print('jax', jax.__version__)"; } >"$WORK/env.log" 2>&1
cat "$WORK/env.log"

if [ "$MODE" = tiny ]; then
  # The same steps on tiny models, seconds each: only the code paths, no figure worth keeping.
  MODELS=$($PY -m benchmarks.gpu.gpu_session tiny-models --dir "$WORK/models") || exit 1
  LLAMA=$(echo "$MODELS" | sed -n 1p) QWEN=$(echo "$MODELS" | sed -n 2p) BIG_LLAMA=$LLAMA
  # 4 rows everywhere: qwen_fp8 (rows 1,2) then loads qwen_tpot's programs from the cache
  IO="--input-len 16 --output-len 4 --iters 1 --max-num-seqs 4 --max-num-batched-tokens 16"
  ENGINE="--max-model-len 32 --compilation-cache-dir $CACHE"
  ROWS="1,2,4" QWEN_ROWS="1,2" PROFILE="--profile-rows 1,2 --profile-steps 2"
  QWEN_PROFILE="--profile-rows 1 --profile-steps 2"
  ROOFLINE="--copy-mib 1 --matmul-sizes 64 --dtype float32,float8_e4m3fn --iters 1"
  TORCH="--model $LLAMA --batch-sizes 1,2 --input-len 16 --output-len 4 --iters 1 --dtype float32"
  SERVE="--server-args '$LLAMA --load-format dummy --dtype bfloat16 --max-num-seqs 4 \
    --max-num-batched-tokens 16 $ENGINE' --num-prompts 4 --max-concurrency 2 --input-len 16 \
    --output-len 4"
  CASES="llama-tiny" CHECK_ARGS="--prompt-lens 3,9,17 --new-tokens 4"
  TPOT="--input-len 16 --output-len 4 --iters 1 --max-num-seqs 4 --max-num-batched-tokens 16 \
    --profile-rows 1 --profile-steps 2"
  CMDBUF="" NOMERGE="" TRITON=""   # the GPU flags are not XLA:CPU's (and, in XLA_FLAGS,
  # would key the compilation cache apart: tpot_triton loads tpot_base's programs)
  PROBE="--tiny --iters 2 --rows 1 --timeout 60 --variants scan,loop"
  HOST="--layers 2 --kv-heads 2 --head-dim 16 --pages 64 --copy-pages 8 --repeats 2"
else
  $PY -m pip install -q --no-deps --no-build-isolation -e . >"$WORK/install.log" 2>&1 \
    || { echo "install failed"; cat "$WORK/install.log"; }
  LLAMA=llama-3.1-8b QWEN=qwen3.6-27b
  IO="--input-len 1024 --output-len 128"
  ENGINE="--load-format dummy --compilation-cache-dir $CACHE"
  ROWS="1,64,256" QWEN_ROWS="1,64" PROFILE="--profile-rows 1,64 --profile-steps 12"
  QWEN_PROFILE="--profile-rows 1 --profile-steps 12"
  ROOFLINE="--copy-mib 1024,4096 --matmul-sizes 4096,8192 --dtype bfloat16,float8_e4m3fn --iters 10"
  TORCH="--model $LLAMA --batch-sizes 1,64 $IO"
  # llama_bf16's engine exactly (max_num_seqs 256, max_model_len 1152): its programs come
  # from the compilation cache when llama_bf16 ran first.
  SERVE="--server-args '$LLAMA --dtype bfloat16 --max-num-seqs 256 --max-model-len 1152 \
    $ENGINE' --num-prompts 128 --max-concurrency 64 $IO"
  CASES="llama-h128 qwen3_5-h256 gemma4-h256-h512" CHECK_ARGS="--new-tokens 16"
  # Batch-1 latency only, few programs (8 rows, token buckets up to 512): short warmups.
  TPOT="--input-len 1024 --output-len 64 --iters 2 --max-num-seqs 8 \
    --max-num-batched-tokens 512 --profile-rows 1 --profile-steps 12"
  CMDBUF="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_graph_min_graph_size=1"
  NOMERGE="--xla_gpu_dot_merger_threshold_mb=0" TRITON="--xla_gpu_enable_triton_gemm=true"
  PROBE="--rows 1,64 --iters 30 --timeout 25"
  # llama-3.1-8b's pages (2 MiB each), 512 MiB copied each way
  HOST="--layers 32 --kv-heads 8 --head-dim 128 --pages 4096 --copy-pages 256 --repeats 5"
fi

# tpot NAME LIMIT EXTRA_XLA_FLAGS MODEL_ARGS...: batch-1 TTFT / TPOT and a profile, the TPOT
# engine sizes, the given XLA flags added to the engine's (the A/B steps against tpot_base).
tpot() {
  local name=$1 limit=$2 flags=$3; shift 3
  XLA_FLAGS="${XLA_FLAGS:-}${flags:+ $flags}" step "$name" "$limit" \
    $PY -m benchmarks.gpu.gpu_engine_bench "$@" --rows "" $TPOT $ENGINE \
    --profile-dir "$WORK/profile_$name" --output "$WORK/$name.json"
}

for s in $STEPS; do case $s in
  roofline) XLA_PYTHON_CLIENT_PREALLOCATE=false step roofline "$T_ROOFLINE" \
    $PY -m benchmarks.shared.roofline --output-dir "$WORK" $ROOFLINE ;;
  llama_bf16) step llama_bf16 "$T_LLAMA" $PY -m benchmarks.gpu.gpu_engine_bench --model "$LLAMA" \
    --dtype bfloat16 --rows $ROWS $IO $ENGINE $PROFILE --profile-dir "$WORK/profile_llama_bf16" \
    --output "$WORK/llama_bf16.json" ;;
  scan_probe) step scan_probe "$T_PROBE" $PY -m benchmarks.gpu.scan_weights_probe $PROBE \
    --output "$WORK/scan_probe.json" --best-flags "$WORK/best_scan_flags" ;;
  tpot_base) tpot tpot_base "$T_TPOT" "" --model "$LLAMA" --dtype bfloat16 ;;
  tpot_async) tpot tpot_async "$T_TPOT" "" --model "$LLAMA" --dtype bfloat16 --async-scheduling ;;
  tpot_nomerge) tpot tpot_nomerge "$T_TPOT" "$NOMERGE" --model "$LLAMA" --dtype bfloat16 ;;
  tpot_cmdbuf) tpot tpot_cmdbuf "$T_TPOT" "$CMDBUF" --model "$LLAMA" --dtype bfloat16 ;;
  host_tier) step host_tier "$T_HOST" $PY -m benchmarks.cache.host_tier_copies $HOST \
    --json "$WORK/host_tier.json" ;;
  tpot_triton) tpot tpot_triton "$T_TPOT" "$TRITON" --model "$LLAMA" \
    --dtype bfloat16 ;;
  qwen_tpot) tpot qwen_tpot "$T_QWEN_TPOT" "" --model "$QWEN" --quantization fp8 ;;
  qwen_w8a8) tpot qwen_w8a8 "$T_QWEN_TPOT" "" --model "$QWEN" --quantization fp8 \
    --activation-quantization dynamic ;;
  qwen_fp8) step qwen_fp8 "$T_QWEN" $PY -m benchmarks.gpu.gpu_engine_bench --model "$QWEN" \
    --quantization fp8 --rows $QWEN_ROWS $IO $ENGINE $QWEN_PROFILE \
    --profile-dir "$WORK/profile_qwen_fp8" --output "$WORK/qwen_fp8.json" ;;
  checks) checks $CASES ;;
  llama_fp8) step llama_fp8 "$T_LLAMA_FP8" $PY -m benchmarks.gpu.gpu_engine_bench \
    --model "$LLAMA" --dtype bfloat16 --quantization fp8 --kv-cache-dtype fp8 --rows $ROWS $IO \
    $ENGINE --output "$WORK/llama_fp8.json" ;;
  transformers) step transformers "$T_TORCH" $PY -m benchmarks.gpu.gpu_torch_bench $TORCH \
    --output "$WORK/transformers.json" ;;
  serve_8b)
    SITE=""
    if [ "$MODE" = full ]; then
      if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "== serve_8b: skipped, no .whl/ (benchmarks/gpu_wheels.sh, then carry .whl)"
        echo "-2 0 0" >"$WORK/status/serve_8b"; continue
      fi
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/jaxserve-site .whl/*.whl >"$WORK/wheels.log" 2>&1
      SITE=/tmp/jaxserve-site
    fi
    eval "PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH} step serve_8b \"\$T_SERVE\" \
      \$PY -m benchmarks.gpu.gpu_serve_bench $SERVE --output \"\$WORK/serve_8b.json\"" ;;
esac; done
summarise
cat "$OUT/summary.md"

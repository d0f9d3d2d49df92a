#!/usr/bin/env bash
# A vLLM user's command line on a GPU: `jaxserve serve` with vLLM's flags, the KV cache
# sized by --gpu-memory-utilization, vLLM's metric names and endpoints. Every log lands
# in $OUT (the device tool's folder), else ./gpu_out.
#   bash benchmarks/gpu_dropin.sh
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda,cpu JAXSERVE_CACHE=/tmp/jaxserve-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.txt" 2>&1
{ date; nvidia-smi --query-gpu=name,memory.total --format=csv; git rev-parse HEAD 2>/dev/null
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# 1. The KV cache at two shares, each in its own process (the built-in model at a real
#    model's memory: qwen3-8b with dummy weights).
for share in 0.3 0.6; do
  timeout 240 python3 - "$share" >"$OUT/mem_$share.txt" 2>&1 <<'PY'
import json, sys, time
import jax
from jaxserve import LLM, SamplingParams
share = float(sys.argv[1])
t0 = time.time()
llm = LLM("qwen3-8b", load_format="dummy", gpu_memory_utilization=share, max_model_len=4096,
          max_num_seqs=8, enforce_eager=True, compilation_cache_dir="", dtype="bfloat16")
stats = jax.devices()[0].memory_stats()
plan = llm.engine.info.cache_plan
out = llm.generate(["Hello"] * 2, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
print(json.dumps({"share": share, "bytes_limit": stats["bytes_limit"],
                  "bytes_in_use": stats["bytes_in_use"],
                  "weight_bytes": llm.engine.info.weight_bytes, "kv_bytes": plan.kv_bytes,
                  "num_pages": plan.num_pages,
                  "kv_share_of_what_weights_leave": plan.kv_bytes /
                      (stats["bytes_limit"] - llm.engine.info.weight_bytes),
                  "warmup_compilations": llm.engine.info.warmup_compilations,
                  "tokens": [len(o.outputs[0].token_ids) for o in out],
                  "seconds": round(time.time() - t0, 1)}))
PY
  tail -3 "$OUT/mem_$share.txt"
done
# 2. The server as vLLM users start it (where its web stack is installed).
if ! python3 -c "import uvicorn, fastapi" 2>/dev/null; then
  echo "no uvicorn/fastapi here: the server part is skipped" | tee "$OUT/serve_checks.txt"
  exit 0
fi
jaxserve serve qwen3-8b --load-format dummy --dtype bfloat16 --gpu-memory-utilization 0.5 -tp 1 --max-num-seqs 8 --max-model-len 512 \
  --served-model-name qwen qwen2 --enforce-eager --port 8011 >"$OUT/serve.log" 2>&1 &
pid=$!
for i in $(seq 240); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
{ curl -s localhost:8011/v1/models; echo
  curl -s localhost:8011/v1/completions -H 'content-type: application/json' \
       -d '{"model": "qwen2", "prompt": "Hello", "max_tokens": 8}'; echo
  curl -s localhost:8011/v1/completions -H 'content-type: application/json' \
       -d '{"model": "qwen", "prompt": "Hello world", "max_tokens": 0, "echo": true, "logprobs": 1}'; echo
  curl -s localhost:8011/load; echo; curl -s -o /dev/null -w 'ping %{http_code}\n' localhost:8011/ping
  curl -s localhost:8011/metrics | grep -E '^vllm:' | head -40
} >"$OUT/serve_checks.txt" 2>&1
sleep 11   # one stats line
kill -TERM $pid; wait $pid; echo "server exit $?" >>"$OUT/serve_checks.txt"
cat "$OUT/serve_checks.txt"; grep -E "Engine 000|KV cache|ready in" "$OUT/serve.log" | tail -5

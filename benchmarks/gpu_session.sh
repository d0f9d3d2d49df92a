#!/usr/bin/env bash
# One GPU session's checks, most valuable first, each under its own time limit; every
# log and result lands in $OUT (the device tool's folder), else ./gpu_out.
#   1. the compiled kernels against their oracles (pytest, tests/kernels: *on_device*)
#   2. the engine with the Pallas kernels against the XLA path (benchmarks/gpu_engine_check.py)
#   3. attention speed (benchmarks/attention_gpu.py)
# Usage on the device machine, from the repo root: bash benchmarks/gpu_session.sh
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda,cpu
T_KERNELS=${T_KERNELS:-150} T_ENGINE=${T_ENGINE:-200} T_ATTN=${T_ATTN:-120}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.txt" 2>&1
{ date; nvidia-smi -L; git rev-parse HEAD 2>/dev/null; git status --short | head;
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
echo "== kernels"; timeout "$T_KERNELS" python3 -m pytest -q -p no:cacheprovider -rfE \
    tests/kernels/test_ragged_paged_attention.py tests/kernels/test_gated_delta_kernels.py \
    -k on_device 2>&1 | tee "$OUT/kernels.txt" | tail -40
echo "== engine"; timeout "$T_ENGINE" python3 -m benchmarks.gpu_engine_check --out-dir "$OUT" \
    ${ENGINE_CASES:+--cases "$ENGINE_CASES"} >"$OUT/engine.txt" 2>&1
grep -v "Writing model shards" "$OUT/engine.txt" | tail -30
echo "== attention"; timeout "$T_ATTN" python3 benchmarks/attention_gpu.py --out-dir "$OUT" \
    --iters "${ATTN_ITERS:-5}" --inner "${ATTN_INNER:-10}" >"$OUT/attention.txt" 2>&1
tail -50 "$OUT/attention.txt"

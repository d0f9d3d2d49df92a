"""The names of the quantized KV cache dtypes (vLLM's --kv-cache-dtype spellings; "fp8"
is e4m3) -> the stored dtype's name. Plain strings, no jax: jaxserve's config offers
these names without importing device code; ragged_paged_attention/quant.py owns the
arithmetic."""
KV_QUANT_DTYPE_NAMES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "int8": "int8",
}

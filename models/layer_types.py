"""The kinds of layer a model stacks (host only): what each keeps between steps follows
from its kind (models/cache_spec.py)."""
from __future__ import annotations

FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
SLIDING_ATTENTION = "sliding_attention"
# Layer types that keep a paged KV cache (a kind each: models/layer_stack.py).
KV_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

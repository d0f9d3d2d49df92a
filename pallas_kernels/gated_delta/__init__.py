"""Gated DeltaNet (Qwen3.5/3.6 linear attention): the gated delta rule and its
causal conv1d, for single sequences and for the engine's ragged batches.

  chunk_gated_delta_rule / recurrent_gated_delta_rule: one sequence (reference.py)
  ragged_causal_conv1d: the short convolution with per-slot conv states (conv.py)
  ragged_gated_delta_rule: a ragged batch with per-slot recurrent states (dispatch.py)
"""
from pallas_kernels.gated_delta.conv import ragged_causal_conv1d
from pallas_kernels.gated_delta.dispatch import ragged_gated_delta_rule
from pallas_kernels.gated_delta.reference import chunk_gated_delta_rule, recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "ragged_causal_conv1d",
           "ragged_gated_delta_rule"]

"""The engine's configuration, in one home: EngineConfig (every knob, engine_config.py),
speculative decoding's settings (speculative.py) and vLLM's names for knobs jaxserve
does not have (vllm_compat.py). The parts' typed slices of it (SchedulerConfig,
RunnerConfig) live beside the parts and are derived in jaxserve/build/slices.py."""
from __future__ import annotations

from jaxserve.config.engine_config import (DEFAULT_HBM_UTILIZATION, DTYPE_ALIASES,
                                           EngineConfig, default_max_num_seqs)

__all__ = ["DEFAULT_HBM_UTILIZATION", "DTYPE_ALIASES", "EngineConfig", "default_max_num_seqs"]

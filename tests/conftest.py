"""Shared test set-up: 8 simulated CPU devices (before jax loads), repo root importable."""
import gc
import os
import sys

# XLA:CPU's optimisation is wasted on the tiny test models, whose programs run for
# milliseconds: most of the suite's time was compiling them. -O0 LLVM codegen without its
# expensive passes, and the legacy IR emitters instead of the MLIR fusion emitters (whose
# pipeline costs more than the tiny kernels it speeds up). Engine, sharding, API server and
# kernel tests (test_hybrid_engine greedy, test_mesh_parity, api/test_server,
# test_ragged_paged_attention), cold compile cache, back to back, user+sys CPU: 658 s by
# default, 491 s with the two LLVM flags, 321 s with all three (wall 726 -> 362 s).
# Subprocesses (servers, multihost workers, benchmark scripts) inherit these flags; one
# that sets its own XLA_FLAGS keeps SPEED_FLAGS (tests/sharding/test_multihost.py).
SPEED_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
               "--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {SPEED_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# torch's OpenMP workers (the transformers references) sleep when idle instead of
# spinning beside XLA's threads on CI's two cores (before torch loads libgomp):
# tests/models/test_parity.py 51 -> 46 s, back to back at load ~8.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Python's cyclic GC walks every live object (torch, transformers, the module-scoped
# engines) at each full collection, and tracing a model allocates enough to trigger them
# often: with fewer collections, tests/engine/test_hybrid_engine.py and test_lora_engine.py
# on a cold compilation cache, back to back, ran 96 -> 88 s (1,000,000 or no automatic
# collection at all: no better).
gc.set_threshold(100_000, 50, 100)
# No test may reach the real Hugging Face hub (before huggingface_hub reads it at import);
# the download tests turn this off and point HF_ENDPOINT at tests/fake_hub.py.
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

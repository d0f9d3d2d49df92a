"""Shared test set-up: 8 simulated CPU devices (before jax loads), repo root importable."""
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# torch's OpenMP workers (the transformers references) sleep when idle instead of
# spinning beside XLA's threads on CI's two cores (before torch loads libgomp):
# tests/models/test_parity.py 51 -> 46 s, back to back at load ~8.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# No test may reach the real Hugging Face hub (before huggingface_hub reads it at import);
# the download tests turn this off and point HF_ENDPOINT at tests/fake_hub.py.
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

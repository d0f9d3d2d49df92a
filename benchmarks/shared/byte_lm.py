"""A small Llama with trained (not random) weights, made on this machine: byte-level
(token id = byte value), trained with torch on the Python standard library's source.

No network reaches a model hub here, and a random model's next-token distributions are
nearly flat, which makes quantization's top-1 agreement look worse than on a real model;
a model that has learnt something has peaked distributions. Files are split by name
(every 10th sorted file held out), so the evaluation text was never trained on.
"""
from __future__ import annotations

import math
import os
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

CONFIG: dict[str, Any] = dict(
    vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
    tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0,
    bos_token_id=1, eos_token_id=2, pad_token_id=0)


def corpus(held_out: bool, limit_bytes: int = 8 << 20) -> np.ndarray:
    """The stdlib's top-level .py files as bytes (uint8): every 10th sorted file if
    held_out, else the others; at most limit_bytes."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    chosen = [f for i, f in enumerate(files) if (i % 10 == 0) == held_out]
    parts, size = [], 0
    for f in chosen:
        data = f.read_bytes()
        parts.append(data)
        size += len(data)
        if size >= limit_bytes:
            break
    return np.frombuffer(b"\n\n".join(parts)[:limit_bytes], np.uint8)


def windows(data: np.ndarray, count: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """`count` random windows of `length` bytes, as int64 [count, length]."""
    starts = rng.integers(0, len(data) - length, count)
    return np.stack([data[s:s + length] for s in starts]).astype(np.int64)


def train(path: str | Path, *, steps: int = 400, batch: int = 16, seq_len: int = 256,
          lr: float = 3e-3, seed: int = 0, config: dict[str, Any] | None = None,
          threads: int = 1, log=print) -> dict[str, Any]:
    """Trains and saves the model at `path` (float32 safetensors + a tokenizer that only
    the loader needs); reuses it if already there. Returns the training record."""
    import json
    path = Path(path)
    record = path / "training.json"
    if record.is_file():
        return json.loads(record.read_text())
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from jaxserve.checkpoints.tiny_tokenizer import make_tiny_tokenizer

    # One thread: torch's two OpenMP threads wait for each other at every op and run
    # several times slower when another process holds one of this host's two cores.
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    cfg = {**CONFIG, **(config or {})}
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(   # linear warmup, cosine to 10 %
        opt, lambda s: min(1.0, (s + 1) / warm)
        * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps))))
    data, rng = corpus(held_out=False), np.random.default_rng(seed)
    t0, losses = time.perf_counter(), []
    for step in range(steps):
        x = torch.from_numpy(windows(data, batch, seq_len, rng))
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss))
        if step % 50 == 0 or step == steps - 1:
            log(f"  byte_lm step {step}: loss {losses[-1]:.3f} nats/byte")
    model.eval()
    with torch.no_grad():
        x = torch.from_numpy(windows(corpus(held_out=True), 16, seq_len,
                                     np.random.default_rng(seed + 1)))
        eval_loss = float(model(input_ids=x, labels=x).loss)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    make_tiny_tokenizer(str(path))
    out = {"config": cfg, "steps": steps, "batch": batch, "seq_len": seq_len, "lr": lr,
           "seed": seed, "threads": threads, "train_seconds": time.perf_counter() - t0,
           "final_train_loss": float(np.mean(losses[-10:])), "heldout_loss": eval_loss,
           "num_params": sum(p.numel() for p in model.parameters())}
    record.write_text(json.dumps(out, indent=1))
    return out

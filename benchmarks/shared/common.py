"""Shared pieces of the CPU benchmarks: a small random Qwen3 and seeded workloads."""
from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass

SMALL_QWEN3 = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536,
                   num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)


def make_word_tokenizer(path: str, vocab_size: int, chat_template: str | None = None) -> None:
    """A word-level tokenizer whose every id decodes to a word ("w123"), so a random
    model's output is text a client can count (the benchmarks need streamed text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)


def make_qwen3(path: str, config: dict, seed: int = 0, dtype: str = "float32") -> str:
    """A random-weight Qwen3 with `config` saved as `dtype` safetensors, with a word-level
    tokenizer over its whole vocabulary; reused when `path` already holds one."""
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(**config, eos_token_id=None, bos_token_id=None)
    # Built in its dtype: a large model is never held in float32 first.
    model = Qwen3ForCausalLM._from_config(cfg, torch_dtype=getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    make_word_tokenizer(path, config["vocab_size"])
    return path


def make_small_qwen3(path: str, seed: int = 0) -> str:
    """The small Qwen3 of the CPU figures (hidden 512, 8 layers, vocab 32000)."""
    return make_qwen3(path, SMALL_QWEN3, seed)


# Qwen3-8B's layer widths (its config.json), vocab cut to the small model's.
QWEN3_8B_LAYERS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=12288,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=2048, tie_word_embeddings=False)


def base_model(shape: str, layers: int | None, dtype: str) -> str:
    """A random Qwen3's directory under the temp dir, written once per shape ("small":
    SMALL_QWEN3; "8b": QWEN3_8B_LAYERS), layer count (default: the shape's) and dtype."""
    if shape == "small" and layers is None and dtype == "float32":
        return make_small_qwen3(os.path.join(tempfile.gettempdir(), "jaxserve-bench-qwen3-small"))
    config = dict(SMALL_QWEN3 if shape == "small" else QWEN3_8B_LAYERS)
    config["num_hidden_layers"] = layers or (config.get("num_hidden_layers") or 2)
    name = f"jaxserve-bench-qwen3-{shape}-l{config['num_hidden_layers']}-{dtype}"
    return make_qwen3(os.path.join(tempfile.gettempdir(), name), config, dtype=dtype)


@dataclass(frozen=True)
class Item:
    prompt_token_ids: list[int]
    max_tokens: int


def workload(name: str, num_prompts: int = 64, vocab: int = 32000, seed: int = 0) -> list[Item]:
    """decode-heavy: prompts 16-96, outputs 8-384; prefill-heavy: 32-400 / 16-200."""
    rng = random.Random(seed)
    lo_p, hi_p, lo_o, hi_o = {"decode": (16, 96, 8, 384), "prefill": (32, 400, 16, 200)}[name]
    return [Item([rng.randrange(3, vocab) for _ in range(rng.randint(lo_p, hi_p))],
                 rng.randint(lo_o, hi_o)) for _ in range(num_prompts)]

"""Checkpoints: where a model name leads (aliases, built-in configs, the default model,
the local Hugging Face cache) and the tokenizer helpers of test and dummy models."""

"""Vision towers of the vision-language checkpoints (Qwen3.5/3.6, Gemma 4): the encoders
that turn an image's patches into embeddings for the text model's image tokens, with
their host-side inputs (positions, masks) and weight loading. docs/VISION.md."""

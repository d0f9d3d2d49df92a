"""LoRA adapters on the served model: PEFT checkpoints (adapter.py), the model's LoRA
targets (targets.py), the adapters' stacked device slots (slots.py) and the batched
low-rank op (ops.py). docs/LORA.md has the design."""

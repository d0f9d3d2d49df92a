"""LoRARequest: which adapter a request runs with (vLLM's class and field names).

Request data, at the bottom of the layers: the server resolves a `model` name to one,
LLM.generate takes one per prompt, the scheduler keys device slots by lora_int_id and
the runner reads the adapter from lora_path."""
from __future__ import annotations

from dataclasses import dataclass

# Names and paths are echoed in errors: bounded.
MAX_LORA_NAME_CHARS = 256
MAX_LORA_PATH_CHARS = 4096


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the adapter's name (the `model` a client asks for); lora_int_id: its
    id, unique among the adapters one engine serves (>= 1: 0 is "no adapter");
    lora_path: the PEFT adapter directory (adapter_config.json +
    adapter_model.safetensors); base_model_name: the model it was trained on, as
    /v1/models lists its parent (None: the served model)."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name.strip():
            raise ValueError("LoRARequest.lora_name must be a non-empty string")
        if len(self.lora_name) > MAX_LORA_NAME_CHARS:
            raise ValueError(f"LoRARequest.lora_name has {len(self.lora_name)} characters, "
                             f"more than {MAX_LORA_NAME_CHARS}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an int "
                             f">= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must name the "
                             f"adapter's directory")
        if len(self.lora_path) > MAX_LORA_PATH_CHARS:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path is longer than "
                             f"{MAX_LORA_PATH_CHARS} characters")

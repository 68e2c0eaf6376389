"""The adapter a request runs with, named as vLLM names it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name` identifies the adapter to users (the server's `model` field);
    `lora_int_id` is a positive integer id, unique per adapter; `lora_path` is a PEFT
    adapter directory (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError("lora_path must name an adapter directory")

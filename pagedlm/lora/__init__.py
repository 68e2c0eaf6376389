"""LoRA adapters: what a request names (`LoRARequest`) and what an adapter directory holds
(`adapter.load_adapter`). The layers that apply them are in layers/lora.py, their slots on
the workers in worker/lora_model.py, and which adapters are resident in core/lora_slots.py."""

from pagedlm.lora.request import LoRARequest

__all__ = ["LoRARequest"]

"""Reading a PEFT LoRA adapter directory.

    my-adapter/
      adapter_config.json          r, lora_alpha, target_modules, use_rslora, rank_pattern, ...
      adapter_model.safetensors    base_model.model.<module>.lora_A.weight   [r, in]
                                   base_model.model.<module>.lora_B.weight   [out, r]

A targeted module computes y = W x + scale * B (A x), scale = alpha / r (rsLoRA:
alpha / sqrt(r)), with r and alpha per module where rank_pattern / alpha_pattern say so.
Here B is stored already multiplied by its scale. Module names are the base model's HF
names (`model.layers.0.self_attn.q_proj`); which of our layers each one adapts is decided
by the worker, which has the model (worker/lora_model.py). Pickled adapters
(adapter_model.bin) are refused: loading a pickle runs code from the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from pagedlm.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight")


@dataclass
class LoRAModule:
    """One adapted module: A [r, in] and B [out, r] already scaled, float32."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    """An adapter read and checked on its own (not yet against a model)."""

    name: str
    int_id: int
    path: str
    # SHA-256 of the config and weights: what prefix-cache hashes are keyed by, so blocks
    # are shared only between requests of the very same adapter (or of the base model).
    content_hash: bytes
    modules: dict[str, LoRAModule] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def num_bytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of
    the module name at a dot boundary."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _refuse(request: LoRARequest, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {why}")


def load_adapter(request: LoRARequest, max_lora_rank: int) -> LoRAAdapter:
    """Read and check the adapter directory `request.lora_path`. Raises ValueError naming
    what is wrong (missing files, a pickle, unsupported PEFT options, a rank above
    `max_lora_rank`, inconsistent tensors)."""
    root = Path(request.lora_path)
    if not root.is_dir():
        raise _refuse(request, "no such directory")
    config_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not config_path.is_file():
        raise _refuse(request, f"{CONFIG_FILE} is missing: not a PEFT adapter directory")
    if not weights_path.is_file():
        if (root / "adapter_model.bin").is_file():
            raise _refuse(request, "adapter_model.bin is a pickle, which is refused (loading it "
                          "runs code from the file); save the adapter with safetensors "
                          "(PEFT's save_pretrained does by default)")
        raise _refuse(request, f"{WEIGHTS_FILE} is missing")
    config_bytes = config_path.read_bytes()
    weights_bytes = weights_path.read_bytes()
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as e:
        raise _refuse(request, f"{CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise _refuse(request, f"{CONFIG_FILE} must hold a JSON object")
    _check_config(request, config)
    try:
        tensors = load_safetensors(weights_bytes)
    except Exception as e:  # safetensors raises its own error type for a corrupt file
        raise _refuse(request, f"{WEIGHTS_FILE} cannot be read ({e})") from None

    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise _refuse(request, f"tensor {key!r} is not a LoRA A/B weight of a linear "
                          "layer (embedding adapters, trained biases and DoRA magnitudes are "
                          "not supported)")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise _refuse(request, f"{WEIGHTS_FILE} holds no LoRA weights")

    alpha = config.get("lora_alpha", 8)
    rslora = bool(config.get("use_rslora", False))
    modules: dict[str, LoRAModule] = {}
    for module, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise _refuse(request, f"module {module!r} has lora_{next(iter(ab))} but not "
                          f"lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise _refuse(request, f"module {module!r}: lora_A {tuple(a.shape)} and lora_B "
                          f"{tuple(b.shape)} are not [r, in] and [out, r]")
        rank = a.shape[0]
        if rank > max_lora_rank:
            raise _refuse(request, f"module {module!r} has rank {rank}, above max_lora_rank "
                          f"({max_lora_rank}); raise --max-lora-rank")
        module_alpha = _pattern_value(config.get("alpha_pattern"), module, alpha)
        scale = module_alpha / (math.sqrt(rank) if rslora else rank)
        modules[module] = LoRAModule(a.contiguous(), (b * scale).contiguous())
    digest = hashlib.sha256(config_bytes)
    digest.update(weights_bytes)
    return LoRAAdapter(request.lora_name, request.lora_int_id, str(root), digest.digest(), modules)


def _check_config(request: LoRARequest, config: dict) -> None:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _refuse(request, f"peft_type is {peft_type!r}; only LORA adapters are supported")
    if config.get("use_dora"):
        raise _refuse(request, "use_dora is set: DoRA adapters are not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise _refuse(request, "the adapter trains biases (bias / lora_bias); only bias-free "
                      "LoRA is supported")
    if config.get("modules_to_save"):
        raise _refuse(request, f"modules_to_save {config['modules_to_save']!r}: fully "
                      "fine-tuned modules are not supported, only LoRA weights")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise _refuse(request, f"lora_alpha must be a positive number, got {alpha!r}")

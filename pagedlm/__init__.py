"""pagedlm: a high-throughput LLM inference engine built on PagedAttention.

The public API is loaded lazily so that the torch-free parts (config, sampling_params,
core) can be imported without pulling in torch.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagedlm.entrypoints.llm",
    "SamplingParams": "pagedlm.sampling_params",
    "BeamSearchParams": "pagedlm.sampling_params",
    "StructuredOutputsParams": "pagedlm.structured",
    "BeamSearchOutput": "pagedlm.outputs",
    "BeamSearchSequence": "pagedlm.outputs",
    "RequestOutput": "pagedlm.outputs",
    "CompletionOutput": "pagedlm.outputs",
    "Logprob": "pagedlm.outputs",
    "LoRARequest": "pagedlm.lora.request",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)

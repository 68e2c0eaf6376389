"""Random ("dummy") weights for benchmarking and tests without a checkpoint."""

from __future__ import annotations

import torch


def _is_norm(module: torch.nn.Module) -> bool:
    # LayerNorm, RMSNorm and model-specific variants (LlamaRMSNorm, ...) all say so in their name.
    return "norm" in type(module).__name__.lower()


@torch.no_grad()
def init_dummy_weights(
    model: torch.nn.Module,
    seed: int = 0,
    low: float = -1e-3,
    high: float = 1e-3,
) -> None:
    """Fill every parameter of `model` in place with uniform random values in ``[low, high)``.

    Normalisation weights (parameters named ``weight`` on modules whose class name contains
    "Norm") get ``1 + U(low, high)`` instead: with all-tiny gains the hidden states would shrink
    by ~1e3 per layer into float subnormals, which are slow on CPUs and turn into zeros in half
    precision, so a dummy model would not behave (or time) like a real one. Models whose norms
    compute ``x * (1 + w)`` (Gemma) then see a gain of ~2, which is just as harmless.

    Deterministic for a given seed, model structure and device: parameters are visited in
    ``named_modules`` order, drawing from one generator per device. Buffers (e.g. rotary
    frequency tables) are left alone. Each parameter is filled with one vectorised call.
    """
    if not low < high:
        raise ValueError(f"Need low < high, got [{low}, {high})")
    generators: dict[torch.device, torch.Generator] = {}
    for module in model.modules():
        norm = _is_norm(module)
        for name, param in module.named_parameters(recurse=False):
            if param.device.type == "meta":
                raise ValueError(f"Parameter {name!r} is on the meta device; materialise it first")
            if not param.is_floating_point():
                continue  # integer parameters (rare: quantised packs) have no sensible random fill
            gen = generators.get(param.device)
            if gen is None:
                gen = torch.Generator(device=param.device)
                gen.manual_seed(seed)
                generators[param.device] = gen
            param.uniform_(low, high, generator=gen)
            if norm and name == "weight":
                param.add_(1.0)

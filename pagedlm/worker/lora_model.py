"""A worker's adapter slots: LoRA weights on every linear layer of its model, adapters
written into slots as the scheduler places them, and each step's tokens mapped to slots.

Which of our layers (and which slice of a fused one) a PEFT module adapts is not written
down per architecture: the adapter's tensors go through the model's own `load_weights`,
as the base checkpoint's did, with every parameter's loader replaced by a recorder. The
model's name mapping, fused-projection split (Llama's q/k/v into `qkv_proj`, GPT-NeoX's
head-interleaved `query_key_value`, GPT-2's transposed Conv1D) and its layers' tensor-
parallel slicing then apply to LoRA exactly as to the weights:

    B [out, r] of a column-parallel module  -> the rows this rank holds, per q / k / v shard
    A [r, in]  of a row-parallel module     -> the columns this rank holds

An adapter is checked completely (`plan`) before anything is written, so a bad one leaves
the slots as they were.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedlm.layers.lora import LoRAStep, LoRAWeights
from pagedlm.lora.adapter import LoRAAdapter

# One write: (layer weights, slice, A [r, in of this rank], B rows [hi - lo, r])
Write = tuple[LoRAWeights, int, torch.Tensor, torch.Tensor]


def layer_slices(layer: LinearBase) -> tuple[list[tuple[int, int]], dict]:
    """A layer's output slices (row ranges of this rank) and shard id -> slice."""
    out = layer.out_features
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)], {"q": 0, "k": 1, "v": 2}
    if isinstance(layer, MergedColumnParallelLinear):
        bounds, start = [], 0
        for size in layer.output_sizes:
            bounds.append((start, start + size // layer.tp_size))
            start += size // layer.tp_size
        return bounds, {i: i for i in range(len(bounds))}
    return [(0, out)], {None: 0}


class LoRAModel:
    """`max_loras` adapter slots of rank up to `max_rank` on every linear layer of
    `model` (not the LM head or embeddings)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model = model
        self.max_loras = max_loras
        self.step = LoRAStep(device)
        self.dtype = dtype
        self.layers: dict[LinearBase, LoRAWeights] = {}
        self._shard_slice: dict[LinearBase, dict] = {}
        for module in model.modules():
            if isinstance(module, LinearBase):
                slices, shard_slice = layer_slices(module)
                module.lora = LoRAWeights(module.in_features, slices, max_loras, max_rank,
                                          dtype, device, self.step)
                self.layers[module] = module.lora
                self._shard_slice[module] = shard_slice
        self._owner = {id(p): m for m in self.layers for p in m.parameters(recurse=False)}
        self.slot_content: list[bytes | None] = [None] * max_loras

    @property
    def num_bytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.layers.values())

    # ----- placing adapters ----------------------------------------------------------

    def plan(self, adapter: LoRAAdapter) -> list[Write]:
        """Every write `adapter` needs, checked against the model; ValueError naming the
        module otherwise."""
        transposed = bool(getattr(self.model, "conv1d_weights", False))
        # Where each module's B goes (and, for row-parallel layers, A), in one pass of
        # the model's loader over all of them.
        routes = self._route({(name, "B"): m.b for name, m in adapter.modules.items()},
                             transposed, adapter.name)
        row_modules = {name for (name, _), hits in routes.items()
                       if any(isinstance(layer, RowParallelLinear) for layer, _, _ in hits)}
        routes.update(self._route({(name, "A"): adapter.modules[name].a for name in row_modules},
                                  transposed, adapter.name))
        writes: list[Write] = []
        for name, module in adapter.modules.items():
            try:
                writes.extend(self._plan_module(module.a, module.b, routes[name, "B"],
                                                routes.get((name, "A"))))
            except ValueError as e:
                raise ValueError(f"LoRA adapter {adapter.name!r}: module {name!r}: {e}") from None
        return writes

    def _route(self, tensors: dict[tuple[str, str], torch.Tensor], transposed: bool,
               adapter_name: str) -> dict[tuple[str, str], list[tuple]]:
        """For each tensor loaded as checkpoint weight `<module>.weight`: [(layer, the
        tensor as the model's loader hands it to the layer, shard id)]."""
        records: dict[tuple[str, str], list[tuple]] = {key: [] for key in tensors}
        current: list[tuple[str, str]] = []

        def feed():
            for key, tensor in tensors.items():
                current[:] = [key]
                yield f"{key[0]}.weight", tensor.t() if transposed else tensor

        saved = []
        for param in self.model.parameters():
            saved.append((param, param.__dict__.get("weight_loader")))
            param.weight_loader = (lambda p, loaded, shard_id=None:
                                   records[current[0]].append((p, loaded, shard_id)))
        try:
            self.model.load_weights(feed())
        except (ValueError, RuntimeError, KeyError) as e:
            where = f"module {current[0][0]!r}: " if current else ""
            raise ValueError(f"LoRA adapter {adapter_name!r}: {where}the model has no such "
                             f"linear layer ({e})") from None
        finally:
            for param, loader in saved:
                if loader is None:
                    del param.weight_loader
                else:
                    param.weight_loader = loader
        routes = {}
        for key, hits in records.items():
            routed = []
            for param, loaded, shard_id in hits:
                layer = self._owner.get(id(param))
                if layer is None or param is not layer.weight:
                    raise ValueError(f"LoRA adapter {adapter_name!r}: module {key[0]!r} is not "
                                     "a linear projection pagedlm can adapt (only the attention "
                                     "and MLP projections are)")
                routed.append((layer, loaded, shard_id))
            if not routed:
                raise ValueError(f"LoRA adapter {adapter_name!r}: module {key[0]!r}: the model "
                                 "has no such linear layer")
            routes[key] = routed
        return routes

    def _plan_module(self, a: torch.Tensor, b: torch.Tensor, routed_b: list[tuple],
                     routed_a: list[tuple] | None) -> list[Write]:
        rank = a.shape[0]
        writes = []
        for layer, loaded_b, shard_id in routed_b:
            weights = self.layers[layer]
            if shard_id not in self._shard_slice[layer]:
                raise ValueError(f"unexpected shard {shard_id!r} of {type(layer).__name__}")
            s = self._shard_slice[layer][shard_id]
            lo, hi = weights.slices[s]
            if isinstance(layer, RowParallelLinear):
                # B is whole on every rank; A is cut along its input like the weight.
                assert routed_a is not None and len(routed_a) == 1 and routed_a[0][0] is layer
                a_local = torch.zeros(rank, layer.in_features)
                b_rows = b
                loaded, target = routed_a[0][1], a_local
            else:
                if a.shape[1] != layer.in_features:
                    raise ValueError(f"lora_A has {a.shape[1]} input features, the layer "
                                     f"{layer.in_features}")
                a_local = a
                b_rows = torch.zeros(layer.out_features, rank)
                loaded, target = loaded_b, b_rows
            try:
                layer.weight_loader(target, loaded.float(), shard_id)
            except (ValueError, RuntimeError) as e:
                raise ValueError(f"its shape does not fit the layer ({e})") from None
            if not isinstance(layer, RowParallelLinear):
                b_rows = b_rows[lo:hi]
            if b_rows.shape[0] != hi - lo:
                raise ValueError(f"lora_B has {b_rows.shape[0]} output features, the layer "
                                 f"{hi - lo}")
            writes.append((weights, s, a_local, b_rows))
        return writes

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write `adapter` into `slot` (replacing what it held)."""
        writes = self.plan(adapter)
        for weights in self.layers.values():
            weights.clear(slot)
        for weights, s, a, b in writes:
            weights.set_slice(slot, s, a.to(self.dtype), b.to(self.dtype))
        self.slot_content[slot] = adapter.content_hash

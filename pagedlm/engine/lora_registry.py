"""The adapters an engine core knows by name: read from disk, checked against the model
on the workers, then named by requests. Which of them are in the workers' slots is the
scheduler's business (core/lora_slots.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from pagedlm.lora.adapter import LoRAAdapter, load_adapter
from pagedlm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRARegistry:
    def __init__(self, enabled: bool, max_lora_rank: int,
                 check: Callable[[LoRAAdapter], str | None]) -> None:
        """`check(adapter)`: what makes it unusable on the model (the executor's), or None."""
        self.enabled = enabled
        self.max_lora_rank = max_lora_rank
        self._check = check
        self.adapters: dict[str, LoRAAdapter] = {}

    def add(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Read an adapter and check it against the model. Raises ValueError naming what
        is wrong; adding the same adapter again under its name returns it."""
        if not self.enabled:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True "
                             "(--enable-lora)")
        name = lora_request.lora_name
        known = self.adapters.get(name)
        if known is not None:
            if (Path(known.path), known.int_id) == (Path(lora_request.lora_path),
                                                    lora_request.lora_int_id):
                return known
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded (id "
                             f"{known.int_id}, {known.path}); unload it first")
        clash = next((a for a in self.adapters.values()
                      if a.int_id == lora_request.lora_int_id), None)
        if clash is not None:
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} is already used by "
                             f"adapter {clash.name!r}")
        start = time.perf_counter()
        adapter = load_adapter(lora_request, self.max_lora_rank)
        error = self._check(adapter)
        if error is not None:
            raise ValueError(error)
        self.adapters[name] = adapter
        logger.info("LoRA adapter %r added from %s: rank %d, %d modules, %.1f MiB, %.0f ms",
                    name, adapter.path, adapter.rank, len(adapter.modules),
                    adapter.num_bytes / 2**20, (time.perf_counter() - start) * 1e3)
        return adapter

    def remove(self, name: str) -> bool:
        """Forget an adapter (False if unknown). Requests already using it finish with it;
        new ones cannot name it."""
        return self.adapters.pop(name, None) is not None

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded; loaded: "
                             f"{sorted(self.adapters) or 'none'}")
        return adapter

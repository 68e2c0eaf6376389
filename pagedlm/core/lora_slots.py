"""Which adapter each of the workers' `max_loras` LoRA slots holds.

A request with an adapter is admitted only while its adapter is in a slot, or can be put
in one: a free slot, else the least recently used slot whose adapter no running request
uses. An adapter in use is never evicted; a request whose adapter finds no slot waits
(other requests are admitted past it). Adapters are opaque here (anything with a
`content_hash`): the scheduler only says which slot to load with what, in the
SchedulerOutput of the step that first uses it (`admit` records the load, `take_loads`
hands it over once).

    slots   [ A | B | - | C ]        running: uses A, C
    place D -> slot 2 (free)         place E -> slot 1 (B: idle, least recent) -> load E
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.holder: list[bytes | None] = [None] * max_loras  # slot -> adapter content hash
        self.slot_of: dict[bytes, int] = {}
        self._recent: OrderedDict[bytes, None] = OrderedDict()  # least recently placed first
        self.num_loads = 0
        # Loads not yet sent to the workers: slot -> adapter.
        self._pending_loads: dict[int, object] = {}

    def place(self, adapter, in_use: Callable[[], Iterable[bytes]]) -> tuple[int, bool] | None:
        """The slot `adapter` is (or will be) in, and whether it must be loaded there
        first; None while every slot holds an adapter that `in_use()` (the content hashes
        of running requests' adapters) lists."""
        key = adapter.content_hash
        slot = self.slot_of.get(key)
        if slot is not None:
            self._recent.move_to_end(key)
            return slot, False
        if None in self.holder:
            slot = self.holder.index(None)
        else:
            busy = set(in_use())
            victim = next((k for k in self._recent if k not in busy), None)
            if victim is None:
                return None
            slot = self.slot_of.pop(victim)
            del self._recent[victim]
        self.holder[slot] = key
        self.slot_of[key] = slot
        self._recent[key] = None
        self.num_loads += 1
        return slot, True

    def admit(self, adapter, in_use: Callable[[], Iterable[bytes]]) -> bool:
        """Put the adapter of a request being admitted in a slot (loaded with the next
        step that reaches the workers); False if every slot holds an adapter in use."""
        placed = self.place(adapter, in_use)
        if placed is None:
            return False
        slot, load = placed
        if load:
            self._pending_loads[slot] = adapter
        return True

    def take_loads(self) -> dict[int, object]:
        """The loads admitted since the last call (slot -> adapter), for the workers."""
        loads, self._pending_loads = self._pending_loads, {}
        return loads

    def check_invariants(self) -> None:
        assert len(self.holder) == self.max_loras
        assert {k: s for s, k in enumerate(self.holder) if k is not None} == self.slot_of
        assert set(self._recent) == set(self.slot_of)

"""LoRA slot placement (core/lora_slots.py) and the scheduler around it, with fake
adapters (anything with a `content_hash`), no torch.

A fake worker follows every step as the real one does (drop finished rows, write the
step's `lora_loads` into its slots, add the new rows with their `lora_slot`) and checks
that every scheduled token runs through a slot that holds its request's adapter, and that
no prefix-cache hit hands a request K/V computed under another adapter (or the base).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedlm.config import SchedulerConfig
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.lora_slots import LoRASlots
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.scheduler import Scheduler
from pagedlm.sampling_params import SamplingParams

BS = 4


@dataclass(frozen=True)
class FakeAdapter:
    name: str

    @property
    def content_hash(self) -> bytes:
        return b"adapter:" + self.name.encode()


A, B, C, D, E = (FakeAdapter(n) for n in "ABCDE")


def never_in_use():
    return ()


def in_use(*adapters):
    return lambda: [a.content_hash for a in adapters]


# ----- LoRASlots on its own ------------------------------------------------------------------

def test_fills_free_slots_first_then_finds_residents():
    slots = LoRASlots(3)
    assert slots.place(A, never_in_use) == (0, True)
    slots.check_invariants()
    assert slots.place(B, never_in_use) == (1, True)
    slots.check_invariants()
    # A resident adapter: its slot, nothing to load (even while every slot is busy).
    assert slots.place(A, in_use(A, B)) == (0, False)
    slots.check_invariants()
    assert slots.place(C, in_use(A, B)) == (2, True)  # a free slot: in_use is irrelevant
    slots.check_invariants()
    assert slots.holder == [A.content_hash, B.content_hash, C.content_hash]
    assert slots.num_loads == 3


def test_evicts_the_least_recently_placed_adapter_not_in_use():
    slots = LoRASlots(3)
    for adapter in (A, B, C):
        slots.place(adapter, never_in_use)
    slots.place(A, never_in_use)  # A is now the most recent: B, C, A
    slots.check_invariants()
    assert slots.place(D, in_use(B)) == (2, True)  # B is busy: C goes
    slots.check_invariants()
    assert C.content_hash not in slots.slot_of
    assert slots.slot_of[D.content_hash] == 2
    # Now B, A, D: B is the least recent and idle.
    assert slots.place(E, never_in_use) == (1, True)
    slots.check_invariants()
    assert slots.holder == [A.content_hash, E.content_hash, D.content_hash]
    assert slots.place(C, never_in_use) == (0, True)  # A, D, E: A goes
    slots.check_invariants()
    assert slots.num_loads == 6


def test_none_while_every_slot_is_in_use_and_nothing_changes():
    slots = LoRASlots(2)
    slots.place(A, never_in_use)
    slots.place(B, never_in_use)
    before = (list(slots.holder), dict(slots.slot_of), list(slots._recent), slots.num_loads)
    assert slots.place(C, in_use(A, B)) is None
    slots.check_invariants()
    assert (list(slots.holder), dict(slots.slot_of), list(slots._recent), slots.num_loads) == before
    # Adapters in use that are not resident do not matter; only the residents' use does.
    assert slots.place(C, in_use(A, D)) == (1, True)
    slots.check_invariants()


class SlotModel:
    """The placement rules, written out plainly."""

    def __init__(self, n: int) -> None:
        self.slots: list[str | None] = [None] * n
        self.order: list[str] = []  # least recently placed first

    def place(self, name: str, busy: set[str]):
        if name in self.slots:
            self.order.remove(name)
            self.order.append(name)
            return self.slots.index(name), False
        if None in self.slots:
            slot = self.slots.index(None)
        else:
            victim = next((k for k in self.order if k not in busy), None)
            if victim is None:
                return None
            slot = self.slots.index(victim)
            self.order.remove(victim)
        self.slots[slot] = name
        self.order.append(name)
        return slot, True


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4),
       st.lists(st.tuples(st.sampled_from("ABCDEF"), st.sets(st.sampled_from("ABCDEF"))),
                max_size=40))
def test_random_placements_follow_the_model(max_loras, ops):
    slots, model = LoRASlots(max_loras), SlotModel(max_loras)
    loads = 0
    for name, busy in ops:
        adapter = FakeAdapter(name)
        got = slots.place(adapter, in_use(*(FakeAdapter(b) for b in busy)))
        assert got == model.place(name, busy), (name, busy)
        loads += got is not None and got[1]
        slots.check_invariants()
        assert slots.holder == [None if k is None else FakeAdapter(k).content_hash
                                for k in model.slots]
        assert slots.num_loads == loads


# ----- the scheduler ----------------------------------------------------------------------

def make_scheduler(max_loras: int, num_blocks: int = 64, budget: int = 32, max_seqs: int = 8,
                   chunked: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                             max_model_len=num_blocks * BS, enable_chunked_prefill=chunked)
    return Scheduler(config, KVCacheManager(num_blocks=num_blocks, block_size=BS, enable_caching=True),
                     LoRASlots(max_loras))


def make_request(rid: str, lora: FakeAdapter | None, prompt_len: int = 6, max_tokens: int = 3,
                 first: int = 100) -> Request:
    return Request(rid, list(range(first, first + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0, lora=lora)


class FakeWorker:
    """What a worker holds: slot contents and each row's slot, updated as the real one
    is (finished rows out, loads written, new rows in); checks every scheduled token."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.slots: list[bytes | None] = [None] * s.lora_slots.max_loras
        self.row_slot: dict[str, int] = {}
        self.loads: list[tuple[int, str]] = []  # (slot, adapter name) as sent
        self.block_writer: dict[int, bytes | None] = {}  # block -> adapter whose K/V it holds

    def run(self, out) -> None:
        s = self.s
        for rid in out.finished_req_ids:
            self.row_slot.pop(rid)
        for slot, adapter in out.lora_loads.items():
            # A slot is only reloaded when no row still running uses it.
            assert all(v != slot for v in self.row_slot.values()), (slot, self.row_slot)
            self.slots[slot] = adapter.content_hash
            self.loads.append((slot, adapter.name))
        for src, dst in out.copy_blocks:
            self.block_writer[dst] = self.block_writer.get(src)
        new = list(out.new_reqs) + [f for fs in out.fork_reqs.values() for f in fs]
        for n in new:
            assert n.req_id not in self.row_slot
            self.row_slot[n.req_id] = n.lora_slot
        computed = {n.req_id: n.num_computed_tokens for n in out.new_reqs}
        computed.update(zip(out.cached_reqs.req_ids, out.cached_reqs.num_computed_tokens))
        for rid, num_new in out.num_scheduled_tokens.items():
            request = s.requests[rid]
            slot = self.row_slot[rid]
            if request.lora is None:
                assert slot == -1, rid
                key = None
            else:
                assert slot >= 0 and self.slots[slot] == request.lora.content_hash, (rid, slot)
                key = request.lora.content_hash
            blocks = s.kv.get_block_ids(rid)
            start = computed[rid]
            for i in range(start // BS, (start + num_new - 1) // BS + 1):
                self.block_writer[blocks[i]] = key
        # Prefix-cache hits (blocks computed before, or earlier in this very step): K/V
        # computed under the request's own adapter only.
        for n in new:
            request = s.requests[n.req_id]
            key = None if request.lora is None else request.lora.content_hash
            for block in n.block_ids[: n.num_computed_tokens // BS]:
                assert self.block_writer.get(block, "unwritten") == key, (n.req_id, block)


def step(s: Scheduler, worker: FakeWorker):
    out = s.schedule()
    s.check_invariants()
    if not out.is_empty:  # the engine sends only non-empty steps to the workers
        worker.run(out)
        # Every placement so far has reached the workers: they hold what the scheduler
        # thinks they hold.
        assert worker.slots == s.lora_slots.holder
    computed = {n.req_id: n.num_computed_tokens for n in out.new_reqs}
    computed.update(zip(out.cached_reqs.req_ids, out.cached_reqs.num_computed_tokens))
    sampled = {}
    for rid, num_new in out.num_scheduled_tokens.items():
        if computed[rid] + num_new == s.requests[rid].num_tokens:
            sampled[rid] = 7
            for f in out.fork_reqs.get(rid, ()):
                sampled[f.req_id] = 8
    s.update_from_output(out, sampled)
    s.check_invariants()
    return out


def admitted(out) -> dict[str, int]:
    return {n.req_id: n.lora_slot for n in out.new_reqs}


def test_a_request_waits_for_a_slot_and_does_not_block_others():
    s = make_scheduler(max_loras=1)
    worker = FakeWorker(s)
    for r in (make_request("a1", A, max_tokens=4), make_request("b1", B),
              make_request("base", None), make_request("a2", A, first=200)):
        s.add_request(r)
    out = step(s, worker)
    # b1 finds no slot (A is running): passed over; the base request and a2 (whose
    # adapter is resident) are admitted past it.
    assert admitted(out) == {"a1": 0, "base": -1, "a2": 0}
    assert out.lora_loads == {0: A}
    assert [r.request_id for r in s.waiting] == ["b1"]
    b1 = s.requests["b1"]
    while b1.status == RequestStatus.WAITING:
        a_running = any(r.lora == A for r in s.running)
        out = step(s, worker)
        if "b1" in admitted(out):
            # Only once every A request is done does B take A's slot, loaded in that step.
            assert not a_running
            assert admitted(out)["b1"] == 0 and out.lora_loads == {0: B}
        else:
            assert a_running and not out.lora_loads
    while s.has_unfinished_requests():
        step(s, worker)
    assert worker.loads == [(0, "A"), (0, "B")]  # each load sent exactly once


def test_the_freed_slot_goes_to_the_next_adapter():
    s = make_scheduler(max_loras=2)
    worker = FakeWorker(s)
    s.add_request(make_request("a", A, max_tokens=2))
    s.add_request(make_request("b", B, max_tokens=8))
    s.add_request(make_request("c", C))
    out = step(s, worker)
    assert admitted(out) == {"a": 0, "b": 1}
    assert out.lora_loads == {0: A, 1: B}
    while s.requests["c"].status == RequestStatus.WAITING:
        out = step(s, worker)
    assert admitted(out) == {"c": 0}  # A's slot: B is still running
    assert out.lora_loads == {0: C}
    assert s.requests["b"] in s.running
    while s.has_unfinished_requests():
        step(s, worker)
    assert worker.loads == [(0, "A"), (1, "B"), (0, "C")]


def test_a_load_waits_for_the_first_step_that_reaches_the_workers():
    """A placed adapter whose request cannot start (no KV blocks) is loaded with the
    next non-empty step, once, even if that step does not start its request yet."""
    s = make_scheduler(max_loras=1, num_blocks=6, budget=32)
    worker = FakeWorker(s)
    hog = make_request("hog", None, prompt_len=16, max_tokens=4)  # 4 of the 6 blocks
    s.add_request(hog)
    step(s, worker)
    hog.paused = True  # a running request that is not scheduled (a beam waiting)
    s.add_request(make_request("a", A, prompt_len=10, max_tokens=2))  # needs 3 blocks
    out = step(s, worker)
    assert out.is_empty and s.requests["a"].status == RequestStatus.WAITING
    assert s.lora_slots.slot_of == {A.content_hash: 0}  # placed, not yet sent
    assert worker.loads == []
    hog.paused = False
    out = step(s, worker)
    assert out.lora_loads == {0: A} and "a" not in out.num_scheduled_tokens
    while s.has_unfinished_requests():
        out = step(s, worker)
        assert not out.lora_loads
    assert worker.loads == [(0, "A")]


def test_preempted_requests_come_back_in_a_slot_holding_their_adapter():
    s = make_scheduler(max_loras=1, num_blocks=8, budget=8)
    worker = FakeWorker(s)
    for i, lora in enumerate([A, A, B, None, B, A]):
        s.add_request(make_request(f"r{i}", lora, prompt_len=5 + i, max_tokens=8, first=50 * i))
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        step(s, worker)
    assert not s.has_unfinished_requests()
    assert s.num_preemptions > 0
    assert s.kv.num_free_blocks == s.kv.num_blocks


# ----- random scheduling against the fake worker ---------------------------------------------

ADAPTERS = [None, A, B, C, D]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_loras=st.integers(1, 3),
    num_blocks=st.integers(6, 24),
    budget=st.sampled_from([5, 8, 32]),
    ops=st.lists(st.one_of(
        st.tuples(st.just("add"), st.integers(0, len(ADAPTERS) - 1), st.integers(1, 14),
                  st.integers(1, 6), st.integers(1, 2), st.integers(0, 2)),
        st.tuples(st.just("add"), st.integers(0, len(ADAPTERS) - 1), st.integers(1, 14),
                  st.integers(1, 6), st.just(1), st.integers(0, 2)),
        st.tuples(st.just("abort"), st.integers(0, 12)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ), min_size=4, max_size=30),
)
def test_random_schedules_run_every_token_under_its_adapter(max_loras, num_blocks, budget, ops):
    s = make_scheduler(max_loras, num_blocks=num_blocks, budget=budget, max_seqs=4)
    worker = FakeWorker(s)
    n = 0
    seq_ids: dict[str, list[str]] = {}
    for op in ops:
        if op[0] == "add":
            _, which, prompt_len, max_tokens, num_samples, prefix = op
            # Shared prefixes (three families), so that cache hits across adapters would
            # happen if the adapter did not key the block hashes.
            tokens = [1000 * prefix + t for t in range(prompt_len)]
            lora = ADAPTERS[which]
            if (prompt_len + max_tokens + BS - 1) // BS > num_blocks:
                continue
            rid = f"q{n}"
            n += 1
            make = lambda i, rid=rid, tokens=tokens, lora=lora, max_tokens=max_tokens: Request(  # noqa: E731
                rid if i == 0 else f"{rid}.{i}", tokens,
                SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=i, lora=lora)
            leader = make(0)
            s.add_request(leader)
            followers = [make(i) for i in range(1, num_samples)]
            if followers:
                s.add_forked_requests(leader, followers)
            seq_ids[rid] = [leader.request_id, *(f.request_id for f in followers)]
        elif op[0] == "abort":  # as the engine aborts a request: all its samples
            s.finish_requests(seq_ids.get(f"q{op[1]}", []), RequestStatus.FINISHED_ABORTED)
            s.check_invariants()
        else:
            for _ in range(op[1]):
                step(s, worker)
    for _ in range(500):
        if not s.has_unfinished_requests():
            break
        step(s, worker)
    assert not s.has_unfinished_requests()
    step(s, worker)  # an idle step
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert len(worker.loads) <= s.lora_slots.num_loads
    event(f"loads beyond max_loras: {len(worker.loads) > max_loras}")
    event(f"preemptions: {s.num_preemptions > 0}")
    event(f"prefix hits: {s.prefix_cache_hits > 0}")


# ----- prefix-cache keys ----------------------------------------------------------------------

def _hashes(lora, tokens=tuple(range(10, 22)), salt=None):
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    r = Request("r", list(tokens), SamplingParams(max_tokens=2), seed=0, lora=lora,
                cache_salt=salt)
    kv.get_computed_blocks(r)  # hashes the full blocks
    assert len(r.block_hashes) == len(tokens) // BS
    return r.block_hashes


def test_block_hashes_are_keyed_by_the_adapter():
    a, b, base = _hashes(A), _hashes(B), _hashes(None)
    assert _hashes(A) == a  # the same adapter (content): the same blocks
    assert _hashes(FakeAdapter("A")) == a
    for x, y in ((a, b), (a, base), (b, base)):
        assert not set(x) & set(y)  # no block of one prefix names a block of the other
    assert _hashes(A, salt="s") != a and _hashes(A, salt="s") != _hashes(None, salt="s")
    assert _hashes(A, salt="s") == _hashes(A, salt="s")


def test_no_prefix_hit_across_adapters_in_the_scheduler():
    s = make_scheduler(max_loras=2)
    worker = FakeWorker(s)
    hits = []
    for rid, lora in (("a", A), ("b", B), ("base", None), ("a-again", A)):
        s.add_request(make_request(rid, lora, prompt_len=13, max_tokens=2))
        while s.has_unfinished_requests():
            out = step(s, worker)
            hits += [(n.req_id, n.num_computed_tokens) for n in out.new_reqs]
    assert hits == [("a", 0), ("b", 0), ("base", 0), ("a-again", 12)]


@pytest.mark.parametrize("max_loras", [1, 2])
def test_slots_never_reloaded_under_running_rows(max_loras):
    """Three adapters alternating over more requests than slots: every load lands on a
    slot no row still uses (FakeWorker.run checks), and the slots end up consistent."""
    s = make_scheduler(max_loras=max_loras, budget=16)
    worker = FakeWorker(s)
    for i in range(9):
        s.add_request(make_request(f"r{i}", [A, B, C][i % 3], prompt_len=3 + i % 4,
                                   max_tokens=1 + i % 3, first=100 * i))
    while s.has_unfinished_requests():
        step(s, worker)
    assert len(worker.loads) == s.lora_slots.num_loads
    assert worker.slots == s.lora_slots.holder

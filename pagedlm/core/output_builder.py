"""How scheduled requests reach the workers: the entries of each step's SchedulerOutput.

The workers keep a persistent batch and are sent only what they do not hold
(core/sched_output.py). `Request.num_synced_tokens` records how many leading tokens of a
request they hold (0: they do not hold the request). `OutputBuilder.add` writes one
scheduled request into the step's output: whole (`NewRequestData`) when the workers do
not hold it, else the tokens and block ids that changed since they last saw it; with it,
the samples that fork from it at this step. `unsync` marks a request they must drop
(finished, preempted, or a fork that did not start); `finish` lists those once, in the
next step that reaches the workers, with the step's block copies and LoRA loads.
"""

from __future__ import annotations

from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.lora_slots import LoRASlots
from pagedlm.core.request import Request
from pagedlm.core.sched_output import NewRequestData, SchedulerOutput


class OutputBuilder:
    def __init__(self, kv: KVCacheManager, lora_slots: LoRASlots | None,
                 pending_forks: dict[str, list[Request]]) -> None:
        self.kv = kv
        self.lora_slots = lora_slots
        # The scheduler's own table (leader id -> samples waiting for its prompt), shared:
        # the followers go out with the step that computes the leader's last prompt token.
        self.pending_forks = pending_forks
        # Requests the workers hold that they must drop at the next step.
        self._finished_req_ids: list[str] = []

    def unsync(self, request: Request) -> None:
        """The workers drop the request at the next step; if it runs again, it is sent
        to them whole."""
        if request.num_synced_tokens:
            self._finished_req_ids.append(request.request_id)
            request.num_synced_tokens = 0

    def add(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        """`request` computes `num_new` tokens at this step (its blocks already allocated)."""
        request_id = request.request_id
        num_computed = request.num_computed_tokens
        num_tokens = len(request.all_token_ids)
        start = request.num_synced_tokens
        if start == 0:
            out.new_reqs.append(self._new_request_data(request, self.kv.take_block_ids(request_id),
                                                       num_computed))
        else:
            block_offset, new_block_ids = self.kv.take_block_ids_delta(request_id)
            out.cached_reqs.append(request_id, start, request.all_token_ids[start:],
                                   block_offset, new_block_ids, num_computed)
        request.num_synced_tokens = num_tokens
        if num_computed + num_new == num_tokens:
            followers = self.pending_forks.get(request_id)
            if followers:
                # They share the table the leader has after this step's allocation.
                block_ids = self.kv.get_block_ids(request_id)
                out.fork_reqs[request_id] = [
                    self._new_request_data(f, list(block_ids), num_computed + num_new)
                    for f in followers]
                for f in followers:
                    f.num_synced_tokens = f.num_tokens
        out.num_scheduled_tokens[request_id] = num_new
        out.total_num_scheduled_tokens += num_new
        num_prompt = len(request.prompt_token_ids)
        if num_computed < num_prompt:
            out.num_prompt_tokens += min(num_new, num_prompt - num_computed)

    def finish(self, out: SchedulerOutput) -> None:
        """Complete the step's output once every request is added."""
        out.copy_blocks = self.kv.take_pending_copies()
        if not out.is_empty:  # an empty step never reaches the workers: keep them for the next
            out.finished_req_ids, self._finished_req_ids = self._finished_req_ids, []
            if self.lora_slots is not None:
                out.lora_loads = self.lora_slots.take_loads()

    def _new_request_data(self, request: Request, block_ids: list[int],
                          num_computed: int) -> NewRequestData:
        # A request reaches the workers only while its adapter is in a slot: placed at
        # admission, kept there while it runs (forks and beams share it).
        lora_slot = -1 if request.lora is None else self.lora_slots.slot_of[request.lora.content_hash]
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            seed=request.seed,
            eos_token_ids=request.eos_token_ids,
            block_ids=block_ids,
            num_computed_tokens=num_computed,
            lora_slot=lora_slot,
        )

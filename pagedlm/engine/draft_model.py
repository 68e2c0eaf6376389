"""Speculative decoding with a draft model: a smaller model with the same vocabulary
proposes, greedily, the next k tokens of each decoding sequence.

The draft runs in the engine core's process, on the target's device, as a Worker of its
own (its C++ decoder or CUDA graphs included) with a paged KV cache of its own, as many
blocks as the target's. It keeps a mirror of each sequence it drafts for: the sequence's
tokens, then its own drafts; the leading tokens whose K/V its cache holds. Each target
step it

  1. syncs every mirror to the sequence's tokens: K/V of the drafts the target accepted
     stay valid (they were computed for the same tokens), the rest is dropped and the
     blocks past the tokens are freed;
  2. runs one forward over what each mirror has not computed (the target's bonus token,
     or a longer catch-up after a pause) and takes the argmax: the first draft;
  3. runs k - 1 more one-token steps for the sequences that want more drafts.

The workers speak the same step protocol as the target's (core/sched_output.py): a
mirror is sent whole once, then token and block-table deltas.
"""

from __future__ import annotations

import logging

from pagedlm.config import EngineArgs, SpeculativeConfig
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.request import Request
from pagedlm.core.sched_output import NewRequestData, SchedulerOutput
from pagedlm.engine.spec_decode import REST_STEPS, NgramProposer, Proposer
from pagedlm.loader.model_loader import resolve_model_source
from pagedlm.sampling_params import SamplingParams
from pagedlm.worker.worker import Worker

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0, max_tokens=1 << 30)
# Speculative decoding stops in steps with more decoding sequences than this, by default
# (SpeculativeConfig.disable_by_batch_size).
DEFAULT_CPU_SPEC_MAX_BATCH = 4
DEFAULT_GPU_SPEC_MAX_BATCH = 32


def make_proposer(args: EngineArgs, device_type: str, vocab_size: int, num_blocks: int,
                  block_size: int, max_model_len: int) -> Proposer | None:
    """The proposer `args.speculative_config` asks for (None: no speculation)."""
    config = args.speculative_config
    if config is None:
        return None
    max_batch = DEFAULT_CPU_SPEC_MAX_BATCH if device_type == "cpu" else DEFAULT_GPU_SPEC_MAX_BATCH
    if config.method == "ngram":
        return NgramProposer(config, max_batch)
    return DraftModelProposer(config, max_batch, args, vocab_size, num_blocks, block_size,
                              args.max_num_seqs, max_model_len)


class _Mirror:
    __slots__ = ("request", "worker_len", "synced")

    def __init__(self, request: Request) -> None:
        self.request = request  # its all_token_ids: the sequence's tokens, then drafts
        self.worker_len = 0  # tokens the draft worker holds for it (0: not sent yet)
        self.synced = 0  # leading tokens the worker holds that are still right


class DraftModelProposer(Proposer):
    # Each try after a rest costs the draft a catch-up forward over what it missed: a
    # sequence whose drafts keep failing gives up after two rests.
    # (The base class's first rest of REST_STEPS and n + 1 cap after a partial acceptance
    # stay: its every draft token costs a forward of the draft model.)
    max_rest_steps = 2 * REST_STEPS
    start_with_all = False  # one draft first: k draft forwards only once they pay off
    min_recent_acceptance = 0.15  # each new sequence costs the draft a prefill of its prompt
    def __init__(self, config: SpeculativeConfig, default_max_batch: int,
                 target_args: EngineArgs, target_vocab_size: int, num_blocks: int,
                 block_size: int, max_num_seqs: int, max_model_len: int) -> None:
        super().__init__(config, default_max_batch)
        source = resolve_model_source(config.model)
        vocab = source.hf_config.vocab_size
        if vocab != target_vocab_size:
            raise ValueError(f"speculative_config.model {config.model!r} has a vocabulary of "
                             f"{vocab} tokens, the model {target_vocab_size}: a draft must "
                             f"share the model's tokenizer")
        args = EngineArgs(
            model=config.model, skip_tokenizer_init=True, dtype=target_args.dtype,
            device=target_args.device, seed=target_args.seed, block_size=block_size,
            max_model_len=max_model_len, enable_prefix_caching=False,
            weight_dtype=target_args.weight_dtype, kv_cache_dtype=target_args.kv_cache_dtype,
            enforce_eager=target_args.enforce_eager, num_threads=target_args.num_threads,
            attention_backend=target_args.attention_backend, max_num_seqs=max_num_seqs)
        self.worker = Worker(args, source)
        spec = self.worker.worker_spec()
        self.worker.initialize_cache(num_blocks, max_num_seqs, max_model_len)
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=False,
                                 sliding_window=spec.sliding_window)
        self.max_model_len = max_model_len
        self._mirrors: dict[str, _Mirror] = {}
        self._finished: list[str] = []  # mirrors the worker must drop at the next step
        logger.info("draft model %s: %d KV blocks of %d tokens", config.model, num_blocks,
                    block_size)

    def forget(self, seq_id: str) -> None:
        super().forget(seq_id)
        mirror = self._mirrors.pop(seq_id, None)
        if mirror is not None:
            self.kv.free(mirror.request)
            if mirror.worker_len:
                self._finished.append(seq_id)

    def _draft(self, requests: list[Request], counts: list[int]) -> None:
        wanted: dict[str, int] = {}
        for request, k in zip(requests, counts):
            room = self.max_model_len - request.num_tokens
            if room > 0:
                wanted[request.request_id] = min(k, room)
                self._sync(request)
        drafts: dict[str, list[int]] = {seq_id: [] for seq_id in wanted}
        for step in range(max(wanted.values(), default=0)):
            active = [s for s, k in wanted.items() if len(drafts[s]) == step and k > step]
            if not active:
                break
            sampled = self._step(active)
            for seq_id, token in sampled.items():
                drafts[seq_id].append(token)
                self._mirrors[seq_id].request.all_token_ids.append(token)
        for request in requests:
            if drafts.get(request.request_id):
                request.spec_token_ids = drafts[request.request_id]

    def _sync(self, request: Request) -> None:
        """Make the mirror's tokens the sequence's; keep the K/V still valid."""
        seq_id = request.request_id
        tokens = request.all_token_ids
        mirror = self._mirrors.get(seq_id)
        if mirror is None:
            mirror = self._mirrors[seq_id] = _Mirror(Request(seq_id, list(tokens), _GREEDY, 0))
            return
        mine = mirror.request
        # The last token is always computed again (its argmax is the first draft), even
        # if the mirror had computed it (the sequence did not advance since).
        common = min(mine.num_computed_tokens, len(tokens) - 1)
        start = max(0, common - self.k - 2)  # earlier tokens never change
        for i in range(start, common):
            if mine.all_token_ids[i] != tokens[i]:
                common = i
                break
        mine.num_computed_tokens = common
        mirror.synced = min(mirror.synced, common)
        mine.all_token_ids = list(tokens)
        self.kv.free_excess_blocks(mine)

    def _step(self, seq_ids: list[str]) -> dict[str, int]:
        """One forward of the draft over what each sequence has not computed; its argmax."""
        sched = SchedulerOutput(finished_req_ids=self._finished)
        self._finished = []
        scheduled: list[str] = []
        for seq_id in seq_ids:
            mirror = self._mirrors[seq_id]
            r = mirror.request
            num_new = r.num_tokens - r.num_computed_tokens
            if not self.kv.allocate_slots(r, num_new):
                continue  # the draft's cache is full: no drafts for it this time
            if mirror.worker_len == 0:
                sched.new_reqs.append(NewRequestData(
                    req_id=seq_id, prompt_token_ids=list(r.all_token_ids), output_token_ids=[],
                    sampling_params=_GREEDY, seed=0, eos_token_ids=(),
                    block_ids=self.kv.take_block_ids(seq_id),
                    num_computed_tokens=r.num_computed_tokens))
            else:
                # Rewrite from the first token the worker holds wrong; a row that got
                # shorter is sent from one token earlier (a multi-token delta truncates).
                offset = mirror.synced
                if r.num_tokens - offset < 2 and r.num_tokens < mirror.worker_len:
                    offset = max(0, offset - 1)
                block_offset, block_ids = self.kv.take_block_ids_delta(seq_id)
                sched.cached_reqs.append(seq_id, offset, r.all_token_ids[offset:], block_offset,
                                         block_ids, r.num_computed_tokens)
            mirror.worker_len = mirror.synced = r.num_tokens
            sched.num_scheduled_tokens[seq_id] = num_new
            sched.total_num_scheduled_tokens += num_new
            scheduled.append(seq_id)
        if not scheduled:
            return {}
        out = self.worker.execute_model(sched)
        for seq_id in scheduled:
            r = self._mirrors[seq_id].request
            r.num_computed_tokens = r.num_tokens
        return {s: out.sampled_token_ids[s] for s in scheduled if s in out.sampled_token_ids}

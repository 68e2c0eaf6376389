"""How often n-gram drafts are accepted, by the length of the match they came from: the
batch-1 workloads of `pagedlm bench spec-decode` (ShareGPT turns whose reply repeats the
prompt, and plain chat; greedy, chat template, each reply's length as max_tokens) through an
engine that proposes all k drafts after every match (no cap by match length, no back-off),
every verification logged with its match length m (the looked-up n-gram and the tokens
before it that agree with those before the earlier occurrence, counted up to 64) and the
drafts accepted. Prints, per workload and bucket of m, P(the i-th draft is accepted | it was
proposed), i = 1 .. k: the figures behind the n-gram proposer's cap of m - 1 drafts
(pagedlm/engine/spec_decode.py).

    python benchmarks/cpu/ngram_match_acceptance.py [--seed 0] [--num-prompts 16]
        [--num-speculative-tokens 15] [--weight-dtype q8 --kv-cache-dtype float16]
"""

import argparse
import collections

from pagedlm import LLM, SamplingParams
from pagedlm.benchmarks.cli import SPEC_DECODE_MAX_OUTPUT_LEN as MAX_OUTPUT_LEN
from pagedlm.benchmarks.datasets import load_sharegpt_records
from pagedlm.benchmarks.spec_decode import batch1_workloads, chat_ids
from pagedlm.engine.spec_decode import NgramProposer

MAX_MATCH = 64
BUCKETS = (2, 3, 4, 6, 8, 12, 16, 24, 32, MAX_MATCH)


class LoggingProposer(NgramProposer):
    """All k drafts after every match, and a log of (match length, drafts, accepted).
    Made from the engine's proposer (`adopt`), in the same state."""

    match_slack = None
    pending: dict[str, int]
    log: list[tuple[int, int, int]]

    @classmethod
    def adopt(cls, proposer: NgramProposer) -> "LoggingProposer":
        new = cls.__new__(cls)
        new.__dict__.update(proposer.__dict__)
        new.pending, new.log = {}, []
        return new

    def _draft(self, requests, counts) -> None:
        for request in requests:
            tokens = request.all_token_ids
            match = self._match(self._seqs[request.request_id], tokens, MAX_MATCH)
            if match is None:
                continue
            after, m = match
            request.spec_token_ids = tokens[after:after + self.k]
            self.pending[request.request_id] = m

    def record(self, spec, accepted) -> None:
        for seq_id, drafts in spec.items():
            m = self.pending.pop(seq_id, None)
            if m is not None:
                self.log.append((m, len(drafts), len(accepted.get(seq_id, ()))))
        super().record(spec, accepted)
        for state in self._seqs.values():  # no back-off: every sequence keeps all k
            state.num_drafts, state.rest = self.k, 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--num-speculative-tokens", type=int, default=15)
    p.add_argument("--weight-dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args()

    k = args.num_speculative_tokens
    llm = LLM(num_threads=args.num_threads, weight_dtype=args.weight_dtype,
              kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": k})
    core = llm.llm_engine.core
    proposer = core.proposer = LoggingProposer.adopt(core.proposer)
    tokenizer = llm.get_tokenizer()
    workloads = batch1_workloads(tokenizer, args.num_prompts, args.seed, MAX_OUTPUT_LEN,
                                 load_sharegpt_records())
    print(f"P(draft i accepted | proposed) by match length m, {k} drafts, no back-off, "
          f"seed {args.seed}, weights {args.weight_dtype}, KV cache {args.kv_cache_dtype}")
    for workload, requests in workloads.items():
        proposer.log.clear()
        for r in requests:
            params = SamplingParams(temperature=0, max_tokens=r.output_len)
            llm.generate({"prompt_token_ids": chat_ids(tokenizer, r.prompt)}, params, use_tqdm=False)
        by_bucket: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
        for m, drafted, accepted in proposer.log:
            by_bucket[next(b for b in BUCKETS if m <= b)].append((drafted, accepted))
        print(f"{workload}: {len(proposer.log)} verifications")
        low = 2
        for bucket in BUCKETS:
            rows = by_bucket.get(bucket, [])
            cells = []
            for i in range(1, k + 1):
                proposed = sum(1 for d, _ in rows if d >= i)
                taken = sum(1 for d, a in rows if d >= i and a >= i)
                cells.append(f"{taken / proposed:4.2f}" if proposed >= 5 else "   -")
            span = f"{low}" if low == bucket else f"{low}-{bucket}"
            print(f"  m {span:>5s}  n {len(rows):4d}  " + " ".join(cells))
            low = bucket + 1


if __name__ == "__main__":
    main()

"""N-gram proposer settings tried without the model: greedy speculative decoding is a replay.

With temperature 0 the tokens a request produces are the same with and without
speculation (tested), so what the n-gram proposer would draft, and what the verification
would accept, follows from the plain engine's greedy output alone. This script takes the
batch-1 workloads of `pagedlm bench spec-decode` (16 repeating turns and 16 ShareGPT chats,
seed 0, chat template, the same max_tokens), generates their greedy outputs once with the
plain engine, then replays each request step by step through the engine's own
NgramProposer (engine/spec_decode.py, back-off included) with every setting asked for:
a step drafts, the longest prefix of the drafts equal to the output is accepted, and one
more token comes from the step itself.

A step's time comes from a measured cost per row count: the "rows ... step" table that
`benchmarks/cpu/spec_step_profile.py` prints (its ms per decode step by rows; rows past the
table's last cost its last step plus the table's mean cost per row). The figure printed is
then a model's, ms per output token after the first: use it to rank settings and to see
where the time goes, and `pagedlm bench spec-decode` to measure the one chosen.

    python benchmarks/cpu/spec_proposer_replay.py --profile PROFILE.txt
        [--setting name=key:value,...] [--resync] [--tree-branches N ...] [--history]
        [--extra-row-scale 0.8]

--setting keys: num_speculative_tokens, prompt_lookup_min, prompt_lookup_max,
match_slack, rest_steps. --resync adds the "edit" heuristic: after a verification whose
draft at source position s was rejected, the next drafts resume the source at s + 1 (a
substituted token; s + 2 where the new token equals the source's s + 1, a deleted one)
when no n-gram matches.

Two proposers the engine does not have, replayed to see whether they would pay:
--tree-branches N drafts trees: beside the continuation of the n-gram's most recent
earlier occurrence (the default's drafts), those of up to N - 1 older occurrences, each
capped as the default caps its own; a step accepts the longest prefix any branch has in
common with the output and costs 1 + the tree's distinct nodes in rows (a tree
verification's rows, each seeing its branch). --history lets a sequence without an n-gram
match of its own look its n-grams up in the prompts and outputs of the workload's earlier
requests (a cross-request cache, as llama.cpp's lookup decoding and suffix decoding keep).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from types import SimpleNamespace

from pagedlm.config import SpeculativeConfig
from pagedlm.engine.spec_decode import NgramProposer


def read_step_costs(path: str) -> dict[int, float]:
    """rows -> ms per step, from spec_step_profile.py's table."""
    costs: dict[int, float] = {}
    for line in Path(path).read_text().splitlines():
        m = re.match(r"\s*(\d+)\s+(\d+)\s+([\d.]+)(?:\s|$)", line)
        if m:
            costs[int(m.group(1))] = float(m.group(3))
    if 1 not in costs:
        raise SystemExit(f"{path}: no 'rows steps step ...' table with a 1-row line")
    return costs


def step_cost(costs: dict[int, float], rows: int) -> float:
    if rows in costs:
        return costs[rows]
    top = max(costs)
    per_row = (costs[top] - costs[1]) / max(1, top - 1)
    if rows > top:
        return costs[top] + per_row * (rows - top)
    below = max(r for r in costs if r < rows)
    return costs[below] + per_row * (rows - below)


def greedy_outputs(weight_dtype: str, kv_cache_dtype: str) -> dict[str, list[tuple[list[int], list[int]]]]:
    from pagedlm import LLM, SamplingParams
    from pagedlm.benchmarks.cli import SPEC_DECODE_MAX_OUTPUT_LEN
    from pagedlm.benchmarks.datasets import load_sharegpt_records
    from pagedlm.benchmarks.spec_decode import batch1_workloads, chat_ids

    llm = LLM(num_threads=2, weight_dtype=weight_dtype, kv_cache_dtype=kv_cache_dtype)
    tokenizer = llm.get_tokenizer()
    out = {}
    workloads = batch1_workloads(tokenizer, 16, 0, SPEC_DECODE_MAX_OUTPUT_LEN, load_sharegpt_records())
    for name, requests in workloads.items():
        prompts = [chat_ids(tokenizer, r.prompt) for r in requests]
        params = [SamplingParams(temperature=0, max_tokens=r.output_len) for r in requests]
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        out[name] = [(p, list(r.outputs[0].token_ids)) for p, r in zip(prompts, results)]
    return out


class ResyncProposer(NgramProposer):
    """NgramProposer, and after a rejected draft at source position s with no n-gram match,
    drafts from s + 1 (s + 2 where the new token is the source's s + 1). Keyed by each
    sequence's proposer state, which `_lookup` receives."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._source: dict[int, int] = {}  # where the sequence's last drafts came from
        self._missed: dict[int, int] = {}  # the source position of a rejected draft

    def record(self, spec, accepted) -> None:
        for seq_id, drafts in spec.items():
            key = id(self._seqs.get(seq_id))
            n = len(accepted.get(seq_id, ()))
            if key in self._source and n < len(drafts):
                self._missed[key] = self._source[key] + n
            else:
                self._missed.pop(key, None)
        super().record(spec, accepted)

    def _lookup(self, state, tokens, k):
        key = id(state)
        missed = self._missed.pop(key, None)
        match = self._match(state, tokens, k + self.match_slack)
        if match is not None:
            after, m = match
            self._source[key] = after
            return tokens[after:after + min(k, max(1, m - self.match_slack))]
        if missed is not None:
            start = missed + 2 if missed + 1 < len(tokens) and tokens[missed + 1] == tokens[-1] else missed + 1
            if start < len(tokens) - 1:
                self._source[key] = start
                return tokens[start:start + k]
        self._source.pop(key, None)
        return []


class Occurrences:
    """Every earlier occurrence of a sequence's n-grams (the engine's index keeps the last)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.index: dict[tuple[int, ...], list[tuple[list[int], int]]] = {}

    def add(self, tokens: list[int], start: int, stop: int) -> None:
        """Index the n-grams of `tokens` that end at positions start..stop - 1."""
        for end in range(start, stop):
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                self.index.setdefault(tuple(tokens[end + 1 - n:end + 1]), []).append((tokens, end + 1))

    def continuations(self, tokens: list[int], k: int, slack: int, limit: int) -> list[list[int]]:
        """Up to `limit` distinct drafts after the longest n-gram ending `tokens`, most recent
        occurrence first, each capped as NgramProposer caps its drafts (m - slack after a
        match of m tokens, at most k)."""
        length = len(tokens)
        for n in range(min(self.n_max, length), self.n_min - 1, -1):
            found = self.index.get(tuple(tokens[length - n:]))
            if not found:
                continue
            out: list[list[int]] = []
            for source, after in reversed(found):
                m = n
                while m < min(after, k + slack) and source[after - 1 - m] == tokens[length - 1 - m]:
                    m += 1
                branch = source[after:after + min(k, max(1, m - slack))]
                if branch and branch not in out:
                    out.append(branch)
                if len(out) == limit:
                    break
            return out
        return []


def tree_rows(branches: list[list[int]]) -> int:
    """A tree verification's rows: the last token and each distinct node of the tree."""
    return 1 + len({tuple(b[:i]) for b in branches for i in range(1, len(b) + 1)})


def replay(pairs, costs, settings: dict[str, int], resync: bool = False, tree_branches: int = 1,
           history: bool = False) -> tuple[float, dict[int, int], float]:
    """ms per output token after the first, steps by rows, tokens per step."""
    config_keys = {"num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
    config = SpeculativeConfig(method="ngram", **{"num_speculative_tokens": 15,
                                                  **{k: v for k, v in settings.items() if k in config_keys}})
    attrs = {k: v for k, v in settings.items() if k not in config_keys}
    cls = type("Replayed", (ResyncProposer if resync else NgramProposer,), attrs)
    slack = cls.match_slack or 0
    earlier = Occurrences(config.prompt_lookup_min, config.prompt_lookup_max)  # --history
    total_ms, tokens, steps = 0.0, 0, {}
    for prompt, output in pairs:
        proposer = cls(config, 256)
        own, own_indexed = Occurrences(config.prompt_lookup_min, config.prompt_lookup_max), 0
        seq, pos = list(prompt) + output[:1], 1  # the first token comes from the prefill (grows in place)
        request = SimpleNamespace(request_id="r", all_token_ids=seq, spec_token_ids=[])
        while pos < len(output):
            request.spec_token_ids = []
            proposer.propose([request])
            drafts = request.spec_token_ids
            k = proposer._seqs["r"].num_drafts  # the count the back-off allows this step
            if tree_branches > 1 and drafts:
                own.add(seq, own_indexed, len(seq) - 1)
                own_indexed = len(seq) - 1
                branches = own.continuations(seq, k, slack, tree_branches)
                assert branches[0] == drafts, (branches[0], drafts)
            elif history and not drafts and k > 0:
                branches = earlier.continuations(seq, k, slack, 1)
            else:
                branches = [drafts] if drafts else []
            branches = [b[:len(output) - pos] for b in branches]
            best, n = [], 0
            for branch in branches:
                a = 0
                while a < len(branch) and branch[a] == output[pos + a]:
                    a += 1
                if not best or a > n:
                    best, n = branch, a
            rows = tree_rows(branches)
            total_ms += step_cost(costs, rows)
            steps[rows] = steps.get(rows, 0) + 1
            if best:
                proposer.record({"r": best}, {"r": best[:n]})
            seq.extend(output[pos:pos + n + 1])
            pos += n + 1
        tokens += len(output) - 1
        if history:
            full = list(prompt) + list(output)
            earlier.add(full, 0, len(full) - 1)
    return total_ms / tokens, steps, tokens / sum(steps.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, help="spec_step_profile.py's output (the step costs)")
    p.add_argument("--outputs", help="greedy outputs JSON to reuse (written here when missing)")
    p.add_argument("--setting", action="append", default=[],
                   help="name=key:value,... replayed beside the default proposer (repeatable)")
    p.add_argument("--resync", action="store_true", help="also replay every setting with --resync's heuristic")
    p.add_argument("--tree-branches", type=int, nargs="+", default=[],
                   help="also replay every setting drafting trees of up to this many branches (each value)")
    p.add_argument("--history", action="store_true",
                   help="also replay every setting with the workload's earlier requests as a lookup source")
    p.add_argument("--extra-row-scale", type=float, default=1.0,
                   help="scale what each row past the first adds to a step (what-if: cheaper verification)")
    p.add_argument("--weight-dtype", default="q8")
    p.add_argument("--kv-cache-dtype", default="float16")
    args = p.parse_args()
    costs = read_step_costs(args.profile)
    costs = {r: costs[1] + (c - costs[1]) * args.extra_row_scale for r, c in costs.items()}
    if args.outputs and Path(args.outputs).exists():
        data = json.loads(Path(args.outputs).read_text())
    else:
        data = greedy_outputs(args.weight_dtype, args.kv_cache_dtype)
        if args.outputs:
            Path(args.outputs).write_text(json.dumps(data))
    settings: list[tuple[str, dict[str, int]]] = [("default", {})]
    for spec in args.setting:
        name, _, body = spec.partition("=")
        settings.append((name, {k: int(v) for k, v in (kv.split(":") for kv in body.split(",") if kv)}))
    variants = [(name, s, {}) for name, s in settings]
    if args.resync:
        variants += [(name + "+resync", s, {"resync": True}) for name, s in settings]
    for branches in args.tree_branches:
        variants += [(f"{name}+tree{branches}", s, {"tree_branches": branches}) for name, s in settings]
    if args.history:
        variants += [(name + "+history", s, {"history": True}) for name, s in settings]
    print(f"step costs (ms by rows) from {args.profile}: "
          + ", ".join(f"{r}: {c:.2f}" for r, c in sorted(costs.items())))
    for workload, pairs in data.items():
        base, _, _ = replay(pairs, costs, {})
        print(f"{workload} ({len(pairs)} requests; without speculation {costs[1]:.2f} ms per token)")
        for name, s, extra in variants:
            ms, steps, per_step = replay(pairs, costs, s, **extra)
            print(f"  {name:24s} {ms:6.3f} ms/token after the first, {costs[1] / ms:5.3f}x over none, "
                  f"{base / ms:5.3f}x of default; {sum(steps.values())} steps ({steps.get(1, 0)} without "
                  f"drafts), {per_step:.2f} tokens per step")


if __name__ == "__main__":
    main()

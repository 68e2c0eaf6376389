"""benchmarks/cpu/spec_proposer_replay.py's replayed proposers (tree drafts, cross-request
lookup) on made-up token sequences: no model, no step profile."""

import importlib.util
from pathlib import Path

from pagedlm.config import SpeculativeConfig
from pagedlm.engine.spec_decode import NgramProposer

_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu"
_spec = importlib.util.spec_from_file_location("spec_proposer_replay", _DIR / "spec_proposer_replay.py")
replay_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replay_script)

COSTS = {1: 1.0, 2: 1.5, 16: 8.5}  # ms by rows; the rest interpolated by the script


def engine_drafts(tokens: list[int], k: int) -> list[int]:
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=k), 256)
    request = type("R", (), {"request_id": "r", "all_token_ids": tokens, "spec_token_ids": []})()
    proposer.propose([request])
    return request.spec_token_ids


def test_occurrences_most_recent_first_is_the_engines_drafts():
    # "1 2" occurs three times before the end, followed by 3 4 5, then 7 8 9, then 3 4 6.
    tokens = [1, 2, 3, 4, 5, 0, 1, 2, 7, 8, 9, 0, 1, 2, 3, 4, 6, 0, 1, 2]
    occ = replay_script.Occurrences(2, 4)
    occ.add(tokens, 0, len(tokens) - 1)
    branches = occ.continuations(tokens, 15, NgramProposer.match_slack, 8)
    assert branches[0] == engine_drafts(tokens, 15)
    # The longest n-gram that recurs, "0 1 2", occurs twice (the first "1 2" has no 0
    # before it): a match of 3 tokens, so 3 - 1 drafts after each occurrence.
    assert branches == [[3, 4], [7, 8]]
    assert occ.continuations(tokens, 15, 1, 2) == [[3, 4], [7, 8]]


def test_tree_rows_count_shared_prefixes_once():
    assert replay_script.tree_rows([]) == 1
    assert replay_script.tree_rows([[3, 4], [3, 5], [7]]) == 1 + 4  # 3, 3-4, 3-5, 7
    assert replay_script.tree_rows([[3, 4, 5], [3, 4]]) == 1 + 3


def test_history_drafts_from_earlier_requests_only():
    # The second request repeats the first's output, which its own prompt does not hold.
    output = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59] * 2
    pairs = [([1, 2, 3], output), ([4, 5, 6], output)]
    plain, plain_steps, _ = replay_script.replay(pairs, COSTS, {})
    history, history_steps, _ = replay_script.replay(pairs, COSTS, {}, history=True)
    assert sum(history_steps.values()) < sum(plain_steps.values())
    assert history < plain
    # One request alone: nothing earlier to look in, the same steps as without.
    alone, alone_steps, _ = replay_script.replay(pairs[:1], COSTS, {}, history=True)
    assert alone_steps == replay_script.replay(pairs[:1], COSTS, {})[1]


def test_tree_replay_accepts_the_best_branch():
    # After "0 1 2" the output goes on with 7 8: the most recent occurrence drafts 3 4, the
    # older one 7 8. A tree of two branches accepts them; the chain does not.
    prompt = [0, 1, 2, 7, 8, 9, 0, 1, 2, 3, 4, 5, 0, 1]
    output = [2, 7, 8]
    _, chain_steps, _ = replay_script.replay([(prompt, output)], COSTS, {})
    _, tree_steps, _ = replay_script.replay([(prompt, output)], COSTS, {}, tree_branches=2)
    assert tree_steps == {5: 1}  # one step: the last token and 4 tree nodes (3, 3 4, 7, 7 8)
    assert chain_steps == {3: 1, 2: 1}  # 3 4 rejected, then 8 drafted after "2 7"

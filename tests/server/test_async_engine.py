"""AsyncLLMEngine without HTTP: streams match the offline engine, aborts free blocks,
the waiting queue is bounded, bad input is a ValueError at `add`."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedlm.config import EngineArgs
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.engine.request_stream import QueueFullError
from pagedlm.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 99, 7]


def _engine(model_dir: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineArgs(model=model_dir, skip_tokenizer_init=True,
                                kv_cache_memory=8 << 20, max_model_len=256, **kwargs))


async def _wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_stream_matches_offline_and_abort_frees_blocks(tiny_llama_dir):
    from pagedlm import LLM

    greedy = SamplingParams(temperature=0, max_tokens=12, detokenize=False, n=2)
    expected = LLM(tiny_llama_dir, skip_tokenizer_init=True, kv_cache_memory=8 << 20,
                   max_model_len=256).generate({"prompt_token_ids": PROMPT}, greedy,
                                               use_tqdm=False)[0]

    async def main() -> None:
        offline = _engine(tiny_llama_dir)
        core = offline.core  # run by the engine's thread: read its blocks directly
        engine = AsyncLLMEngine(offline)
        engine.start()
        try:
            stream = engine.open_stream()
            await stream.add("a", None, PROMPT, greedy)
            tokens: dict[int, list[int]] = {0: [], 1: []}
            async for output in stream:
                for c in output.outputs:
                    tokens[c.index] += c.token_ids
            assert output.finished
            assert [tokens[0], tokens[1]] == [c.token_ids for c in expected.outputs]

            manager = core.kv_cache_manager
            total = manager.num_blocks
            assert manager.num_free_blocks == total
            long = SamplingParams(max_tokens=200, ignore_eos=True, detokenize=False)
            stream = engine.open_stream()
            await stream.add("b", None, PROMPT, long)
            await stream.__anext__()  # a token came: the request holds blocks now
            assert manager.num_free_blocks < total
            stream.close()  # the abort reaches the core's thread, which frees them
            await _wait_until(lambda: manager.num_free_blocks == total
                              and not core.scheduler.has_unfinished_requests())

            with pytest.raises(ValueError, match="maximum context length"):
                await engine.open_stream().add("c", None, [1] * 300, long)
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_waiting_queue_is_bounded(tiny_llama_dir):
    async def main() -> None:
        engine = AsyncLLMEngine(_engine(tiny_llama_dir, max_num_seqs=1),
                                max_num_queued_requests=1)
        engine.start()
        long = SamplingParams(max_tokens=200, ignore_eos=True, detokenize=False)
        streams = [engine.open_stream() for _ in range(3)]
        try:
            await streams[0].add("running", None, PROMPT, long)
            await streams[0].__anext__()  # scheduled: it holds the only running slot
            await streams[1].add("waiting", None, PROMPT, long)
            with pytest.raises(QueueFullError):
                await streams[2].add("rejected", None, PROMPT, long)
        finally:
            for s in streams:
                s.close()
            engine.shutdown()

    asyncio.run(main())


def test_a_group_is_queued_whole_or_not_at_all(tiny_llama_dir):
    """The queue bound counts sequences (n samples each) and an API call's prompts are
    queued together: if they do not all fit, none is queued."""
    async def main() -> None:
        engine = AsyncLLMEngine(_engine(tiny_llama_dir, max_num_seqs=1),
                                max_num_queued_requests=4)
        engine.start()
        long = SamplingParams(max_tokens=200, ignore_eos=True, detokenize=False)
        pair = SamplingParams(max_tokens=200, ignore_eos=True, detokenize=False, n=2)
        streams = [engine.open_stream() for _ in range(4)]
        try:
            await streams[0].add("running", None, PROMPT, long)
            await streams[0].__anext__()  # scheduled: it holds the only running slot
            await streams[1].add("waiting", None, PROMPT, pair)  # 2 sequences wait
            # 2 + 2 x 2 > 4: neither prompt is queued.
            with pytest.raises(QueueFullError, match="2 sequences are waiting"):
                await streams[2].add_many([("g-0", None, PROMPT), ("g-1", None, PROMPT)],
                                          pair)
            await _wait_until(lambda: engine.stats.num_requests_waiting == 1)
            assert not streams[2]._unfinished
            # 2 + 2 fits: both are queued.
            await streams[3].add_many([("h-0", None, PROMPT), ("h-1", None, PROMPT[::-1])],
                                      long)
            assert streams[3].index_of == {"h-0": 0, "h-1": 1}
            # One invalid prompt: the other is not queued either.
            with pytest.raises(ValueError, match="maximum context length"):
                await engine.open_stream().add_many(
                    [("ok", None, PROMPT), ("too-long", None, [1] * 300)], long)
            assert not engine.frontend.output_processor.has_request("ok")
        finally:
            for s in streams:
                s.close()
            await _wait_until(lambda: engine.stats.num_requests_waiting == 0
                              and engine.stats.num_requests_running == 0)
            assert engine.stats.num_blocks_free == engine.stats.num_blocks_total
            engine.shutdown()

    asyncio.run(main())


def test_core_process_matches_offline_and_frees_blocks(tiny_llama_dir):
    """The same through the engine core in its own process: token for token the offline
    engine's outputs (n=2 and a stop token id), and an abort frees every block."""
    from pagedlm import LLM

    args = dict(skip_tokenizer_init=True, kv_cache_memory=8 << 20, max_model_len=256)
    params = [SamplingParams(temperature=0, max_tokens=12, detokenize=False, n=2),
              SamplingParams(temperature=1.0, seed=7, max_tokens=10, detokenize=False,
                             logprobs=2)]
    offline = LLM(tiny_llama_dir, **args).generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[::-1]}], params,
        use_tqdm=False)

    async def main() -> None:
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=tiny_llama_dir, **args))
        engine.start()
        pid = engine.client.pid
        try:
            assert engine.is_healthy and pid is not None
            for i, (prompt, p) in enumerate(zip([PROMPT, PROMPT[::-1]], params)):
                stream = engine.open_stream()
                await stream.add(f"r{i}", None, prompt, p)
                tokens: dict[int, list[int]] = {}
                logprobs: dict[int, list] = {}
                async for output in stream:
                    for c in output.outputs:
                        tokens.setdefault(c.index, []).extend(c.token_ids)
                        logprobs.setdefault(c.index, []).extend(c.logprobs or [])
                assert output.finished
                assert [tokens[c.index] for c in offline[i].outputs] == \
                    [c.token_ids for c in offline[i].outputs]
                if p.logprobs:
                    assert logprobs[0] == offline[i].outputs[0].logprobs

            total = engine.stats.num_blocks_total
            stream = engine.open_stream()
            await stream.add("long", None, PROMPT,
                             SamplingParams(max_tokens=200, ignore_eos=True, detokenize=False))
            await stream.__anext__()
            stream.close()
            await _wait_until(lambda: engine.stats.num_blocks_free == total
                              and engine.stats.num_requests_running == 0)
            with pytest.raises(ValueError, match="maximum context length"):
                await engine.open_stream().add("c", None, [1] * 300, SamplingParams(max_tokens=4))
        finally:
            engine.shutdown()
        assert not engine.client.is_alive()

    asyncio.run(main())


def test_core_process_start_up_errors_are_value_errors(tiny_llama_dir):
    with pytest.raises(ValueError, match="larger than the model's context"):
        AsyncLLMEngine.from_engine_args(EngineArgs(model=tiny_llama_dir, skip_tokenizer_init=True,
                                                   max_model_len=1 << 20))

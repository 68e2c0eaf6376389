"""AsyncLLMEngine without HTTP: streams match the offline engine, aborts free blocks,
the waiting queue is bounded, bad input is a ValueError at `add`."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedlm.config import EngineArgs
from pagedlm.engine.async_engine import AsyncLLMEngine, QueueFullError
from pagedlm.engine.llm_engine import LLMEngine
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
        engine = AsyncLLMEngine(_engine(tiny_llama_dir))
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

            total = engine.stats.num_blocks_total
            long = SamplingParams(max_tokens=200, ignore_eos=True, detokenize=False)
            stream = engine.open_stream()
            await stream.add("b", None, PROMPT, long)
            await stream.__anext__()
            await _wait_until(lambda: engine.stats.num_blocks_free < total)
            stream.close()
            await _wait_until(lambda: engine.stats.num_blocks_free == total)
            assert engine.stats.num_requests_running == 0

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

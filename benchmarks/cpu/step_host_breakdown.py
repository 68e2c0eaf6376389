"""Where an engine step's time goes on the ShareGPT throughput run: each stage's total
over the timed run, in ms and per step.

    python benchmarks/cpu/step_host_breakdown.py [--num-prompts 64]

Same workload as step_host_time.py (`pagedlm bench throughput`'s 64 ShareGPT requests,
seed 0, EOS ignored, q8 weights, a float16 KV cache, 2 threads). Each stage is timed by
a wrapper around its function (about a microsecond each), so the stages nest: the engine
step holds the core step, which holds the scheduler and the model executor, which holds
the runner's own stages. The host time of step_host_time.py is the step minus the
forward, the LM head and the sampler.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    args = p.parse_args()

    from pagedlm import LLM
    from pagedlm.benchmarks.datasets import sample_sharegpt
    from pagedlm.benchmarks.throughput import run_pagedlm
    from pagedlm.sample.sampler import Sampler

    llm = LLM(num_threads=2, weight_dtype="q8", kv_cache_dtype="float16")
    requests = sample_sharegpt(llm.get_tokenizer(), args.num_prompts, seed=0)
    engine = llm.llm_engine
    core = engine.core
    runner = core.model_executor.driver_worker.model_runner
    total: dict[str, float] = {}
    steps = [0]

    def timed(obj, name: str, tag: str) -> None:
        fn = getattr(obj, name)
        total[tag] = 0.0  # printed in this order

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                total[tag] += time.perf_counter() - t0
        setattr(obj, name, wrapper)

    timed(engine, "step", "engine step")
    timed(engine.frontend, "process", "  frontend: outputs, detokenizing")
    timed(core, "step", "  core step")
    timed(core.scheduler, "schedule", "    scheduler: schedule")
    timed(core.scheduler, "update_from_output", "    scheduler: update_from_output")
    timed(core.model_executor, "execute_model", "    model executor")
    timed(runner.input_batch, "update", "      persistent batch update")
    timed(runner, "prepare_inputs", "      prepare_inputs")
    timed(runner, "_forward", "      forward")
    timed(runner.model, "compute_logits", "      LM head")
    timed(runner.input_batch, "sampling_batch", "      sampling_batch")
    timed(Sampler, "__call__", "      sampler")
    step = engine.step

    def counted():
        steps[0] += 1
        return step()
    engine.step = counted
    generate = llm.generate

    def generate_afresh(*a, **k):  # keep only the timed (last) call
        for tag in total:
            total[tag] = 0.0
        steps[0] = 0
        return generate(*a, **k)
    llm.generate = generate_afresh
    result = run_pagedlm(llm, requests, use_tqdm=False)
    n = max(1, steps[0])
    print(f"{steps[0]} steps, {result['output_tokens_per_s']:.1f} output tok/s")
    for tag, seconds in total.items():
        print(f"{tag:40s} {1e3 * seconds:9.1f} ms  {1e3 * seconds / n:7.3f} ms/step")


if __name__ == "__main__":
    main()

"""Where a batch-1 decode step's time goes on a CUDA GPU (Llama-3-8B architecture, dummy weights).

    python benchmarks/gpu/profile_decode.py --out-dir DIR [--eager] [--tokens 64] [--batch 1]

Writes DIR/profile_decode_{graphs,eager}.txt: wall time per token, the GPU's busy time
per token (the sum of kernel times), the top CUDA kernels and CPU operators from
torch.profiler, and the top Python functions by cumulative time from cProfile, over the
same generate call. The gap between wall time and GPU busy time is host overhead: that is
what a graph-replayed step should have almost none of.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_all  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedlm import LLM, SamplingParams

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = run_all.write_model_dir(Path(tmp) / "llama3-8b", run_all.LLAMA3_8B)
        cuda = run_all.DEVICE == "cuda"
        llm = LLM(skip_tokenizer_init=True, max_num_seqs=max(8, args.batch),
                  **run_all._llm_kwargs(model_dir, args.eager))
    prompts = [{"prompt_token_ids": list(range(1 + i, 33 + i))} for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def gen() -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen()  # warm-up: captures, compiles
    gen()  # again: from here the prompt is a prefix-cache hit, a prefill of another shape
    wall = gen()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        gen()
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events
                    if e.device_type is not None and "CUDA" in str(e.device_type))
    prof_py = cProfile.Profile()
    prof_py.enable()
    gen()
    prof_py.disable()
    s = io.StringIO()
    pstats.Stats(prof_py, stream=s).sort_stats("cumulative").print_stats(40)
    mode = "eager" if args.eager else "graphs"
    lines = [
        f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, mode {mode}, "
        f"batch {args.batch}, {args.tokens} tokens per request",
        f"wall per step: {wall / args.tokens * 1e3:.2f} ms (prefill included once)",
        f"GPU kernel time per step (profiled run): {kernel_us / args.tokens / 1e3:.2f} ms",
        "", "== top CUDA kernels by self device time ==",
        events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70),
        "", "== top operators by CPU total time ==",
        events.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70),
        "", "== cProfile, cumulative ==", s.getvalue()]
    path = out / f"profile_decode_{mode}.txt"
    text = "\n".join(lines).replace(str(run_all.REPO) + "/", "")
    path.write_text(re.sub(r"/\S*/site-packages/", "site-packages/", text))
    print("\n".join(lines[:3]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

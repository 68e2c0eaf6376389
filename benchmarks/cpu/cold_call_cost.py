"""What one small numpy or torch call costs right after a forward pass has streamed the
model's weights through the caches, against the same call warm: why the host work of an
engine step is counted in calls, not in arithmetic (README, How it works).

    python benchmarks/cpu/cold_call_cost.py [--mb 64] [--repeats 300]

Before each timed call, a pass over --mb megabytes (float32 adds, as a forward's weight
reads do) evicts what the call needs; the call is then timed once cold and, right after,
once warm. Printed: the median of each, in microseconds, per call kind. The arrays are
the size of a step's per-request columns (64 rows).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=64, help="megabytes streamed before each call")
    p.add_argument("--repeats", type=int, default=300)
    args = p.parse_args()

    import numpy as np
    import torch

    from pagedlm.csrc import load_extension

    torch.set_num_threads(1)
    junk = torch.ones(args.mb * 1024 * 1024 // 4)
    rows = np.arange(64, dtype=np.int64)
    column = np.arange(256, dtype=np.int64)
    tensor = torch.arange(64)

    @torch.inference_mode()
    def decorated() -> None:
        pass

    calls = {
        "python: empty function call": lambda: None,
        "numpy: gather 64 of 256 (column[rows])": lambda: column[rows],
        "torch.from_numpy (64 int64)": lambda: torch.from_numpy(rows),
        "tensor.numpy()": lambda: tensor.numpy(),
        "tensor.tolist() (64)": lambda: tensor.tolist(),
        "enter + leave torch.inference_mode() (decorator)": decorated,
        "torch.is_inference_mode_enabled()": torch.is_inference_mode_enabled,
    }
    kernels = load_extension("step_inputs_cpu")
    if kernels is not None:  # csrc/step_inputs_cpu.cpp, its arguments as numpy arrays
        arrays = (rows, np.arange(64, dtype=np.int64), np.arange(1, 65, dtype=np.int64),
                  np.zeros((64, 256), dtype=np.int64), np.full(64, 16, dtype=np.int64),
                  np.zeros((64, 16), dtype=np.int64))
        out = np.empty(6 * 64 + 3 + 64 * 16, dtype=np.int64)
        calls["C++ decode_step_inputs, numpy arguments"] = lambda: kernels.decode_step_inputs(
            *arrays, 16, out)
        tensors = [torch.from_numpy(a) for a in arrays]
        t_out = torch.from_numpy(out)
        calls["C++ decode_step_inputs, torch arguments"] = lambda: kernels.decode_step_inputs(
            *tensors, 16, t_out)
    print(f"after a {args.mb} MB pass, median of {args.repeats} (us):")
    print(f"{'call':52s} {'cold':>8s} {'warm':>8s}")
    for name, call in calls.items():
        cold, warm = [], []
        for _ in range(args.repeats):
            junk.add_(1.0)
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            call()
            t2 = time.perf_counter()
            cold.append(t1 - t0)
            warm.append(t2 - t1)
        print(f"{name:52s} {1e6 * statistics.median(cold):8.1f} "
              f"{1e6 * statistics.median(warm):8.1f}")


if __name__ == "__main__":
    main()

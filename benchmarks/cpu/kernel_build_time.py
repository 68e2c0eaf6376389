"""A cold build of every CPU kernel: an empty kernel folder (PAGEDLM_KERNEL_DIR, and
TORCH_EXTENSIONS_DIR for revisions built by torch's builder, before 4909ad2), then
prepare_cpu_kernels() as an engine's start calls it. Prints the wall time (run it under
`/usr/bin/time` for the CPU time). To compare two revisions, run it from each checkout:

    PYTHONPATH=. python benchmarks/cpu/kernel_build_time.py
"""

import os
import tempfile
import time

os.environ["TORCH_EXTENSIONS_DIR"] = os.environ["PAGEDLM_KERNEL_DIR"] = tempfile.mkdtemp(
    prefix="pagedlm-kernels-")

from pagedlm import csrc  # noqa: E402

start = time.perf_counter()
csrc.prepare_cpu_kernels()
built = {stem: csrc.load_extension(stem) is not None for stem in csrc.kernel_stems()}
print(f"{csrc.CSRC_DIR}: cold build of {len(built)} kernel libraries in "
      f"{time.perf_counter() - start:.1f} s; loaded: {built}")

"""Run a CPU kernel's tests against a build for another instruction set than this machine's.

The kernels are compiled with -march=native, so the test suite only ever exercises the code
paths of the machine it runs on (AVX-512 VNNI tiles on one, AVX2 tiles on another). This
builds the kernel again with the given -march (x86-64-v3: AVX2; x86-64-v4: AVX-512 without
VNNI; x86-64: no AVX, the portable loops) and runs that kernel's test file against it.

    python tests/isa_builds.py x86-64-v3 [q8 decode prefill]

Not collected by pytest (it compiles one library per kernel and -march, a minute each).
"""

import importlib
import sys

import pytest

from pagedlm.csrc import CFLAGS, library_sources, load_variant

# kernel -> (source stem, module whose loader to replace, loader name, test file, -k filter)
# (all three live in the decoder's library: csrc/__init__.py BUNDLED)
KERNELS = {
    "q8": ("llama_decode_cpu", "pagedlm.layers.q8_weights", "q8_kernels", "tests/test_q8_gemm.py",
           "not engine"),
    "decode": ("llama_decode_cpu", "pagedlm.attention.cpu_kernels", "load_cpu_kernels",
               "tests/test_cpu_attention.py", ""),
    "prefill": ("llama_decode_cpu", "pagedlm.attention.cpu_kernels", "load_prefill_kernels",
                "tests/test_cpu_prefill_attention.py", ""),
}


def main() -> int:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    march, names = sys.argv[1], sys.argv[2:] or list(KERNELS)
    failed = 0
    for name in names:
        stem, module_name, loader, test_file, select = KERNELS[name]
        flags = [f"-march={march}" if f.startswith("-march") else f for f in CFLAGS]
        module = load_variant(f"isa_{stem}_{march.replace('-', '_')}", library_sources(stem),
                              flags)
        # The test files import the loaders' callers, which look the loader up at call time.
        setattr(importlib.import_module(module_name), loader, lambda module=module: module)
        print(f"== {name}: {stem}.cpp built with -march={march}", flush=True)
        args = ["-q", "-p", "no:cacheprovider", test_file] + (["-k", select] if select else [])
        failed |= pytest.main(args)
    return failed


if __name__ == "__main__":
    sys.exit(main())

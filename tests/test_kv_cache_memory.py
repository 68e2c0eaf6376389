"""The CPU KV cache's memory: zeroed, shaped and typed as asked, in 2 MB pages where the
kernel grants them (worker/kv_cache.py)."""

import mmap

import pytest
import torch

from pagedlm.worker.kv_cache import allocate_kv_cache


def _anon_huge_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("huge_pages", [True, False])
def test_cache_is_zeroed_writable_and_shaped(dtype, huge_pages):
    caches = allocate_kv_cache(3, 40, 16, 2, 8, dtype, torch.device("cpu"), huge_pages=huge_pages)
    assert len(caches) == 3
    for k, v in caches:
        for t in (k, v):
            assert t.shape == (40, 16, 2, 8) and t.dtype == dtype and t.is_contiguous()
            assert not t.float().any()
    # Every tensor its own memory: a write shows in that tensor only.
    caches[0][0][5, 3] = 1.0
    assert caches[0][0].float().sum() == 2 * 8
    assert not caches[0][1].float().any() and not caches[1][0].float().any()


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or _thp_mode() == "never",
                    reason="no transparent huge pages here")
def test_cache_memory_is_in_huge_pages_and_released():
    """With THP in "madvise" mode (most distributions) only advised memory gets 2 MB pages:
    torch.zeros' memory would get none."""
    # A control: memory advised by hand. Where even it gets no huge page now (the kernel out
    # of free 2 MB runs), there is nothing to check.
    control = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    control.madvise(mmap.MADV_HUGEPAGE)
    before = _anon_huge_kb()
    control.write(b"\1" * (8 << 20))
    granted = _anon_huge_kb() - before
    control.close()
    if granted <= 0:
        pytest.skip("the kernel grants no huge page to advised memory right now")
    before = _anon_huge_kb()
    caches = allocate_kv_cache(2, 2048, 16, 4, 64, torch.float16, torch.device("cpu"))  # 4 x 8 MB
    held = _anon_huge_kb() - before
    assert held >= 2048, f"the cache got {held} kB of huge pages"
    del caches
    assert _anon_huge_kb() <= before + held // 4

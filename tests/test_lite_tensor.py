"""lite_tensor.h and lite_bind.h, the torch-free layer under the CPU kernels, against torch:
the scalar dtype conversions bit for bit, view's strides, parallel_for's split and errors
over torch's OpenMP threads, and the bindings' conversions (tests/csrc/lite_check.cpp)."""

import gc
import weakref
from pathlib import Path

import pytest
import torch

from pagedlm.csrc import CFLAGS, load_variant

HERE = Path(__file__).resolve().parent


def build(march: str):
    flags = [f"-march={march}" if f.startswith("-march") else f for f in CFLAGS]
    return load_variant(f"pagedlm_lite_check_{march.replace('-', '_')}",
                        [HERE / "csrc" / "lite_check.cpp"], flags)


# Native: F16C's conversions where the CPU has them; x86-64: the integer arithmetic that
# stands in for them elsewhere (both must round as torch does).
@pytest.fixture(scope="module", params=["native", "x86-64"])
def lite(request):
    return build(request.param)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bit patterns, except that any nan matches any nan."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    assert torch.equal(nan_a, nan_b)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    keep = ~nan_a
    assert torch.equal(a.view(bits)[keep], b.view(bits)[keep])


def every_pattern(dtype: torch.dtype) -> torch.Tensor:
    if dtype.itemsize == 1:
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


def hard_floats(dtype: torch.dtype) -> torch.Tensor:
    """Every value of `dtype`, the midpoints between neighbours (ties), points just beside
    them, values past its range, specials, and random floats over many magnitudes."""
    values = every_pattern(dtype).float()
    values = values[values.isfinite()].unique()
    mids = (values[1:].double() + values[:-1].double()) / 2
    beside = torch.cat([torch.nextafter(mids.float(), torch.tensor(-1e30)),
                        torch.nextafter(mids.float(), torch.tensor(1e30))])
    g = torch.Generator().manual_seed(0)
    random = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-30, 20, (20000,), generator=g).float())
    big = values.abs().max().item()
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), big * 1.02,
                             big * 1.07, big * 1.2, -big * 1.2, big * 4, 1e-45, -1e-45, 1e30])
    return torch.cat([values, mids.float(), beside, random, specials]).contiguous()


CONVERSIONS = [(0, torch.float16), (1, torch.bfloat16), (2, torch.float8_e4m3fn), (3, torch.float8_e5m2)]


@pytest.mark.parametrize("which,dtype", CONVERSIONS)
def test_narrowing_rounds_as_torch_does(lite, which, dtype):
    x = hard_floats(dtype)
    same_bits(lite.convert(x, which), x.to(dtype))


@pytest.mark.parametrize("dtype", [d for _, d in CONVERSIONS])
def test_widening_is_torchs_for_every_bit_pattern(lite, dtype):
    x = every_pattern(dtype)
    same_bits(lite.widen(x), x.float())


VIEWS = [
    # (shape, narrowed dim, start, length, view shape)
    ((4, 64), 1, 0, 64, (4, 4, 16)),
    ((4, 192), 1, 64, 64, (4, 4, 16)),       # a slice of a fused qkv row, split into heads
    ((4, 192), 1, 128, 64, (4, 64)),
    ((6, 8, 5), 0, 2, 3, (24, 5)),           # narrowing the outer dim keeps it mergeable
    ((6, 8, 5), 2, 0, 5, (6, 40)),
    ((3, 1, 4), 0, 0, 3, (3, 4)),            # a size-1 dimension may have any stride
    ((3, 1, 4), 0, 0, 3, (1, 3, 1, 4, 1)),
    ((0, 7), 1, 0, 7, (7, 0)),
    ((5,), 0, 1, 3, (3, 1)),
]


@pytest.mark.parametrize("shape,dim,start,length,view", VIEWS)
def test_views_have_torchs_strides(lite, shape, dim, start, length, view):
    x = torch.zeros(shape)
    expected = x.narrow(dim, start, length).view(view)
    strides = lite.view_strides(x, dim, start, length, list(view))
    assert strides[:-1] == list(expected.stride())
    assert strides[-1] == expected.storage_offset()


@pytest.mark.parametrize("shape,dim,start,length,view", [
    ((4, 192), 1, 64, 64, (256,)),           # rows of a slice are not one block
    ((6, 8, 5), 2, 0, 4, (6, 32)),
    ((4, 64), 1, 0, 64, (4, 65)),            # another element count
])
def test_views_torch_refuses_are_refused(lite, shape, dim, start, length, view):
    x = torch.zeros(shape)
    with pytest.raises(RuntimeError):
        x.narrow(dim, start, length).view(view)
    with pytest.raises(RuntimeError, match="view"):
        lite.view_strides(x, dim, start, length, list(view))


def test_parallel_for_splits_over_torchs_threads(lite):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        # The kernels share torch's OpenMP runtime: torch's thread count is theirs.
        assert lite.threads() == 2
        assert lite.chunks(0, 10, 1, -1, False) == [(0, 5), (5, 10)]
        assert lite.chunks(3, 10, 4, -1, False) == [(3, 7), (7, 10)]
        assert lite.chunks(0, 10, 10, -1, False) == [(0, 10)]  # within one grain: serial
        assert lite.chunks(0, 10, 1, -1, True) == [(0, 5), (5, 10)]
        with pytest.raises(RuntimeError, match="chunk 5 failed"):
            lite.chunks(0, 10, 1, 7, False)
        torch.set_num_threads(1)
        assert lite.threads() == 1
        assert lite.chunks(0, 10, 1, -1, False) == [(0, 10)]
    finally:
        torch.set_num_threads(before)


def test_bindings_convert_arguments_and_results(lite):
    assert lite.answer == 42
    assert lite.echo(torch.zeros(3, 2), [1, 2, 3], True, 0.5) == 6e6 + 6e3 + 100 + 0.5
    assert lite.echo(None, (), False, 2) == -1e6 + 2
    with pytest.raises(TypeError, match="argument 2: expected a list"):
        lite.echo(None, 5, False, 0.0)
    with pytest.raises(TypeError, match="argument 1: expected a torch.Tensor"):
        lite.widen([1.0])
    with pytest.raises(TypeError, match="takes 4 arguments"):
        lite.echo(None, [])
    with pytest.raises(RuntimeError, match="x must be contiguous float32"):
        lite.convert(torch.zeros(4, 4).t(), 0)
    # A tensor DLPack will not export (it requires grad) is read through its attributes.
    x = torch.randn(5, 3)
    same_bits(lite.convert(x.clone().requires_grad_(True), 0), lite.convert(x, 0))
    assert lite.view_strides(x.clone().requires_grad_(True), 0, 1, 2, [6]) == [1, 3]
    out = lite.convert(torch.ones(2, 3), 1)  # a tensor the kernel allocated, returned as is
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == (2, 3)


def test_bound_classes_keep_the_tensors_they_hold(lite):
    into = torch.zeros(1)
    acc = lite.Accumulator(into)
    acc.add(2.5)
    assert into.item() == 2.5
    held = weakref.ref(into)
    del into
    gc.collect()
    assert held() is not None  # the object's reference keeps the tensor alive
    acc.add(1.0)
    assert acc.state() == [("value", 3.5)]
    del acc
    gc.collect()
    assert held() is None  # and lets it go with the object
    made = lite.Accumulator.make(torch.full((1,), 7.0))
    assert isinstance(made, lite.Accumulator) and made.state() == [("value", 7.0)]
    with pytest.raises(TypeError, match="argument 1: expected a torch.Tensor"):
        lite.Accumulator(object())
    with pytest.raises(RuntimeError, match="into must be one float32"):
        lite.Accumulator(torch.zeros(2))


def test_numpy_arrays_convert_through_the_buffer_protocol(lite):
    """A numpy array is taken as it is (no torch call): its dtype, shape and strides in
    elements, the kernel writing into its memory, and the array itself returned."""
    np = pytest.importorskip("numpy")
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    text, same = lite.describe(a)
    assert text == "int64 [3, 4] [4, 1]" and same is a and a[0, 0] == 1
    view = a[:, 1::2]  # strided: two elements between columns
    assert lite.describe(view)[0] == "int64 [3, 2] [4, 2]" and a[0, 1] == 2
    for dtype, name in ((np.int32, "int32"), (np.float32, "float32"), (np.float16, "float16"),
                        (np.bool_, "bool"), (np.uint8, "uint8"), (np.int8, "int8")):
        assert lite.describe(np.zeros(5, dtype=dtype))[0] == f"{name} [5] [1]"
    f = np.zeros(2, dtype=np.float32)
    lite.describe(f)
    assert f.tolist() == [1.0, 0.0]
    frozen = np.zeros(3, dtype=np.int64)
    frozen.flags.writeable = False
    with pytest.raises(TypeError, match="argument 1: a numpy.ndarray that is not a writable"):
        lite.describe(frozen)
    with pytest.raises(TypeError, match="argument 1: an array of format 'Zf'"):
        lite.describe(np.zeros(2, dtype=np.complex64))
    with pytest.raises(TypeError, match="argument 1: an array of format '>q'"):
        lite.describe(np.zeros(2, dtype=">i8"))
    held = weakref.ref(a.base if a.base is not None else a)
    out = lite.describe(a)[1]
    del a, same, view, out
    gc.collect()
    assert held() is None  # the conversion's buffer is released with the view

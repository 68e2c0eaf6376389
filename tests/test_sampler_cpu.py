"""The fused C++ exponential race (pagedlm/csrc/sampler_cpu.cpp) against the torch reference.

Three layers: the kernel's u equals `random_uniform` bit for bit; its noise is within 5.4e-7
of float64 for every one of the 2^23 hash values; and its pick is exactly the argmax of
x + (its own noise), whatever the batch, chunking or threads. The picks then equal the torch
reference's except at near-ties (two best race values within float rounding).
"""

import math

import pytest
import torch

from pagedlm.sample.cpu_sampling import load_sampler_kernels
from pagedlm.sample.noise import exponential_race, random_bits, random_uniform
from pagedlm.sample.sampler import Sampler
from pagedlm.sample.sampling_batch import SamplingRequestState, make_sampling_batch
from pagedlm.sampling_params import SamplingParams

kernels = load_sampler_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the CPU sampling kernel could not be built")

NEG_INF = float("-inf")
NAN = float("nan")
NEAR_TIE = 2e-5  # race values this close may order differently in the kernel and in torch
SEEDS = [0, 1, 2**63 - 1, 0x9E3779B97F4A7C15 % 2**63, 123456789, 2**32, 77]
STEPS = [0, 1, 7, 2**40, 3, 0, 2**62]


def rows(num_rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 2**62, (num_rows,), generator=g)  # [num_rows]
    steps = torch.randint(0, 4096, (num_rows,), generator=g)  # [num_rows]
    return seeds, steps


def kernel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = random_bits(seeds, steps, vocab).to(torch.int32)  # [num_rows, vocab]
    return kernels.noise_from_bits(bits)


def race(x, seeds, steps, temperature=None) -> torch.Tensor:
    return kernels.exponential_race(x.contiguous(), seeds, steps, temperature)


def reference_race64(x: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    u = random_uniform(seeds, steps, x.shape[-1]).double()  # [num_rows, vocab]
    return x.double() - torch.log(-torch.log(u))


def masked_logits(num_rows: int, vocab: int, mask: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = 3.0 * torch.randn(num_rows, vocab, generator=g)  # [num_rows, vocab]
    if mask == "top_k":  # keep the 20 largest of each row, like top-k
        kth = x.topk(min(20, vocab), dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, NEG_INF)
    elif mask == "half":
        x = x.masked_fill(torch.rand(num_rows, vocab, generator=g) < 0.5, NEG_INF)
    elif mask == "peaked":  # a few tokens far above the rest, as from a language model
        top = torch.randint(0, vocab, (num_rows, 4), generator=g)
        x.scatter_(1, top, 12.0 + 6.0 * torch.rand(num_rows, 4, generator=g))
    return x


# --- the noise -----------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 31, 32, 33, 1000, 49152 + 5])
def test_uniform_is_bit_exact(vocab: int) -> None:
    seeds, steps = torch.tensor(SEEDS), torch.tensor(STEPS)
    assert torch.equal(kernels.uniform(seeds, steps, vocab), random_uniform(seeds, steps, vocab))
    s, t = rows(3, seed=vocab)
    assert torch.equal(kernels.uniform(s, t, vocab), random_uniform(s, t, vocab))


def test_noise_error_and_bounds_over_every_hash_value() -> None:
    bits = torch.arange(1 << 23, dtype=torch.int32)
    noise = kernels.noise_from_bits(bits)  # [2^23]
    exact = -torch.log(-torch.log((bits.double() + 0.5) / (1 << 23)))
    err = (noise.double() - exact).abs().max().item()
    torch_err = (-torch.log(-torch.log((bits.float() + 0.5) / (1 << 23))) - exact).abs().max().item()
    print(f"noise max abs error: kernel {err:.3g}, torch float32 {torch_err:.3g}")
    assert err < 6e-7
    # Prefilter 1 relies on kNoiseMin <= noise <= kNoiseMax.
    assert noise.min().item() >= -2.82 and noise.max().item() <= 16.64
    # Prefilter 2 relies on noise <= (150 - biased exponent of (c + 1/2)) ln2 + 1e-3,
    # c = 2^23 - 1 - b (noise_bound8; its fma rounds differently, by far less than 1e-3).
    c = bits ^ 0x7FFFFF
    biased = ((c.float() + 0.5).view(torch.int32) >> 23).float()
    ln2 = math.log(2.0)
    bound = biased * -ln2 + (150 * ln2 + 1e-3)
    assert (bound >= noise).all()
    assert (bound.double() - exact)[exact > 2].max().item() < 0.77  # tight where it matters


# --- the race --------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_rows,vocab,mask",
    [(1, 49152, "none"), (64, 49152, "peaked"), (64, 4099, "top_k"), (5, 1000, "half"),
     (3, 37, "none"), (2, 1, "none")],
)
def test_pick_is_the_exact_argmax_of_the_kernels_values(num_rows, vocab, mask) -> None:
    x = masked_logits(num_rows, vocab, mask, seed=vocab + num_rows)
    seeds, steps = rows(num_rows, seed=num_rows)
    noise = kernel_noise(seeds, steps, vocab)  # [num_rows, vocab]
    assert torch.equal(race(x, seeds, steps), (x + noise).argmax(-1))
    t = 0.25 + 2.0 * torch.rand(num_rows, generator=torch.Generator().manual_seed(1))
    t[0] = 1.0
    assert torch.equal(race(x, seeds, steps, t), (x / t[:, None] + noise).argmax(-1))


@pytest.mark.parametrize(
    "num_rows,vocab,mask",
    [(1, 49152, "none"), (64, 49152, "none"), (64, 49152, "peaked"), (64, 4099, "top_k"),
     (17, 1000, "half"), (200, 33, "none")],
)
def test_pick_matches_torch_reference_up_to_near_ties(num_rows, vocab, mask) -> None:
    x = masked_logits(num_rows, vocab, mask, seed=7 * vocab + num_rows)
    seeds, steps = rows(num_rows, seed=num_rows + 1)
    pick = race(x, seeds, steps)
    ref_pick = exponential_race(x, seeds, steps)
    exact = reference_race64(x, seeds, steps)  # [num_rows, vocab]
    top2 = exact.topk(min(2, vocab), dim=-1).values
    near_tie = (top2[:, 0] - top2[:, -1] < NEAR_TIE) if vocab > 1 else torch.zeros(num_rows, dtype=torch.bool)
    assert near_tie.sum().item() <= max(1, num_rows // 100)
    assert torch.equal(pick[~near_tie], ref_pick[~near_tie])
    chosen = exact.gather(1, pick[:, None])[:, 0]
    assert (chosen >= top2[:, 0] - NEAR_TIE).all()


def test_special_values_as_torch_argmax() -> None:
    vocab = 49152 + 7  # several chunks for one row, a partial last block
    x = torch.randn(7, vocab)
    x[0] = NEG_INF  # fully masked: index 0, as torch.argmax of an all -inf race
    x[1] = NEG_INF
    x[1, vocab - 1] = -50.0  # the only candidate, in the last chunk
    x[2, [900, 30000]] = NAN  # NaN wins, the first one
    x[3, [5, 40000]] = float("inf")  # +inf beats every finite value, the first one
    x[4, 6] = float("inf")
    x[4, 9000] = NAN  # NaN beats +inf
    x[5, :] = NEG_INF
    x[5, [3, 4]] = 1e30  # the noise vanishes in rounding: a tie, the lower index wins
    x[6] = 0.0  # flat: the pick is the noise's argmax
    seeds, steps = rows(7)
    expected = [0, vocab - 1, 900, 5, 9000, 3, None]
    pick = race(x, seeds, steps).tolist()
    ref = exponential_race(x, seeds, steps).tolist()
    for got, want, r in zip(pick, expected, ref, strict=True):
        assert got == r and (want is None or got == want)


def test_batch_and_thread_invariance() -> None:
    x = masked_logits(64, 49152, "none", seed=3)
    x[10:20] = masked_logits(10, 49152, "top_k", seed=4)
    seeds, steps = rows(64, seed=5)
    threads = torch.get_num_threads()
    try:
        picks = []
        for n in (1, 2):
            torch.set_num_threads(n)
            picks.append(race(x, seeds, steps))
            # Alone, in another batch, in reverse order: the same pick for each row.
            alone = torch.cat([race(x[r : r + 1], seeds[r : r + 1], steps[r : r + 1]) for r in (0, 15, 63)])
            assert torch.equal(alone, picks[-1][[0, 15, 63]])
            rev = race(x.flip(0), seeds.flip(0), steps.flip(0)).flip(0)
            assert torch.equal(rev, picks[-1])
            other = race(torch.cat([x[:3], torch.randn(5, 49152)]), torch.cat([seeds[:3], seeds[:5]]),
                         torch.cat([steps[:3], steps[:5] + 1]))
            assert torch.equal(other[:3], picks[-1][:3])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(picks[0], picks[1])


def test_input_errors() -> None:
    seeds, steps = rows(2)
    x = torch.randn(2, 100)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernels.exponential_race(x.double(), seeds, steps, None)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernels.exponential_race(torch.randn(100, 2).t(), seeds, steps, None)
    with pytest.raises(RuntimeError, match="one seed and step per row"):
        kernels.exponential_race(x, seeds[:1], steps[:1], None)
    with pytest.raises(RuntimeError, match="temperature must be positive"):
        kernels.exponential_race(x, seeds, steps, torch.tensor([1.0, 0.0]))
    with pytest.raises(RuntimeError, match="int64"):
        kernels.exponential_race(x, seeds.int(), steps, None)
    assert kernels.exponential_race(torch.empty(0, 5), seeds[:0], steps[:0], None).shape == (0,)


# --- the Sampler -----------------------------------------------------------------


def test_sampler_matches_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both paths on the same few hundred rows: mixed greedy and random rows, temperatures,
    top-k / top-p / min-p (masks stay in torch, the kernel races), penalties; then an
    all-random batch without masks, where the kernel also divides by the temperature."""
    g = torch.Generator().manual_seed(11)
    vocab = 2048
    choices = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.5, top_k=50),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.8, min_p=0.05),
        SamplingParams(temperature=1.2, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.0),
    ]
    mixed = [choices[r % len(choices)] for r in range(300)]
    plain = [choices[r % 2] for r in range(200)]
    # The torch path's race inputs, to tell a near-tie from a real mismatch.
    captured = []

    def capturing_race(x, seeds, steps):
        captured.append((x, seeds, steps))
        return exponential_race(x, seeds, steps)

    monkeypatch.setattr("pagedlm.sample.sampler.exponential_race", capturing_race)
    for params in (mixed, plain):
        states = [
            SamplingRequestState(p, seed=1000 + r, prompt_token_ids=[r % vocab, 5],
                                 output_token_ids=list(range(r % 7)), eos_token_ids=[0])
            for r, p in enumerate(params)
        ]
        logits = 3.0 * torch.randn(len(states), vocab, generator=g)  # [num_rows, vocab]
        batch = make_sampling_batch(states, vocab, torch.device("cpu"))
        fused = Sampler()(logits, batch).sampled_token_ids
        captured.clear()
        reference = Sampler(use_cpu_kernels=False)(logits, batch).sampled_token_ids
        (x, seeds, steps), = captured
        random_rows = batch.random_rows if batch.random_rows is not None else torch.arange(len(states))
        exact = reference_race64(x, seeds, steps)  # [num_random, vocab]
        top2 = exact.topk(2, dim=-1).values
        near_tie = torch.zeros(len(states), dtype=torch.bool)
        near_tie[random_rows] = top2[:, 0] - top2[:, 1] < NEAR_TIE
        assert near_tie.sum().item() <= 2
        assert torch.equal(fused[~near_tie], reference[~near_tie])

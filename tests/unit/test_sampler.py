"""Sampling: the filters against a direct numpy computation of the filtered distribution, chi-square and grid tests
that draws follow it on both routes (native and torch), seeds, and parameter validation. That both routes draw the
very same token, and that it is the definition's, is tests/unit/test_draw_routes.py."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats

from nextoken.engine.sampler import Sampler, SamplingRow, argmax
from nextoken.errors import InvalidSamplingParams
from nextoken.ops import native, sampling
from nextoken.sampling_params import SamplingParams
from tests.conftest import needs_native

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def reference_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                           min_p: float) -> np.ndarray:
    """The filtered distribution computed directly: temperature, top-k, top-p, min-p in that order."""
    z = logits / temperature
    keep = np.ones_like(z, dtype=bool)
    if top_k:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    p = np.where(keep, np.exp(z - z.max()), 0)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    cum = 0.0
    for idx in order:
        if cum >= top_p:
            keep[idx] = False
        cum += p[idx]
    p = np.where(keep, p, 0)
    p /= p.sum()
    keep &= p >= min_p * p.max()
    p = np.where(keep, p, 0)
    return p / p.sum()


def kept_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The distribution the draw takes from one row [vocab]: its kept weights, normalized."""
    weights = sampling.kept_weights(logits[None], [temperature], [top_k], [top_p], [min_p])[0]
    return (weights / weights.sum()).numpy()


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 5, 0.9, 0.0),
    (1.0, 0, 1.0, 0.2), (2.0, 6, 0.95, 0.05),
])
def test_filter_matches_reference(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    got = kept_distribution(LOGITS, temperature, top_k, top_p, min_p)
    want = reference_distribution(LOGITS.numpy().astype(np.float64), temperature, top_k, top_p, min_p)
    assert ((got > 0) == (want > 0)).all()
    np.testing.assert_allclose(got, want, atol=1e-9)


def test_whole_row_filters_on_peaked_and_flat_rows() -> None:
    """Peaked and flat rows of 3,000 tokens, with and without top-k, and a row without top-p (every token kept): each
    row's kept distribution is the reference's."""
    gen = torch.Generator().manual_seed(3)
    vocab = 3000
    peaked = torch.randn(vocab, generator=gen) * 4  # its 64 largest hold far more than 0.9
    flat = torch.randn(vocab, generator=gen) * 0.1  # its 64 largest hold about 2%
    rows = [(peaked, 1.0, 0, 0.9), (flat, 1.0, 0, 0.9), (peaked, 0.7, 20, 0.5), (flat, 1.3, 500, 0.95),
            (flat, 1.0, 0, 0.01), (peaked, 1.0, 0, 0.999), (flat, 1.0, 0, 1.0)]
    for i, (row, temperature, top_k, top_p) in enumerate(rows):
        got = kept_distribution(row, temperature, top_k, top_p, 0.0)
        want = reference_distribution(row.numpy().astype(np.float64), temperature, top_k, top_p, 0.0)
        assert ((got > 0) == (want > 0)).all(), f"row {i}: another set of tokens"
        np.testing.assert_allclose(got, want, atol=1e-9)


@pytest.mark.parametrize("native_draws", [True, False])
def test_seeded_rows_draw_the_same_alone_or_batched(monkeypatch: pytest.MonkeyPatch, native_draws: bool) -> None:
    """A seeded request's tokens do not depend on the rows beside it, whether it draws from its candidates, from the
    wider second set, or from its whole row, and whether its batch draws several ways; every draw is a token the
    filters keep."""
    monkeypatch.setattr(sampling, "CANDIDATES", 64)
    monkeypatch.setattr(sampling, "WIDE_CANDIDATES", 256)
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 3000, generator=gen) * torch.tensor([[4.0], [0.1], [2.0], [1.0]])
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=1.0, seed=2),
              SamplingParams(temperature=0, seed=3), SamplingParams(temperature=1.0, top_p=0.2, seed=4)]
    sampler = Sampler(native_draws)

    def draw(which: list[int], seed: int) -> list[int]:
        rows = [SamplingRow(params[i], torch.Generator().manual_seed(seed + i), [], []) for i in which]
        return sampler(logits[which], rows).token_ids

    for seed in range(0, 200, 10):
        batched = draw([0, 1, 2, 3], seed)
        assert batched == [draw([i], seed)[0] for i in range(4)]
        assert batched[2] == int(logits[2].argmax())
        for i in (0, 3):
            p = params[i]
            want = reference_distribution(logits[i].double().numpy(), p.temperature, p.top_k, p.top_p, p.min_p)
            assert want[batched[i]] > 0


@pytest.mark.parametrize("native_draws", [True, False])
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.8, 4, 0.9)])
def test_draws_follow_filtered_distribution(temperature: float, top_k: int, top_p: float, native_draws: bool) -> None:
    """20,000 draws, through the native draw and through torch's; chi-square goodness of fit against the filtered
    distribution (p > 0.001)."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    sampler = Sampler(native_draws)
    gen = torch.Generator().manual_seed(7)
    n = 20_000
    rows = [SamplingRow(params, gen, [], []) for _ in range(n)]
    draws = sampler(LOGITS.expand(n, -1).clone(), rows).token_ids
    counts = np.bincount(draws, minlength=len(LOGITS))
    want = reference_distribution(LOGITS.numpy().astype(np.float64), temperature, top_k, top_p, 0.0)
    assert counts[want == 0].sum() == 0, "a filtered-out token was drawn"
    support = want > 0
    chi2 = stats.chisquare(counts[support], want[support] * n)
    assert chi2.pvalue > 1e-3, chi2


@pytest.mark.parametrize("native_draws", [pytest.param(True, marks=needs_native), False])
def test_draws_across_the_walks_blocks(native_draws: bool) -> None:
    """A distribution spread over a vocabulary of several of the walk's blocks (1,024 weights) and a remainder: draws
    at 2,000 evenly spaced uniforms land on each token as often as its probability, none on a token of probability
    0, and u = 0 or just below 1 lands on the first and last tokens that can occur."""
    vocab = 5000
    gen = torch.Generator().manual_seed(11)
    support = torch.tensor([3, 1023, 1024, 2047, 2500, 4095, 4096, 4999])
    probs = torch.zeros(vocab, dtype=torch.float64)
    probs[support] = torch.rand(len(support), generator=gen, dtype=torch.float64) + 0.2
    probs /= probs.sum()
    row = probs.log().float()
    n = 2000
    uniforms = ((np.arange(n) + 0.5) / n).tolist() + [0.0, 1 - 2**-53]
    logits = row.expand(n + 2, -1)
    per_row = [[1.0] * (n + 2), [0] * (n + 2), [1.0] * (n + 2), [0.0] * (n + 2)]
    draws = native.sample_rows(native.library(), logits, *per_row, uniforms) if native_draws else \
        sampling.sample_rows(logits, *per_row, uniforms)
    counts = np.bincount(draws[:n], minlength=vocab)
    assert counts[probs.numpy() == 0].sum() == 0
    np.testing.assert_allclose(counts / n, probs.numpy(), atol=1.5 / n)
    assert draws[n:] == [3, 4999]


def test_greedy_is_argmax_and_seeds_repeat() -> None:
    sampler = Sampler()
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    greedy = sampler(logits, [SamplingRow(SamplingParams(temperature=0), None, [], [])] * 4).token_ids
    assert greedy == logits.argmax(-1).tolist()
    params = SamplingParams(temperature=1.0, seed=5)

    def draw(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [sampler(logits[:1], [SamplingRow(params, gen, [], [])]).token_ids[0] for _ in range(30)]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


@pytest.mark.parametrize("native_draws", [True, False])
@pytest.mark.parametrize("temperature", [5e-324, 1e-45, 2e-39, 1e-30, 9e-6])
def test_tiny_temperatures_are_greedy(temperature: float, native_draws: bool) -> None:
    """A positive temperature too small for fp32 (its reciprocal overflows from about 3e-39 down; the native
    sampler once answered token 0 for every row) samples greedily on every route, penalties and filters included."""
    sampler = Sampler(native_draws=native_draws)
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(1)) * 4
    for params in (SamplingParams(temperature=temperature, seed=1),
                   SamplingParams(temperature=temperature, top_k=5, top_p=0.9, min_p=0.1, seed=1)):
        assert params.is_greedy
        rows = [SamplingRow(params, torch.Generator().manual_seed(i), [], []) for i in range(3)]
        assert sampler(logits, rows).token_ids == logits.argmax(-1).tolist()
    assert not SamplingParams(temperature=1e-5).is_greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_takes_the_first_best_as_torch_does(dtype: torch.dtype) -> None:
    """Ties go to the first, a NaN wins (as torch's argmax has it), strided rows work, bf16 rows stay in torch."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits[1, [7, 200]] = 10.0  # a tie
    logits[2, 150] = float("nan")
    logits[3, :] = -float("inf")
    for rows in (logits, logits[:, ::3], logits[::2]):
        assert argmax(rows) == rows.argmax(-1).tolist()


def test_repetition_penalty_lowers_seen_tokens() -> None:
    logits = torch.tensor([[3.0, 2.9, -1.0]])
    row = SamplingRow(SamplingParams(temperature=0, repetition_penalty=2.0), None, [0], [])
    assert Sampler()(logits, [row]).token_ids == [1]


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -1), ("top_k", 2.5), ("min_p", 1.5), ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", "8"),
    ("n", 0), ("n", 1000), ("seed", -1), ("logprobs", 100), ("stop", [""]), ("stop", ["x"] * 100),
    ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
])
def test_invalid_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidSamplingParams, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]




def grid_frequencies(lib: Any, row: torch.Tensor, p: tuple[float, int, float, float], n: int) -> np.ndarray:
    """How often each token comes out at n evenly spaced uniforms, through the kernels `lib` (None: the torch route):
    the inverse CDF splits [0, 1) into one interval per token, as long as its probability, so each count is n times
    the probability, within 1."""
    logits = row.expand(n, -1)  # one row read n times (row stride 0)
    uniforms = ((np.arange(n) + 0.5) / n).tolist()
    per_row = [[v] * n for v in p]
    tokens = sampling.sample_rows(logits, *per_row, uniforms) if lib is None else \
        native.sample_rows(lib, logits, *per_row, uniforms)
    return np.bincount(tokens, minlength=row.shape[0]) / n


@pytest.mark.parametrize(("route", "vocab"), [pytest.param("native", 3000, marks=needs_native),
                                              pytest.param("native", 262_144, marks=needs_native),
                                              ("torch", 3000)])
def test_draws_follow_the_filtered_distribution_on_a_grid(route: str, vocab: int) -> None:
    """nt_sample_rows and the torch route against the reference filter on peaked and flat rows, for each filter alone
    and combined (top-p over a top-k, min-p under both, a nucleus past the first candidates): the draws at evenly
    spaced uniforms land on each token as often as its probability, and never on a token the filters drop."""
    lib = native.library() if route == "native" else None
    gen = torch.Generator().manual_seed(13)
    peaked = torch.randn(vocab, generator=gen) * 4
    flat = torch.randn(vocab, generator=gen) * 0.1
    cases = [(peaked, (1.0, 0, 1.0, 0.0)), (flat, (1.3, 0, 1.0, 0.0)), (peaked, (0.7, 40, 1.0, 0.0)),
             (peaked, (0.8, 0, 0.9, 0.0)), (flat, (1.0, 0, 0.9, 0.0)), (peaked, (1.0, 0, 1.0, 0.05)),
             (flat, (1.0, 0, 1.0, 0.9)), (peaked, (1.0, 100, 0.9, 0.0)), (peaked, (1.2, 30, 0.8, 0.1)),
             (peaked, (1.0, 100, 1.0, 0.5)), (flat, (0.05, 0, 0.4, 0.0)), (peaked, (1.0, 5, 0.5, 0.3))]
    if vocab > 10_000:  # the same paths; the flat nucleus (a sort of most of the row) only in the small vocabulary
        cases = [c for c in cases if c[0] is peaked or c[1][3] > 0.5 or c[1][0] < 0.1 or c[1][2] == 1.0]
    n = 1000 if vocab > 10_000 or lib is None else 10_000
    for row, p in cases:
        want = reference_distribution(row.double().numpy(), *p)
        got = grid_frequencies(lib, row, p, n)
        assert got[want == 0].sum() == 0, f"{p}: a token the filters drop"
        np.testing.assert_allclose(got, want, atol=1.5 / n + 1e-6, err_msg=str(p))


@needs_native
def test_native_draw_edges() -> None:
    """u = 0 and u just below 1 land on the first and last tokens that can occur (in vocabulary order, whatever the
    filters), and a row whose mass sits on one token draws it."""
    lib = native.library()
    row = torch.full((5000,), float("-inf"))  # masked tokens: never drawn
    row[[7, 1500, 4999]] = torch.tensor([1.0, 2.0, 0.5])
    both = row.expand(2, -1).contiguous()
    edges = [0.0, 1 - 1e-12]
    assert native.sample_rows(lib, both, [1.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2, edges) == [7, 4999]
    assert native.sample_rows(lib, both, [1.0] * 2, [2] * 2, [1.0] * 2, [0.0] * 2, edges) == [7, 1500]
    assert native.sample_rows(lib, both, [0.01] * 2, [0] * 2, [0.9] * 2, [0.0] * 2, edges) == [1500, 1500]


@needs_native
@pytest.mark.parametrize("top_k", [0, 5])
def test_native_min_p_below_a_hundredth_keeps_what_it_allows(top_k: int) -> None:
    """min-p alone (or with top-k) at 0.001 keeps a token at 0.005 of the best: the candidates the draw gathers
    first (those within 100x of the best) must not stand in for min-p's own set."""
    lib = native.library()
    row = torch.full((3000,), float("-inf"))
    row[[10, 2000]] = torch.tensor([0.0, math.log(0.005)])
    logits = row.expand(2, -1).contiguous()
    want = reference_distribution(row.double().numpy(), 1.0, top_k, 1.0, 0.001)
    assert want[2000] > 0.004
    got = native.sample_rows(lib, logits, [1.0] * 2, [top_k] * 2, [1.0] * 2, [0.001] * 2, [0.0, 1 - 1e-9])
    assert got == [10, 2000]


@needs_native
def test_native_draw_of_a_fully_masked_row_is_its_first_token() -> None:
    """Every logit -inf (a grammar or bias that left nothing): each filter route answers token 0, as torch's
    argmax does, never an index read from memory the draw did not write."""
    lib = native.library()
    logits = torch.full((4, 1000), float("-inf"))
    for p in [(1.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.1), (1.0, 3, 1.0, 0.0), (0.5, 0, 0.9, 0.0)]:
        got = native.sample_rows(lib, logits, [p[0]] * 4, [p[1]] * 4, [p[2]] * 4, [p[3]] * 4, [0.0, 0.3, 0.7, 0.99])
        assert got == [0] * 4, p


def test_rewind_puts_a_seeded_generator_back_where_the_step_began() -> None:
    # After a failed batch draw the engine draws each row again alone: a seeded row must draw what it drew first.
    logits = torch.zeros(1, 4096)  # flat: each uniform lands on a token of its own
    row = SamplingRow(SamplingParams(temperature=1.0, seed=42), torch.Generator().manual_seed(42), [1], [])
    sampler = Sampler()
    for _ in range(3):
        row.output_ids.append(sampler(logits, [row]).token_ids[0])
    fourth = sampler(logits, [row]).token_ids[0]
    Sampler.rewind(row)
    assert sampler(logits, [row]).token_ids[0] == fourth
    assert len({*row.output_ids, fourth}) == 4  # the draws differ: one more draw, not rewound, lands elsewhere
    assert sampler(logits, [row]).token_ids[0] != fourth

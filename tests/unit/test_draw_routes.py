"""The draw is one definition (engine/sampler.py) on every route: a direct, slow implementation of it here, in Python
integers and floats (`reference_draws`), against the torch route (ops/sampling.py, on the CPU) on small rows, and
the torch route against each build of the kernels (AVX-512, emulated where the CPU lacks it; AVX2; plain C) on rows
up to 50,000 tokens: the same token at random uniforms and at the uniforms where the draw changes token, where a
sum or weight one unit off would show. E is held to e^x, and the sampler to the same tokens on either route."""

from __future__ import annotations

import ctypes
import math
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest
import torch

from nextoken.engine.sampler import Sampler, SamplingRow
from nextoken.ops import native, sampling
from nextoken.sampling_params import SamplingParams
from tests.conftest import needs_native
from tests.unit.test_native import AVX2_FLAGS, PORTABLE_FLAGS

Params = tuple[float, int, float, float]  # temperature, top_k, top_p, min_p


def exp_constants() -> tuple[float, float, float, list[float]]:
    """E's constants from their definitions: log2(e), ln 2 to 29 significant bits and the rest, 1/k! for k = 11..2
    (then 1, 1), each the double nearest the exact value."""
    with localcontext() as ctx:
        ctx.prec = 80
        ln2 = Decimal(2).ln()
        hi = Fraction(int((ln2 * 2**29).to_integral_value()), 2**29)
        return (float(1 / ln2), float(hi), float(Fraction(ln2) - hi),
                [float(Fraction(1, math.factorial(k))) for k in range(11, 1, -1)] + [1.0, 1.0])


LOG2E, LN2_HI, LN2_LO, TAYLOR = exp_constants()


def reference_exp(x: float) -> float:
    """E(x): Python floats are IEEE doubles, each operation rounded on its own; round() ties to even."""
    n = round(x * LOG2E)
    r = (x - n * LN2_HI) - n * LN2_LO
    p = TAYLOR[0]
    for c in TAYLOR[1:]:
        p = p * r + c
    return math.ldexp(p, n)


def reference_weights(row: list[float], temperature: float) -> tuple[list[float], list[int], int]:
    """(x, weights in units of 2^-Q, Q) of a row of fp32 values."""
    bits = max(q for q in range(35) if len(row) << q <= 2**53)
    top = max(row)
    inv_t = 1.0 / temperature
    xs = [(v - top) * inv_t for v in row]
    return xs, [math.floor(reference_exp(x) * 2**bits) if x >= -24.0 else 0 for x in xs], bits


def reference_kept(row: list[float], p: Params) -> tuple[list[int], list[int], int]:
    """(kept ids ascending, every token's weight in units, Q) by the definition, step by step."""
    temperature, top_k, top_p, min_p = p
    xs, w, bits = reference_weights(row, temperature)
    order = sorted(range(len(row)), key=lambda i: (-xs[i], i))
    kept = order[:top_k] if 0 < top_k < len(row) else order
    if top_p < 1:
        bound = top_p * float(Fraction(sum(w[i] for i in kept), 2**bits))  # an fp64 product
        before, nucleus = Fraction(0), []
        for j, i in enumerate(kept):
            if j == 0 or before < bound:
                nucleus.append(i)
            before += Fraction(w[i], 2**bits)
        kept = nucleus
    if min_p > 0:
        kept = [i for i in kept if Fraction(w[i], 2**bits) >= min_p]
    return sorted(i for i in kept if w[i] > 0), w, bits


def reference_draws(row: list[float], p: Params, uniforms: list[float]) -> list[int]:
    """The token the definition draws at each uniform."""
    if any(math.isnan(v) for v in row) or not math.isfinite(max(row)):
        nan = [i for i, v in enumerate(row) if math.isnan(v)]
        return [nan[0] if nan else row.index(max(row))] * len(uniforms)
    kept, w, bits = reference_kept(row, p)
    total = float(Fraction(sum(w[i] for i in kept), 2**bits))
    out = []
    for u in uniforms:
        target = u * total  # an fp64 product
        running = Fraction(0)
        for i in kept:
            running += Fraction(w[i], 2**bits)
            if running > target:
                out.append(i)
                break
        else:
            raise AssertionError("the target is below the kept weight")
    return out


def boundaries(row: list[float], p: Params, limit: int = 12) -> list[float]:
    """Uniforms at and one double either side of u = (running sum) / S, where the draw moves to the next kept token
    (at most `limit` of them, spread over the row)."""
    kept, w, _ = reference_kept(row, p)
    total = sum(w[i] for i in kept)
    running = np.cumsum([w[i] for i in kept])[:-1].tolist()
    picks = running[:: max(1, len(running) // limit)]
    out = []
    for c in picks:
        u = float(Fraction(int(c), total))
        out += [float(np.nextafter(u, 0.0)), u, float(np.nextafter(u, 1.0))]
    return [u for u in out if 0.0 <= u < 1.0]


def random_case(rng: np.random.Generator, vocab: int, rows: int) -> tuple[torch.Tensor, list[list]]:
    """Logits of several scales, some rounded into ties or masked (-inf), and a parameter mix per row: top-k 1 and
    past the vocabulary, top-p tiny to 0.999, min-p up to 1, temperatures from 1e-5 to 1e6."""
    x = rng.standard_normal((rows, vocab)) * rng.choice([0.01, 0.3, 1.0, 4.0, 30.0])
    if rng.random() < 0.4:
        x = np.round(x * 2) / 2  # many exact ties
    if rng.random() < 0.3:
        x[:, rng.integers(0, vocab, size=max(1, vocab // 3))] = -np.inf
    x[:, rng.integers(0, vocab)] = np.abs(x[:, 0]) if np.isfinite(x[:, 0]).all() else 1.0  # a finite logit per row
    temperature = rng.choice([1e-5, 0.01, 0.3, 0.7, 1.0, 1.7, 5.0, 1e6], size=rows).tolist()
    top_k = rng.choice([0, 0, 1, 2, 7, 50, vocab - 1, vocab, vocab + 5], size=rows).tolist()
    top_p = rng.choice([1.0, 1.0, 0.95, 0.5, 1e-6, 0.999], size=rows).tolist()
    min_p = rng.choice([0.0, 0.0, 0.001, 0.05, 0.5, 1.0], size=rows).tolist()
    return torch.from_numpy(x.astype(np.float32)), [temperature, top_k, top_p, min_p]


def test_exp_constants_are_the_definitions() -> None:
    assert (sampling.LOG2E, sampling.LN2_HI, sampling.LN2_LO, list(sampling.TAYLOR)) == (LOG2E, LN2_HI, LN2_LO, TAYLOR)
    assert all(Fraction(n * LN2_HI) == n * Fraction(LN2_HI) for n in range(-40, 1))  # exact over E's range of n


def test_exp_is_within_1e_12_of_e_to_the_x() -> None:
    """E over [-24, 0] (a dense grid, the rounding switch points of n, both ends) within 1e-12 of e^x relative, the
    torch route's bit for bit the reference's, and E(0) exactly 1."""
    grid = np.linspace(-24.0, 0.0, 200_001)
    switches = (np.arange(-35, 1) + 0.5) / LOG2E
    x = np.concatenate([grid, switches, np.nextafter(switches, 0), np.nextafter(switches, -1)])
    x = x[(x >= -24.0) & (x <= 0.0)]
    got = sampling.draw_exp(torch.from_numpy(x)).numpy()
    assert got[x == 0.0].tolist() == [1.0]
    exact = np.array([float(Decimal(float(v)).exp()) for v in x[::97]])
    assert np.abs(got[::97] / exact - 1).max() < 1e-12
    assert np.abs(got / np.exp(x) - 1).max() < 1e-12 + 4e-16  # numpy's exp: within an ulp or two
    sample = x[::1013]
    assert got[::1013].tolist() == [reference_exp(float(v)) for v in sample]


def test_the_torch_route_is_the_definition() -> None:
    """ops/sampling.py against reference_draw on small rows (1 to 300 tokens), every parameter mix, at random
    uniforms and where the draw changes token; whole-row ranking (kept_weights) too, and its weights are the
    reference's kept ones."""
    rng = np.random.default_rng(1)
    for vocab in (1, 2, 3, 8, 9, 16, 17, 40, 300):
        for _ in range(12):
            logits, params = random_case(rng, vocab, rows=3)
            for r in range(3):
                row = logits[r].tolist()
                p = tuple(v[r] for v in params)
                uniforms = rng.random(4).tolist() + [0.0, 1 - 2**-53] + boundaries(row, p)
                n = len(uniforms)
                want = reference_draws(row, p, uniforms)
                one = logits[r:r + 1].expand(n, -1)
                assert sampling.sample_rows(one, *([v] * n for v in p), uniforms) == want, (vocab, p)
                kept, w, _ = reference_kept(row, p)
                weights = sampling.kept_weights(one[:1], *([v] for v in p))[0]
                assert weights.tolist() == [float(w[i]) if i in kept else 0.0 for i in range(vocab)], (vocab, p)


def test_nan_and_unweighable_rows_draw_the_argmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    logits[0, [7, 30]] = float("nan")
    logits[1] = -float("inf")
    logits[2, 9] = float("inf")
    for kernels in [*([native.library()] if native.library() else []), None]:
        drawn = (sampling.sample_rows(logits, [1.0, 1.0, 1.0, 1e-320], [0, 3, 0, 0], [1.0, 0.5, 1.0, 1.0],
                                      [0.0] * 4, [0.5] * 4) if kernels is None else
                 native.sample_rows(kernels, logits, [1.0, 1.0, 1.0, 1e-320], [0, 3, 0, 0], [1.0, 0.5, 1.0, 1.0],
                                    [0.0] * 4, [0.5] * 4))
        assert drawn == [7, 0, 9, int(logits[3].argmax())]


@pytest.fixture(scope="module")
def builds(lib: ctypes.CDLL, tmp_path_factory: pytest.TempPathFactory) -> dict[str, ctypes.CDLL]:
    """The kernels' builds: AVX-512 (the host's, else emulated: emulate512.h), AVX2 and plain C."""
    cache = tmp_path_factory.mktemp("native")
    avx512 = lib if lib.nt_has_vnni512() else native.load(native.build(flags=native.EMULATED_AVX512_FLAGS))
    return {"avx512": avx512, "avx2": native.load(native.build(flags=AVX2_FLAGS, cache_dir=cache)),
            "portable": native.load(native.build(flags=PORTABLE_FLAGS, cache_dir=cache))}


@needs_native
@pytest.mark.parametrize("build", ["avx512", "avx2", "portable"])
def test_every_build_draws_the_torch_routes_token(builds: dict[str, ctypes.CDLL], build: str) -> None:
    """Random rows around the vector widths (8, 16) and the walk's blocks (1,024 weights), up to 50,000 tokens, every
    parameter mix: nt_sample_rows and ops/sampling.py draw the same tokens, at random uniforms and at the ends."""
    kernels = builds[build]
    assert kernels.nt_has_vnni512() == (build == "avx512") and kernels.nt_has_avx2() == (build != "portable")
    rng = np.random.default_rng(["avx512", "avx2", "portable"].index(build))
    for vocab in (1, 7, 8, 9, 15, 16, 17, 31, 100, 1023, 1024, 1025, 2049, 5000, 20_000, 50_000):
        for _ in range(8 if vocab < 10_000 else 3):
            rows = int(rng.integers(1, 6))
            logits, params = random_case(rng, vocab, rows)
            uniforms = rng.random(rows).tolist()
            uniforms[0] = float(rng.choice([0.0, 1 - 2**-53, uniforms[0]]))
            want = sampling.sample_rows(logits, *params, uniforms)
            assert native.sample_rows(kernels, logits, *params, uniforms) == want, (build, vocab, params, uniforms)


@needs_native
@pytest.mark.parametrize("build", ["avx512", "avx2", "portable"])
def test_every_build_draws_the_definitions_token_where_it_changes(builds: dict[str, ctypes.CDLL],
                                                                  build: str) -> None:
    """At the uniforms where the draw moves to another token (from the reference's exact running sums), and one
    double either side: the kernels, the torch route and the reference agree on each. Peaked and flat rows, each
    filter alone and combined, min-p's cut past the first candidates, a nucleus past them, ties."""
    kernels = builds[build]
    rng = np.random.default_rng(100 + ["avx512", "avx2", "portable"].index(build))
    cases: list[tuple[int, float, Params]] = [
        (1025, 1.0, (1.0, 0, 1.0, 0.0)), (3001, 4.0, (0.7, 0, 0.9, 0.0)), (2061, 2.0, (1.3, 50, 0.9, 0.0)),
        (1500, 0.3, (1.0, 0, 1.0, 0.05)), (5000, 1.0, (2.0, 0, 0.5, 0.02)), (700, 3.0, (0.5, 3, 1.0, 0.0)),
        (4000, 0.1, (1.0, 0, 0.999, 0.0)), (3000, 4.0, (1.0, 200, 1.0, 0.001)), (20_000, 3.0, (1.0, 0, 0.95, 0.0))]
    for vocab, scale, p in cases:
        x = rng.standard_normal(vocab) * scale
        x[rng.integers(0, vocab, 20)] = x.max()  # ties at the top
        row = torch.from_numpy(x.astype(np.float32))
        values = row.tolist()
        uniforms = boundaries(values, p)
        assert uniforms, p
        n = len(uniforms)
        want = reference_draws(values, p, uniforms)
        logits = row.expand(n, -1)
        assert sampling.sample_rows(logits, *([v] * n for v in p), uniforms) == want, p
        assert native.sample_rows(kernels, logits, *([v] * n for v in p), uniforms) == want, (build, p)


@pytest.mark.parametrize("native_draws", [pytest.param(True, marks=needs_native), False])
def test_candidates_widen_to_what_the_whole_row_draws(monkeypatch: pytest.MonkeyPatch, native_draws: bool) -> None:
    """Ranked rows whose filtered set lies past their first candidates, or past the wider set, draw what ranking the
    whole row draws (kept_weights): the candidates are widened, never cut short."""
    monkeypatch.setattr(sampling, "CANDIDATES", 64)
    monkeypatch.setattr(sampling, "WIDE_CANDIDATES", 256)
    gen = torch.Generator().manual_seed(4)
    vocab = 3000
    peaked, flat = torch.randn(vocab, generator=gen) * 4, torch.randn(vocab, generator=gen) * 0.1
    cases = [(peaked, (1.0, 0, 0.9, 0.0)), (flat, (1.0, 0, 0.9, 0.0)), (flat, (1.0, 0, 0.01, 0.0)),
             (peaked, (1.0, 100, 0.9, 0.0)), (flat, (1.0, 500, 0.95, 0.0)), (peaked, (1.0, 150, 1.0, 0.3)),
             (flat, (0.05, 0, 0.4, 0.0)), (peaked, (1.2, 10, 0.8, 0.1)), (flat, (1.0, 2999, 0.999, 0.0))]
    uniforms = np.linspace(0, 1, 41)[:-1]
    n = len(uniforms)
    for row, p in cases:
        running = sampling.kept_weights(row[None], *([v] for v in p))[0].cumsum(0).numpy()  # exact: integers < 2^53
        want = np.searchsorted(running, uniforms * running[-1], side="right").tolist()
        logits, per_row = row.expand(n, -1), [[v] * n for v in p]
        got = native.sample_rows(native.library(), logits, *per_row, uniforms.tolist()) if native_draws else \
            sampling.sample_rows(logits, *per_row, uniforms.tolist())
        assert got == want, p


def test_large_vocabularies_weigh_in_fewer_bits() -> None:
    """Past 2^19 tokens a weight has one bit less per doubling, so that a row's sum stays within 2^53: a row of
    2^19 + 3 nearly equal logits (every weight near 2^33, the sum near 2^52) draws alike on both routes."""
    assert [sampling.draw_bits(n) for n in (1, 2**19, 2**19 + 1, 2**20, 2**21 + 1)] == [34, 34, 33, 33, 31]
    kernels = native.library()
    if kernels is None:
        return
    row = torch.randn(2**19 + 3, generator=torch.Generator().manual_seed(8)) * 1e-3
    uniforms = [0.0, 0.3, 0.7, 1 - 2**-53]
    n = len(uniforms)
    for p in ((1e6, 0, 1.0, 0.0), (1.0, 0, 0.5, 0.0)):
        logits, per_row = row.expand(n, -1), [[v] * n for v in p]
        assert native.sample_rows(kernels, logits, *per_row, uniforms) == sampling.sample_rows(logits, *per_row,
                                                                                               uniforms)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_sampler_routes_give_the_same_tokens_step_after_step(device: str) -> None:
    """Sampler(native_draws=True) and Sampler(native_draws=False) (and the torch route on CUDA) over 30 steps of a
    batch of seeded requests, with penalties, every filter and a greedy row: the same tokens at every step."""
    gen = torch.Generator().manual_seed(6)
    vocab = 4099
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=1.0, seed=2),
              SamplingParams(temperature=0.7, top_k=40, min_p=0.05, seed=3),
              SamplingParams(temperature=1.3, repetition_penalty=1.3, presence_penalty=0.5, seed=4),
              SamplingParams(temperature=0, seed=5), SamplingParams(temperature=1.0, min_p=0.02, seed=6)]
    samplers = {"native": Sampler(native_draws=True), "torch": Sampler(native_draws=False)}
    rows = {name: [SamplingRow(p, torch.Generator().manual_seed(p.seed or 0), [1, 2, 3], []) for p in params]
            for name in samplers}
    for _ in range(30):
        logits = torch.randn(len(params), vocab, generator=gen) * 3
        tokens = {}
        for name, sampler in samplers.items():
            x = logits.to(device) if name == "torch" else logits
            tokens[name] = sampler(x, rows[name]).token_ids
            for row, token in zip(rows[name], tokens[name]):
                row.output_ids.append(token)
        assert tokens["native"] == tokens["torch"]


@needs_native
@pytest.mark.parametrize("build", ["avx512", "avx2", "portable"])
def test_every_build_keeps_the_torch_routes_weights(builds: dict[str, ctypes.CDLL], build: str) -> None:
    """nt_kept_weights against ops/sampling.py's kept_weights (the distributions the rejection rule weighs), weight
    for weight: random rows up to 50,000 tokens with every parameter mix, and rows with nothing to weigh (a NaN, all
    -inf, an infinite logit, a temperature whose inverse overflows), which weigh 1 at their argmax."""
    kernels = builds[build]
    rng = np.random.default_rng(200 + ["avx512", "avx2", "portable"].index(build))
    for vocab in (1, 7, 16, 17, 100, 1025, 5000, 50_000):
        for _ in range(6 if vocab < 10_000 else 2):
            logits, params = random_case(rng, vocab, int(rng.integers(1, 6)))
            got = native.kept_weights(kernels, logits, *params)
            want = sampling.kept_weights(logits, *params)
            assert torch.equal(got, want), (build, vocab, params)
    odd = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    odd[0, [7, 30]] = float("nan")
    odd[1] = -float("inf")
    odd[2, 9] = float("inf")
    params = [1.0, 1.0, 1.0, 1e-320], [0, 3, 0, 0], [1.0, 0.5, 1.0, 1.0], [0.0] * 4
    got = native.kept_weights(kernels, odd, *params)
    assert torch.equal(got, sampling.kept_weights(odd, *params))
    assert [int(row.nonzero()[0, 0]) for row in got] == [7, 0, 9, int(odd[3].argmax())]
    assert got.sum(dim=1).tolist() == [1.0] * 4

"""The sampler's draw, as engine/sampler.py defines it, in torch on any device: for the same fp32 logits, parameters
and uniform, the token nt_sample_rows draws on every build, by construction. x and the weights come from IEEE fp64
elementwise ops, each rounded on its own (no fused multiply-add); the weights are integers of at most 2^Q, whose
sums fp64 holds exactly in any order (torch's reductions, CUDA's trees); the order is a stable sort.

Rows with top-k or top-p rank only their largest logits (CANDIDATES, then WIDE_CANDIDATES, then the whole row) where
those provably hold the filtered set; the others weigh their whole row, in blocks (on the CPU, of only the tokens a
cut in fp32 leaves where it leaves few). Only the drawn ids leave the device.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from nextoken.ops import native

# E(x) = p(r) 2^n, n = round(x log2 e) (ties to even), r = (x - n LN2_HI) - n LN2_LO: ln 2 in two parts, the first
# with 29 significant bits, so n LN2_HI is exact. p: Taylor's polynomial for e^r by Horner, highest term first
# (1/11! ... 1/2!, 1, 1), truncated under 1e-14 for |r| <= ln2 / 2. Hex so that C and Python read the same doubles.
LOG2E = float.fromhex("0x1.71547652b82fep+0")
LN2_HI = float.fromhex("0x1.62e42ffp-1")
LN2_LO = float.fromhex("-0x1.718432a1b0e26p-35")
TAYLOR = tuple(float.fromhex(c) for c in (
    "0x1.ae64567f544e4p-26", "0x1.27e4fb7789f5cp-22", "0x1.71de3a556c734p-19", "0x1.a01a01a01a01ap-16",
    "0x1.a01a01a01a01ap-13", "0x1.6c16c16c16c17p-10", "0x1.1111111111111p-7", "0x1.5555555555555p-5",
    "0x1.5555555555555p-3", "0x1p-1", "0x1p0", "0x1p0"))
POW2_BIAS = float.fromhex("0x1.80000000003ffp+52")  # 1.5 * 2^52 + 1023: n + this holds n + 1023 in its low bits
DRAW_CUT = -24.0  # x below it weighs 0: e^-24 < 2^-34 / 1.5, far past E's error
DRAW_BITS = 34  # Q: weights in units of 2^-34, for vocabularies up to 2^19 (one bit less per doubling past that)
MIN_P_MARGIN = 0.01  # min-p alone drops every x below log(min_p) - this: e^x < 0.99 min_p, past any error of E
# Candidates a ranked row is first filtered among (its largest logits), then a wider set in vocabularies of at
# least 4x as many; rows neither holds rank their whole row.
CANDIDATES = 1024
WIDE_CANDIDATES = 16384
WALK_BLOCK = 1024  # the draw's walk over a wide row: block sums first
# Entries weighed per block. On the CPU, fewer than torch's grain size (32,768): a block's fp64 temporaries stay in
# cache and each of its some 35 ops runs on one thread, with no fork and join per op (on 2 shared cores those cost
# more than the op: a descheduled partner thread stalls each). On CUDA, large blocks.
BLOCK = {"cpu": 30_000}
DEVICE_BLOCK = 1 << 22


def draw_bits(vocab: int) -> int:
    """Q for rows of `vocab` tokens: vocab weights of at most 2^Q sum to at most 2^53, which fp64 holds exactly."""
    q = DRAW_BITS
    while q > 0 and vocab > 1 << (53 - q):
        q -= 1
    return q


def _exp_scaled_(x: torch.Tensor, bits: int) -> torch.Tensor:
    """E(x) 2^bits for fp64 x in [DRAW_CUT, 0] (x is overwritten): p(r) times 2^(n + bits), one exact scaling for
    E's 2^n and the weights' 2^Q, made from its bits: n + POW2_BIAS + bits holds n + 1023 + bits in its low bits
    (n >= -35: a normal number)."""
    n = torch.mul(x, LOG2E).round_()
    r = x.sub_(n * LN2_HI).sub_(n * LN2_LO)
    p = torch.mul(r, TAYLOR[0]).add_(TAYLOR[1])
    for c in TAYLOR[2:]:
        p.mul_(r).add_(c)
    return p.mul_(n.add_(POW2_BIAS + bits).view(torch.int64).bitwise_left_shift_(52).view(torch.float64))


def draw_exp(x: torch.Tensor) -> torch.Tensor:
    """E(x) for fp64 x in [DRAW_CUT, 0] (elementwise): the kernels' draw_exp, operation for operation."""
    return _exp_scaled_(x.clone(), 0)


def weigh_(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The weights floor(E(x) 2^bits) of fp64 x <= 0 (-inf included); x is overwritten. x below DRAW_CUT is weighed
    as DRAW_CUT: E(-24) 2^34 < 0.65 floors to 0, the definition's weight there."""
    return _exp_scaled_(x.clamp_(min=DRAW_CUT), bits).floor_()


def skip_below(top: float, temperature: float, inv_t: float, cut: float) -> float:
    """A float below which every logit has x < cut (x never falls as the logit grows, so the check at it holds for
    all below), near top - (|cut| + 1/2) T; -inf where there is none. As the kernels' draw_skip_below."""
    with np.errstate(over="ignore"):
        t = np.float32(top + (cut - 0.5) * temperature)
    for _ in range(4):
        if not t > -np.inf:
            break
        if (float(t) - top) * inv_t < cut:
            return float(t)
        t = np.nextafter(t, np.float32(-np.inf))
    return -math.inf


def _blocks(rows: int, vocab: int, size: int) -> Iterator[tuple[slice, slice]]:
    """[rows, vocab] in blocks of about `size` entries: whole rows, or parts of one."""
    step_rows, step_cols = max(1, size // vocab), min(vocab, size)
    for r in range(0, rows, step_rows):
        for c in range(0, vocab, step_cols):
            yield slice(r, r + step_rows), slice(c, c + step_cols)


def _sparse_weights(logits: torch.Tensor, top: torch.Tensor, inv_t: torch.Tensor, bits: int, skip: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """On the CPU, where most logits lie below their row's `skip` (fp32: every one below has x under the cut, or is
    dropped by min-p): (rows, cols, weights) of the others, row by row in id order. None elsewhere."""
    if logits.device.type != "cpu":
        return None
    live = logits >= skip[:, None]
    if 4 * int(live.sum()) >= live.numel():
        return None
    at = live.nonzero()
    x = (logits[live].double() - top.double()[at[:, 0]]) * inv_t[at[:, 0]]
    size = BLOCK["cpu"]
    for i in range(0, x.numel(), size):
        x[i:i + size] = weigh_(x[i:i + size], bits)
    return at[:, 0], at[:, 1], x


def _dense_weights(logits: torch.Tensor, top: torch.Tensor, inv_t: torch.Tensor, bits: int) -> torch.Tensor:
    """Every token's weight [rows, vocab] (fp64 integers), in blocks."""
    rows, vocab = logits.shape
    out = torch.empty(rows, vocab, dtype=torch.float64, device=logits.device)
    top = top.double()
    for r, c in _blocks(rows, vocab, BLOCK.get(logits.device.type, DEVICE_BLOCK)):
        out[r, c] = weigh_((logits[r, c].double() - top[r, None]) * inv_t[r, None], bits)
    return out


def _weights(logits: torch.Tensor, top: torch.Tensor, inv_t: torch.Tensor, bits: int, skip: torch.Tensor
             ) -> torch.Tensor:
    """Every token's weight [rows, vocab]: on the CPU only those at or above the row's `skip` where most are below
    it (_sparse_weights), else all (_dense_weights)."""
    sparse = _sparse_weights(logits, top, inv_t, bits, skip)
    if sparse is None:
        return _dense_weights(logits, top, inv_t, bits)
    out = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
    out[sparse[0], sparse[1]] = sparse[2]
    return out


def _walk_sparse(rows: torch.Tensor, cols: torch.Tensor, weights: torch.Tensor, uniforms: torch.Tensor
                 ) -> torch.Tensor:
    """_walk over the weights of (rows, cols) (_sparse_weights' order; every row of `uniforms` holds some): each
    row's col. One running sum over all of them, in int64 (exact: below 2^63), each row's part found past its base."""
    running = weights.to(torch.int64).cumsum(dim=0)
    ends = torch.bincount(rows, minlength=uniforms.numel()).cumsum(dim=0)
    base = torch.cat([running.new_zeros(1), running[ends[:-1] - 1]])
    target = uniforms * (running[ends - 1] - base).double()  # u times the row's sum, an fp64 product
    # the first running sum above the target: an integer exceeds target where it exceeds floor(target)
    return cols[torch.searchsorted(running, base + target.floor().to(torch.int64), right=True)]


def _walk(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of weights [rows, C] (fp64 integers), the first place whose running sum exceeds u times the row's
    sum: never one of weight 0. Sums exact, so any summation order gives the same place: wide rows take the sums of
    WALK_BLOCK weights first, then the running sum within one block. (A row of no weight, whose place its caller
    discards, gets one in range.)"""
    rows, width = weights.shape
    target = (uniforms * weights.sum(dim=1))[:, None]
    if width <= 4 * WALK_BLOCK:
        return torch.searchsorted(weights.cumsum(dim=1), target, right=True)[:, 0].clamp_(max=width - 1)
    whole = width // WALK_BLOCK * WALK_BLOCK
    sums = [weights[:, :whole].unflatten(1, (-1, WALK_BLOCK)).sum(dim=2)]
    if whole < width:
        sums.append(weights[:, whole:].sum(dim=1, keepdim=True))
    ends = torch.cat(sums, dim=1).cumsum(dim=1)  # [rows, blocks]: the running sum at each block's end
    block = torch.searchsorted(ends, target, right=True).clamp_(max=ends.shape[1] - 1)  # [rows, 1]
    before = torch.where(block > 0, ends.gather(1, (block - 1).clamp_(min=0)), 0.0)
    at = block * WALK_BLOCK + torch.arange(WALK_BLOCK, device=weights.device)  # [rows, WALK_BLOCK]
    inside = weights.gather(1, at.clamp(max=width - 1)).masked_fill_(at >= width, 0.0).cumsum(dim=1) + before
    place = block[:, 0] * WALK_BLOCK + torch.searchsorted(inside, target, right=True)[:, 0]
    return place.clamp_(max=width - 1)


class _Rows:
    """A batch's per-row parameters on the logits' device (fp64, top_k int64), and what the filters need of them."""

    def __init__(self, logits: torch.Tensor, top: torch.Tensor, temperature: list[float], top_k: list[int],
                 top_p: list[float], min_p: list[float], bits: int) -> None:
        dev = logits.device
        vocab = logits.shape[1]
        inv_t = (1.0 / torch.tensor(temperature, dtype=torch.float64)).tolist()  # IEEE divisions, as the kernels'
        self.inv_t = torch.tensor(inv_t, dtype=torch.float64, device=dev)
        self.top_k = torch.tensor(top_k, dtype=torch.int64, device=dev)
        self.top_p = torch.tensor(top_p, dtype=torch.float64, device=dev)
        # w >= min_p in units of 2^-Q (an exact scaling)
        self.least = torch.tensor([math.ldexp(m, bits) for m in min_p], dtype=torch.float64, device=dev)
        self.by_k = (self.top_k > 0) & (self.top_k < vocab)
        self.by_p = self.top_p < 1.0
        # Where a row's weights need no E: below its cut (DRAW_CUT; min-p's, where nothing else reads the row)
        tops = top.tolist()
        self.weighable = [math.isfinite(t) and 0 < i < math.inf for t, i in zip(tops, inv_t)]
        cuts = [max(DRAW_CUT, math.log(m) - MIN_P_MARGIN) if m > 0 and p >= 1 else DRAW_CUT
                for m, p in zip(min_p, top_p)]
        self.skip = torch.tensor([skip_below(t, T, i, c) if w else 0.0 for t, T, i, c, w in
                                  zip(tops, temperature, inv_t, cuts, self.weighable)], device=dev)
        self.skip_all = torch.tensor([skip_below(t, T, i, DRAW_CUT) if w else 0.0 for t, T, i, w in
                                      zip(tops, temperature, inv_t, self.weighable)], device=dev)

    def take(self, rows: torch.Tensor) -> _Rows:
        out = object.__new__(_Rows)
        for name, value in vars(self).items():
            setattr(out, name, value if isinstance(value, list) else value[rows])
        return out


def _ranked(logits: torch.Tensor, top: torch.Tensor, rows: _Rows, total: torch.Tensor, count: int, bits: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k, top-p and min-p over each row's `count` largest logits: (ids [n, C] ascending, the kept tokens'
    weights [n, C] in the same order, held [n]). A held row's kept set lies among its candidates; for the others
    the weights mean nothing. total: each row's whole weight (what top-p normalizes over without top-k)."""
    num, vocab = logits.shape
    dev = logits.device
    whole = count >= vocab
    if whole:
        ids = torch.arange(vocab, device=dev).expand(num, -1)
        values = logits
    else:
        values, ids = logits.topk(count, dim=1, sorted=False)
        ids, by_id = ids.sort(dim=1)
        values = values.gather(1, by_id)
    x = (values.double() - top.double()[:, None]) * rows.inv_t[:, None]
    # Every token left out has a logit, so an x, at most the smallest candidate's: the candidates above it come first
    # in the row's order (x descending, then id); at the smallest x, only where it weighs 0 (or the row is whole).
    smallest = x.min(dim=1).values
    prefix = (x > smallest[:, None]) | (x < DRAW_CUT) | whole
    x, order = x.sort(dim=1, descending=True, stable=True)  # ids ascending before: ties stay in id order
    prefix = prefix.gather(1, order)
    w = weigh_(x, bits).masked_fill_(~prefix, 0.0)
    place = torch.arange(w.shape[1], device=dev)[None, :]
    in_k = ~rows.by_k[:, None] | (place < rows.top_k[:, None])
    wk = torch.where(in_k, w, 0.0)
    # top-p: a token stays while the weight before it is below p times the top-k set's (the row's without top-k)
    bound = rows.top_p * torch.where(rows.by_k, wk.sum(dim=1), total)
    before = wk.cumsum(dim=1) - wk
    in_p = ~rows.by_p[:, None] | (before < bound[:, None]) | (place == 0)
    kept = torch.where(in_k & in_p & (w >= rows.least[:, None]), wk, 0.0)
    complete = whole | (smallest < DRAW_CUT)  # every token of weight above 0 is a candidate
    held = complete | torch.where(rows.by_k, prefix.sum(dim=1) >= rows.top_k, ~rows.by_p | (w.sum(dim=1) >= bound))
    return ids, torch.zeros_like(kept).scatter_(1, order, kept), held


def _take(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t's rows `rows` (distinct, increasing): t itself, not a gathered copy, when that is all of them."""
    return t if rows.numel() == t.shape[0] else t[rows]


def _row_chunks(rows: torch.Tensor, width: int) -> list[torch.Tensor]:
    """rows (indices) in chunks of about a block (BLOCK, DEVICE_BLOCK) of entries of [rows, width]: whole rows."""
    step = max(1, BLOCK.get(rows.device.type, DEVICE_BLOCK) // width)
    return [rows[i:i + step] for i in range(0, rows.numel(), step)]


def _held_candidates(logits: torch.Tensor, top: torch.Tensor, params: _Rows, ranked: torch.Tensor, bits: int
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Top-k and top-p rows (`ranked`, a mask) ranked over their largest logits, candidates widened until each row's
    kept set lies among them: (rows, their candidates' ids [n, C], the kept weights [n, C]) for each group held."""
    num, vocab = logits.shape
    # top-p without top-k normalizes over the whole row
    total = torch.zeros(num, dtype=torch.float64, device=logits.device)
    for rows in _row_chunks((ranked & ~params.by_k).nonzero()[:, 0], vocab):
        p, part = params.take(rows), _take(logits, rows)
        sparse = _sparse_weights(part, top[rows], p.inv_t, bits, p.skip_all)
        total[rows] = (_dense_weights(part, top[rows], p.inv_t, bits).sum(dim=1) if sparse is None else
                       torch.zeros(rows.numel(), dtype=torch.float64).index_add_(0, sparse[0], sparse[2]))
    left = ranked.nonzero()[:, 0]
    counts = [c for c in (CANDIDATES, WIDE_CANDIDATES) if (4 if c == WIDE_CANDIDATES else 1) * c < vocab] + [vocab]
    for count in counts:
        if not left.numel():
            return
        unheld = []
        for rows in _row_chunks(left, count):
            ids, kept, held = _ranked(_take(logits, rows), top[rows], params.take(rows), total[rows], count, bits)
            yield rows[held], ids[held], kept[held]
            unheld.append(rows[~held])
        left = torch.cat(unheld)


def kept_weights(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
                 min_p: list[float]) -> torch.Tensor:
    """Per row of logits [rows, vocab]: the weights [rows, vocab] (fp64, units of 2^-Q) of the tokens the filters
    keep, 0 elsewhere: the distribution each row draws from, once normalized; a row whose draw is its argmax (a NaN,
    no finite largest logit, no finite 1 / T) weighs 1 there. The same weights and candidates as sample_rows."""
    logits = logits.float()
    num, vocab = logits.shape
    dev = logits.device
    bits = draw_bits(vocab)
    top = logits.amax(dim=1)
    params = _Rows(logits, top, temperature, top_k, top_p, min_p, bits)
    out = torch.zeros(num, vocab, dtype=torch.float64, device=dev)
    weighable = torch.tensor(params.weighable, device=dev)
    ranked = weighable & (params.by_k | params.by_p)
    for rows in _row_chunks((weighable & ~ranked).nonzero()[:, 0], vocab):
        p = params.take(rows)
        w = _weights(_take(logits, rows), top[rows], p.inv_t, bits, p.skip)
        out[rows] = w.masked_fill_(w < p.least[:, None], 0.0)
    for rows, ids, kept in _held_candidates(logits, top, params, ranked, bits):
        out[rows] = torch.zeros(rows.numel(), vocab, dtype=torch.float64, device=dev).scatter_(1, ids, kept)
    for i, weighs in enumerate(params.weighable):
        if not weighs:
            out[i, logits[i].argmax()] = 1.0
    return out


def weigh_rows(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
               min_p: list[float]) -> torch.Tensor:
    """kept_weights on the fastest route for these rows: on the CPU one native call (nt_kept_weights) where the
    kernels are built, weight for weight the same (tests/unit/test_draw_routes.py); else the torch route above."""
    lib = native.library() if logits.device.type == "cpu" else None
    if lib is None:
        return kept_weights(logits, temperature, top_k, top_p, min_p)
    return native.kept_weights(lib, logits.float().contiguous(), temperature, top_k, top_p, min_p)


def sample_rows(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
                min_p: list[float], uniforms: list[float]) -> list[int]:
    """Per row of logits [rows, vocab] (fp32; other types are converted), the token drawn at uniforms[r] in [0, 1)
    after temperature (> 0), top-k (0: none), top-p (1: none) and min-p (0: none): nt_sample_rows' token."""
    logits = logits.float()
    num, vocab = logits.shape
    dev = logits.device
    bits = draw_bits(vocab)
    top = logits.amax(dim=1)  # [rows] fp32, NaN where a row holds one
    params = _Rows(logits, top, temperature, top_k, top_p, min_p, bits)
    u = torch.tensor(uniforms, dtype=torch.float64, device=dev)
    tokens = torch.zeros(num, dtype=torch.int64, device=dev)
    # Rows with nothing to weigh: the argmax (the first NaN; token 0 for a row of -inf).
    lone = [i for i, w in enumerate(params.weighable) if not w]
    if lone:
        tokens[lone] = logits[lone].argmax(dim=1)
    weighable = torch.tensor(params.weighable, device=dev)
    ranked = weighable & (params.by_k | params.by_p)
    for rows in _row_chunks((weighable & ~ranked).nonzero()[:, 0], vocab):
        p, part = params.take(rows), _take(logits, rows)
        sparse = _sparse_weights(part, top[rows], p.inv_t, bits, p.skip)
        if sparse is None:
            w = _dense_weights(part, top[rows], p.inv_t, bits)
            tokens[rows] = _walk(w.masked_fill_(w < p.least[:, None], 0.0), u[rows])
        else:
            at, cols, w = sparse
            tokens[rows] = _walk_sparse(at, cols, w.masked_fill_(w < p.least[at], 0.0), u[rows])
    for rows, ids, kept in _held_candidates(logits, top, params, ranked, bits):
        tokens[rows] = ids.gather(1, _walk(kept, u[rows])[:, None])[:, 0]
    return tokens.tolist()

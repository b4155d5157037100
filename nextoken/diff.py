"""`nextoken diff`: why two runs of one prompt came apart, found by putting both on the same tokens.

Run A is a record (engine/record.py); run B is another record of the same prompt, or A's own request under new
settings (`--weights fp32`, `--kv-dtype int8`, `--activations int8`, another model file with the same tokenizer),
generated now. Both are then teacher-forced over A's tokens (the prompt and A's output) in one forward pass each, every
block through its torch modules (the definition; the fused routes are held to them by the tests), with each layer's
output kept. The report:
- the first generated token where A and B differ, and there the logit margin in each run: A's token's logit minus
  B's token's (positive in A, negative in B: the two runs rank them the other way round);
- per generated position, KL(A || B) over the vocabulary and whether the two most likely tokens agree;
- per layer, the largest relative difference of the two runs' hidden states over the sequence, and the first layer
  where it exceeds rounding (`ROUNDING`): where the two computations part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nextoken.check import kl_rows
from nextoken.engine.record import Bundle, check_model, engine_settings, read_bundle, tokenizer_sha256, with_logprobs
from nextoken.errors import NextokenError

if TYPE_CHECKING:
    from nextoken.llm import LLM

ROUNDING = 1e-5  # relative difference of a layer's output beyond which two fp32 computations are not the same one


@dataclass
class LayerDifference:
    layer: int  # -1: the embedding's output; i: block i's
    relative: float  # max over positions of |a - b| / |a| (L2 over the hidden dimension)


@dataclass
class DiffReport:
    num_prompt: int
    tokens_a: list[int]
    tokens_b: list[int]
    first_divergence: int | None  # the first generated step whose tokens differ
    margin_a: float | None  # at that step, in A: logit(A's token) - logit(B's token)
    margin_b: float | None  # ... in B
    kl: list[float]  # per generated position of A's output: KL(A || B)
    agree: list[bool]  # per position: the same most likely token
    layers: list[LayerDifference]
    first_layer: int | None  # the first layer past ROUNDING (-1: the embedding; None: none)

    @property
    def top1(self) -> float:
        return sum(self.agree) / max(len(self.agree), 1)


def teacher_forced(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits [n, vocab], [embedding output, then each block's output] [n, hidden]) over `ids`, on the modules."""
    model = llm.engine.runner.model
    hidden: list[torch.Tensor] = []
    hooks = [model.layers[0].register_forward_pre_hook(
        lambda _m, args: hidden.append(args[0].detach().float().clone()))]
    hooks += [layer.register_forward_hook(lambda _m, _a, out: hidden.append(out.detach().float().clone()))
              for layer in model.layers]
    try:
        logits = llm.engine.runner.score(ids, modules=True)
    finally:
        for hook in hooks:
            hook.remove()
    return logits, hidden


def compare_runs(a: LLM, b: LLM, prompt_ids: list[int], tokens_a: list[int], tokens_b: list[int]) -> DiffReport:
    """Both runs teacher-forced over the prompt and A's tokens, compared (the module docstring)."""
    ids = prompt_ids + tokens_a
    logits_a, hidden_a = teacher_forced(a, ids)
    logits_b, hidden_b = teacher_forced(b, ids)
    if logits_a.shape != logits_b.shape or len(hidden_a) != len(hidden_b):
        raise NextokenError(f"the two runs' models differ in shape (vocabulary {logits_a.shape[1]} against "
                            f"{logits_b.shape[1]}, {len(hidden_a) - 1} layers against {len(hidden_b) - 1}): "
                            "diff compares one model in two settings, or two files of one model")
    n0 = len(prompt_ids) - 1  # the row after the last prompt token predicts the first generated one
    rows = slice(n0, n0 + len(tokens_a))
    pa, pb = logits_a[rows].double().log_softmax(-1), logits_b[rows].double().log_softmax(-1)
    kl = kl_rows(pa, pb).tolist()
    agree = (pa.argmax(-1) == pb.argmax(-1)).tolist()
    first = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y),
                 None if len(tokens_a) == len(tokens_b) else min(len(tokens_a), len(tokens_b)))
    margin_a = margin_b = None
    if first is not None and first < len(tokens_a) and first < len(tokens_b):
        ta, tb, row = tokens_a[first], tokens_b[first], n0 + first
        margin_a = float(logits_a[row, ta] - logits_a[row, tb])
        margin_b = float(logits_b[row, ta] - logits_b[row, tb])
    layers = []
    for i, (ha, hb) in enumerate(zip(hidden_a, hidden_b)):
        norm = ha.norm(dim=-1).clamp_min(1e-30)
        layers.append(LayerDifference(i - 1, float(((ha - hb).norm(dim=-1) / norm).max())))
    first_layer = next((d.layer for d in layers if d.relative > ROUNDING), None)
    return DiffReport(len(prompt_ids), tokens_a, tokens_b, first, margin_a, margin_b, kl, agree, layers, first_layer)


def load_run(bundle: Bundle, model: str | None = None, overrides: dict[str, Any] | None = None) -> LLM:
    """The model and engine settings of a bundle (with `overrides`), checked against it unless the model changes."""
    from nextoken.llm import LLM

    llm = LLM(model or bundle.data["model"]["path"], **{**engine_settings(bundle), **(overrides or {})})
    if model is None:
        check_model(bundle, llm.engine)
    return llm


def diff(path_a: str, path_b: str | None = None, *, model: str | None = None,
         overrides: dict[str, Any] | None = None) -> tuple[DiffReport, LLM]:
    """Record A against record B, or against A's request run now with `model` and `overrides`."""
    a = read_bundle(path_a)
    run_a = load_run(a)
    if path_b is not None:
        b = read_bundle(path_b)
        if b.prompt_ids != a.prompt_ids:
            raise NextokenError(f"{path_a} and {path_b} are records of different prompts: diff needs the same one")
        run_b = load_run(b)
        tokens_b = [s["token"] for s in b.steps]
    else:
        if model is None and not overrides:
            raise NextokenError("diff needs a second record or a setting to change (--weights, --kv-dtype, "
                                "--activations, --lm-head, --model)")
        run_b = load_run(a, model, overrides)
        tokens_b = run_b.generate([a.prompt_ids], with_logprobs(a.params), use_tqdm=False)[0].token_ids
    if tokenizer_sha256(run_b.engine) != a.data["tokenizer_sha256"]:
        raise NextokenError("the second run's tokenizer is not the record's: diff compares runs over the same tokens")
    return compare_runs(run_a, run_b, a.prompt_ids, [s["token"] for s in a.steps], tokens_b), run_a


def describe(report: DiffReport, piece: Any) -> list[str]:
    """The report as lines of text."""
    lines = []
    if report.first_divergence is None:
        lines.append(f"same tokens: both runs generated the same {len(report.tokens_a)} tokens")
    else:
        i = report.first_divergence
        ta = repr(piece(report.tokens_a[i])) if i < len(report.tokens_a) else "(ended)"
        tb = repr(piece(report.tokens_b[i])) if i < len(report.tokens_b) else "(ended)"
        line = f"first divergent token: step {i}, A {ta}, B {tb}"
        if report.margin_a is not None:
            line += (f"; logit margin (A's token minus B's): {report.margin_a:+.4f} in A, {report.margin_b:+.4f} "
                     "in B")
        lines.append(line)
    if report.kl:
        worst = max(range(len(report.kl)), key=lambda k: report.kl[k])
        lines.append(f"over A's {len(report.kl)} tokens, teacher-forced: top-1 agreement {report.top1:.1%}, mean KL "
                     f"{sum(report.kl) / len(report.kl):.3e}, worst KL {report.kl[worst]:.3e} at step {worst} "
                     f"({piece(report.tokens_a[worst])!r})")
    if report.first_layer is None:
        lines.append(f"hidden states: every layer within {ROUNDING:g} (relative) of the other run's")
    else:
        where = "the embedding" if report.first_layer == -1 else f"layer {report.first_layer}"
        lines.append(f"hidden states part at {where}: relative difference "
                     f"{report.layers[report.first_layer + 1].relative:.2e} (beyond rounding, {ROUNDING:g})")
    lines.append("per layer, max relative difference: " + ", ".join(
        f"{'emb' if d.layer == -1 else d.layer} {_short(d.relative)}" for d in report.layers))
    return lines


def _short(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}" if math.isfinite(x) else str(x)

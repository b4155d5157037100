"""The parity check: how far each format's numbers are from an fp32 reference, on the user's own prompts and model.

For each prompt (a chat turn through the model's template), the reference (nextoken's fp32 route: fp32 weights, LM
head and KV cache, which the tests hold to transformers within 1e-3) continues it greedily for `continuation`
tokens; that whole sequence is then scored teacher-forced, in one forward pass, by the reference and by each format
asked for (`ModelRunner.score`: the format's own projections, activations, LM head and KV cache, prefill's route).
Per position: KL(reference || format) over the whole vocabulary and whether the two argmaxes agree. The report per
format: top-1 agreement, mean and worst KL, and where the worst is (prompt, position, the token there). With
`against="transformers"`, transformers' own forward of the same file (where it is installed) is one more row,
compared with the same reference: the check of the reference itself.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nextoken.errors import NextokenError

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers and add them up.",
    "Translate 'good morning, how are you?' into Spanish.",
    "def fibonacci(n):",
    "今天天气怎么样?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
)
REFERENCE = {"weights": "fp32", "lm_head": "fp32", "kv_dtype": "fp32"}
# The formats checked by default: the default route, then the choices that trade accuracy for memory or speed. (Scored
# in one pass, as prefill computes: the int8 LM head, a decode route of up to 15 rows, does not show here.)
DEFAULT_FORMATS = ("default", "weights=int8", "kv_dtype=int8", "activations=int8")


def parse_format(spec: str) -> dict[str, str]:
    """"default", or "key=value[,key=value]" over weights, kv_dtype, lm_head, activations, dtype."""
    if spec == "default":
        return {}
    out = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in ("weights", "kv_dtype", "lm_head", "activations", "dtype"):
            raise NextokenError(f"invalid format {spec!r}: give 'default' or key=value pairs over weights, kv_dtype, "
                                "lm_head, activations and dtype, e.g. weights=int8,kv_dtype=int8")
        out[key] = value.strip()
    return out


@dataclass
class FormatReport:
    name: str
    positions: int = 0
    agree: int = 0
    kl_sum: float = 0.0
    worst_kl: float = 0.0
    worst_at: tuple[int, int, int] | None = None  # (prompt, position, token id there)
    formats: dict[str, str] = field(default_factory=dict)  # what the engine resolved them to

    @property
    def top1(self) -> float:
        return self.agree / max(self.positions, 1)

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / max(self.positions, 1)

    def add(self, prompt: int, ids: list[int], ref_logp: torch.Tensor, logp: torch.Tensor) -> None:
        """Rows [n, vocab] of log-probabilities after each position of `ids` (the last row predicts nothing)."""
        kl = kl_rows(ref_logp, logp)  # [n]
        agree = ref_logp.argmax(-1) == logp.argmax(-1)
        self.positions += int(kl.numel())
        self.agree += int(agree.sum())
        self.kl_sum += float(kl.double().sum())
        worst = int(kl.argmax())
        if float(kl[worst]) >= self.worst_kl:
            self.worst_kl = float(kl[worst])
            self.worst_at = (prompt, worst, ids[worst])


def kl_rows(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per row of log-probabilities [n, vocab] -> [n] (rounding's negatives clamped to 0)."""
    return (p.exp() * (p - q)).sum(-1).clamp_min(0)


def run_check(model: str, prompts: Sequence[str], formats: Sequence[str], *, continuation: int = 32,
              against: str | None = None, engine_options: dict[str, Any] | None = None,
              progress: Callable[[str], None] | None = None) -> tuple[list[list[int]], list[FormatReport]]:
    """Every prompt's checked sequence (its ids and the reference's continuation), and one report per format (and
    transformers' where asked)."""
    from nextoken.llm import LLM
    from nextoken.sampling_params import SamplingParams

    say = progress or (lambda _: None)
    base = {"device": "cpu", "enable_prefix_caching": False, **(engine_options or {})}
    say("reference: fp32 weights, LM head and KV cache")
    ref = LLM(model, **base, **REFERENCE)
    sequences = []
    for prompt in prompts:
        _, ids = ref.render_chat([{"role": "user", "content": prompt}])
        out = ref.generate([ids], SamplingParams(temperature=0, max_tokens=continuation), use_tqdm=False)[0]
        sequences.append(ids + out.token_ids)
    ref_logp = [ref.engine.runner.score(seq).double().log_softmax(-1) for seq in sequences]  # fp64: KL of ~1e-8
    model_path = ref.engine.model_path
    del ref
    gc.collect()
    reports = []
    for spec in formats:
        options = parse_format(spec)
        say(f"{spec}: scoring {len(sequences)} sequences")
        llm = LLM(model, **base, **options)
        runner = llm.engine.runner
        report = FormatReport(spec, formats={"weights": runner.weights, "kv_dtype": runner.kv_dtype,
                                             "lm_head": runner.lm_head, "activations": runner.activations})
        for p, seq in enumerate(sequences):
            report.add(p, seq, ref_logp[p], runner.score(seq).double().log_softmax(-1))
        reports.append(report)
        del llm, runner
        gc.collect()
    if against == "transformers":
        say("transformers: its own forward of the same file, fp32")
        reports.append(_transformers_report(model_path, sequences, ref_logp))
    return sequences, reports


def _transformers_report(path: Path, sequences: list[list[int]], ref_logp: list[torch.Tensor]) -> FormatReport:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise NextokenError("--against transformers needs transformers installed (pip install transformers)") \
            from None
    if path.is_dir():
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    report = FormatReport("transformers fp32", formats={"weights": "fp32 (transformers)"})
    with torch.inference_mode():
        for p, seq in enumerate(sequences):
            logits = hf(torch.tensor([seq])).logits[0].float()
            report.add(p, seq, ref_logp[p], logits.double().log_softmax(-1))
    return report


def format_kl(value: float) -> str:
    return "0" if value == 0 else f"{value:.2e}" if value < 1e-3 or not math.isfinite(value) else f"{value:.4f}"

"""Structured output's cost: the grammar's share of a decode step, at batch 1 and 16, on the packaged models.

Run: .venv/bin/python -m benchmarks.structured [--models smollm2-135m-instruct gemma-3-270m] [--batches 1 16]
     [--tokens 48] [--repeats 3]
Per model and batch: B chat requests for a JSON object of a schema (nesting, an array, an enum, numbers), sampled
at temperature 1, seeded. The grammar's work per step (llguidance's masks for the step's rows and their -inf fill,
timed around `apply_masks` where the sampler calls it) against the decode step it runs in (the step's wall time,
from the engine's own step calls); and in the same process, the same requests without the schema, whose decode
tokens/s is the baseline. Medians over `repeats` runs, the CPU named.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import describe_machine
from nextoken import LLM, SamplingParams
from nextoken.engine import grammar
from nextoken.sampling_params import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number"},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "status": {"enum": ["active", "retired"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "status", "address"],
}
PROMPT = "Make up a contact card for a person, as JSON."




class GrammarClock:
    """Time spent in apply_masks (the masks and their fill), wrapped where the processors look it up."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._inner = grammar.apply_masks

    def __enter__(self) -> GrammarClock:
        def timed(*args: object) -> None:
            t0 = time.perf_counter()
            self._inner(*args)  # type: ignore[arg-type]
            self.seconds += time.perf_counter() - t0
            self.calls += 1
        grammar.apply_masks = timed  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        grammar.apply_masks = self._inner  # type: ignore[assignment]


def decode(llm: LLM, batch: int, tokens: int, constrained: bool) -> tuple[float, float, int]:
    """(decode seconds, grammar seconds, decode steps) for `batch` requests of `tokens` new tokens."""
    engine = llm.engine
    _, ids = llm.render_chat([{"role": "user", "content": PROMPT}])
    so = StructuredOutputs(json=SCHEMA) if constrained else None
    for i in range(batch):
        engine.add_request(ids, SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, min_tokens=tokens // 2,
                                               structured_outputs=so))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()  # prefill, untimed
    steps, decode_s = 0, 0.0
    with GrammarClock() as clock:
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            decode_s += time.perf_counter() - t0
            steps += 1
    llm.engine.release_threads()
    return decode_s, clock.seconds, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma-3-270m"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{describe_machine()}; medians of {args.repeats} runs; {args.tokens} new tokens per request")
    print(f"{'model':24} {'batch':>5} {'grammar us/step':>16} {'step ms':>8} {'share':>6} {'tok/s free':>11} "
          f"{'tok/s schema':>13} {'ratio':>6}")
    for model in args.models:
        llm = LLM(model, enable_prefix_caching=False)
        decode(llm, 1, 8, True)  # warm up: the grammar's tokenizer and the schema compiled once
        for batch in args.batches:
            share, step_ms, grammar_us, free, constrained = [], [], [], [], []
            for _ in range(args.repeats):
                seconds, _, steps = decode(llm, batch, args.tokens, False)
                free.append(batch * steps / seconds)
                seconds, g, steps = decode(llm, batch, args.tokens, True)
                constrained.append(batch * steps / seconds)
                share.append(g / seconds)
                step_ms.append(1e3 * seconds / steps)
                grammar_us.append(1e6 * g / steps)
            m = statistics.median
            print(f"{model:24} {batch:5d} {m(grammar_us):16.0f} {m(step_ms):8.2f} {m(share):6.1%} {m(free):11.1f} "
                  f"{m(constrained):13.1f} {m(constrained) / m(free):6.2f}")


if __name__ == "__main__":
    main()

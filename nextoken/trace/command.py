"""`nextoken trace`: run one prompt untraced and then traced through the same engine, and show the traced run.

The engine is built with prefix caching off: otherwise the untraced run would leave the prompt's blocks cached and
the traced run would skip most of its prefill, and neither the timings nor the overhead would compare like with like.
`--compare` instead runs the prompt once per sampling setting and prints them side by side; `--branch` prefills it
once and continues it under each setting from the shared prefix (trace/branch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from rich.console import Console

from nextoken.errors import NextokenError
from nextoken.sampling_params import SamplingParams
from nextoken.trace.report import make_console, print_compare, print_report
from nextoken.trace.run import parse_setting, run_request
from nextoken.trace.tracer import NullTracer, RecordingTracer

if TYPE_CHECKING:
    from nextoken.models.base import DecoderBlock


@dataclass(frozen=True)
class TraceOptions:
    model: str
    dtype: str = "auto"
    weights: str = "auto"
    kv_dtype: str = "auto"
    lm_head: str = "auto"
    activations: str = "int16"
    device: str = "auto"
    cuda_graphs: bool = True  # taken for the command line's sake: a traced run is always eager (graphs skip the probe)
    threads: int | None = None
    speculative: str | None = None  # speculative decoding's proposer: the trace shows each step's proposals
    num_speculative_tokens: int | None = None
    raw: bool = False
    system: str | None = None
    top_k: int = 5  # candidates shown per step
    html: Path | None = None
    compare: tuple[str, ...] = ()
    branch: tuple[str, ...] = ()
    engine: int = 0  # requests of the prompt run as a batch for the engine view (0: off)
    arrive_every: int = 2
    kv_cache_bytes: int | None = None
    max_num_batched_tokens: int = 2048


def trace(prompt: str, params: SamplingParams, options: TraceOptions, console: Console | None = None) -> int:
    from nextoken.llm import LLM
    from nextoken.trace.cost import machine_peaks
    from nextoken.trace.summary import summarize

    if not 1 <= options.top_k <= 100:
        raise NextokenError(f"invalid --top {options.top_k}: must be between 1 and 100")
    if options.compare and options.html is not None:
        raise NextokenError("--html and --compare cannot be combined: --html shows one traced run")
    if options.compare and options.branch:
        raise NextokenError("--compare and --branch cannot be combined: give one of them")
    settings = [parse_setting(s, params) for s in options.compare]  # bad settings fail before the model loads
    branches = [parse_setting(s, params) for s in options.branch]
    if len(branches) > 8:
        raise NextokenError(f"--branch takes at most 8 settings, got {len(branches)}")
    if options.html is not None and not options.html.parent.is_dir():
        raise NextokenError(f"cannot write {options.html}: no such directory {options.html.parent}")
    console = console or make_console()
    if options.engine:
        return _engine_view(prompt, params, options, console)
    llm = LLM(options.model, dtype=options.dtype, weights=options.weights, kv_dtype=options.kv_dtype,
              lm_head=options.lm_head, activations=options.activations, device=options.device,
              enable_prefix_caching=False, cuda_graphs=False, threads=options.threads,
              speculative=options.speculative, num_speculative_tokens=options.num_speculative_tokens)
    if branches:
        from nextoken.trace.branch import print_branches, run_branches, write_branch_html

        prompt_ids, done = run_branches(llm, prompt, list(options.branch), branches, raw=options.raw,
                                        system=options.system)
        print_branches(console, llm, prompt_ids, done)
        if options.html is not None:
            path = write_branch_html(options.html, prompt, prompt_ids, done, llm.tokenizer.display_piece)
            console.print(f"\nwrote {path} ({path.stat().st_size / 1024:,.0f} KiB, self-contained)")
        return 0
    if settings:
        runs = [run_request(llm, prompt, p, raw=options.raw, system=options.system,
                            tracer=RecordingTracer(top_k=options.top_k)) for p in settings]
        print_compare(console, llm, list(options.compare), runs)
        return 0
    baseline = run_request(llm, prompt, params, raw=options.raw, system=options.system, tracer=NullTracer())
    tracer = RecordingTracer(top_k=options.top_k, capture_attention=options.html is not None)
    run = run_request(llm, prompt, params, raw=options.raw, system=options.system, tracer=tracer)
    runner = llm.engine.runner
    weight_dtype = cast("DecoderBlock", runner.model.layers[0]).attn.qkv_proj.weight.dtype
    summary = summarize(llm, run, baseline, machine_peaks(runner.device, weight_dtype))
    print_report(console, llm, run, summary, options.top_k)
    if options.html is not None:
        from nextoken.trace.html import write_html

        path = write_html(options.html, llm, run, summary)
        console.print(f"\nwrote {path} ({path.stat().st_size / 1024:,.0f} KiB, self-contained)")
    return 0


def _engine_view(prompt: str, params: SamplingParams, options: TraceOptions, console: Console) -> int:
    from nextoken.llm import LLM
    from nextoken.trace.engine_view import print_engine_view, run_engine_view

    if not 1 <= options.engine <= 26 or options.arrive_every < 0:
        raise NextokenError(f"invalid --engine {options.engine} / --arrive-every {options.arrive_every}: 1 to 26 "
                            "requests, arriving every 0 or more steps")
    if options.compare or options.branch:
        raise NextokenError("--engine shows a batch: not with --compare or --branch")
    llm = LLM(options.model, dtype=options.dtype, weights=options.weights, kv_dtype=options.kv_dtype,
              lm_head=options.lm_head, activations=options.activations, device=options.device,
              threads=options.threads, kv_cache_bytes=options.kv_cache_bytes, speculative=options.speculative,
              num_speculative_tokens=options.num_speculative_tokens,
              max_num_batched_tokens=options.max_num_batched_tokens)
    view = run_engine_view(llm, prompt, params, options.engine, arrive_every=options.arrive_every, raw=options.raw,
                           system=options.system)
    bm = llm.engine.block_manager
    print_engine_view(console, view, bm.num_blocks, bm.block_size)
    if options.html is not None:
        from nextoken.trace.pages import engine_page
        path = engine_page(options.html, view, bm.num_blocks, bm.block_size)
        console.print(f"\nwrote {path} ({path.stat().st_size / 1024:,.0f} KiB, self-contained)")
    return 0


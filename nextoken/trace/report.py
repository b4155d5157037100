"""The trace in the terminal: numbered sections in pipeline order (input, embedding and positions, blocks, output,
cost, tracing overhead), and the side-by-side table of `--compare`.

Everything the model or the user wrote (prompt, pieces, generated text) goes to rich as `Text`, never as markup, so
a token such as "[bold]" prints as itself. Piped output gets a fixed width (no terminal to measure) and no colour.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from nextoken.models.probe import FUSED_BLOCKS, MODULES, NATIVE_STEP, PATHS
from nextoken.trace.replay import Agreement
from nextoken.trace.run import RunResult
from nextoken.trace.speculation import print_speculation
from nextoken.trace.summary import ReplaySummary, Summary, positional_scheme
from nextoken.trace.tracer import STAGES, RecordingTracer

PIPED_WIDTH = 120
MAX_TOKEN_ROWS = 64  # longer prompts show their first and last tokens only
STAGE_LABELS = {"tokenize": "tokenize (chat template + encode)", "schedule": "schedule + batch",
                "embedding": "embedding", "blocks": "transformer blocks", "lm_head": "final norm + LM head",
                "sampling": "sampling", "detokenize": "detokenize + update", "trace": "tracer's own work"}
PATH_LABELS = {NATIVE_STEP: "the whole step in one native call, greedy rows' argmax included",
               FUSED_BLOCKS: "every block in one native call", MODULES: "the torch modules, block by block"}


def make_console(file: Any = None) -> Console:
    console = Console(file=file, highlight=False)
    if not console.is_terminal:
        console = Console(file=file, width=PIPED_WIDTH, highlight=False)
    return console


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.2f}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"


def show_piece(tokenizer: Any, token_id: int) -> str:
    """A piece in quotes with control characters escaped: ' the', '\\n', '<0xE4>' (one byte of a character)."""
    piece = tokenizer.display_piece(token_id)
    escaped = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in piece)
    return f"'{escaped}'"


def piece_hex(tokenizer: Any, token_id: int) -> str:
    data = tokenizer.piece_bytes(token_id)
    return "" if data.isascii() else data.hex(" ")


def describe_paths(paths: dict[str, dict[str, int]], native_gaps: Sequence[str] = ()) -> str:
    """"prefill: 1 step on fused blocks; decode: 15 steps on native step (fused blocks: ...; native step: ...)", and
    where steps ran on the modules because the model has parts the native step lacks, which."""
    phases = [f"{phase}: " + ", ".join(f"{n} step{'s' * (n != 1)} on {path}" for path, n in counts.items())
              for phase, counts in paths.items() if counts]
    used = [p for p in PATHS if any(p in counts for counts in paths.values())]
    text = "; ".join(phases) + " (" + "; ".join(f"{p}: {PATH_LABELS[p]}" for p in used) + ")"
    if native_gaps and MODULES in used:
        text += f"; this model runs on the modules: the native step has no {', '.join(native_gaps)}"
    return text


def describe_replay(r: ReplaySummary) -> str:
    """How the fused steps' re-runs on the module path (for the attention maps) compared with the steps."""
    verdict = "agree with" if r.agree else "do NOT agree with"
    return (f"attention maps: the {r.num_steps} steps that ran fused were re-run on the module path (over a private "
            f"copy of their cache) to see inside their layers, and the re-runs {verdict} the fused steps, value by "
            f"value; closest to its bar: {describe_agreement(r.closest)}")


def describe_agreement(a: Agreement) -> str:
    """"a logit 2.9e-06 apart (its bar 0.031), a K/V value 1.2e-06 apart (its bar 0.002)"."""
    logits = "" if a.logits_diff is None else f"a logit {a.logits_diff:.2g} apart (its bar {a.logits_bar:.2g}), "
    return f"{logits}a K/V value {a.kv_diff:.2g} apart (its bar {a.kv_bar:.2g})"


def _heading(console: Console, title: str) -> None:
    console.print()
    console.print(Rule(Text(title, style="bold cyan"), align="left"))


def print_report(console: Console, llm: Any, run: RunResult, summary: Summary, top_k: int) -> None:
    """Every section, in pipeline order, for a run recorded by a RecordingTracer."""
    tracer = run.tracer
    assert isinstance(tracer, RecordingTracer)
    _input(console, llm, run)
    _embedding(console, llm, summary)
    _blocks(console, llm, tracer, summary)
    _output(console, llm, run, summary, tracer, top_k)
    _cost(console, summary)
    _overhead(console, summary)


def _input(console: Console, llm: Any, run: RunResult) -> None:
    tok = llm.tokenizer
    _heading(console, "1. Input")
    console.print(Panel(Text(run.prompt_text), title="prompt as rendered", title_align="left", expand=False))
    table = Table(title="tokenization", title_justify="left", show_edge=False)
    for col, justify in (("pos", "right"), ("id", "right"), ("piece", "left"), ("bytes", "left"), ("", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    ids = run.prompt_ids
    shown = list(range(len(ids))) if len(ids) <= MAX_TOKEN_ROWS else \
        list(range(MAX_TOKEN_ROWS - 16)) + [-1] + list(range(len(ids) - 16, len(ids)))
    for pos in shown:
        if pos < 0:
            table.add_row("…", "", Text(f"{len(ids) - MAX_TOKEN_ROWS} more"), "", "")
            continue
        tid = ids[pos]
        table.add_row(str(pos), str(tid), Text(show_piece(tok, tid)), piece_hex(tok, tid),
                      "special" if tid in tok.special_ids else "")
    console.print(table)
    chars = len(run.prompt_text)
    console.print(f"{len(ids)} tokens, {chars} characters: {chars / max(len(ids), 1):.2f} characters per token "
                  f"({tok.kind} vocabulary of {tok.vocab_size:,})")


def _embedding(console: Console, llm: Any, s: Summary) -> None:
    cfg = llm.model_config
    _heading(console, "2. Embedding and positions")
    e = s.embedding
    scale = f", then x {e['scale']:.3f} (sqrt(hidden))" if e["scale"] != 1.0 else ""
    console.print(f"embedding table [{e['shape'][0]:,} x {e['shape'][1]:,}] {e['dtype']}, {human_bytes(e['bytes'])}: "
                  f"one row per token id{scale}; measured {ms(s.stage_prefill_s['embedding'])} ms in prefill, "
                  f"{ms(s.stage_decode_s['embedding'] / max(s.num_decode_steps, 1))} ms per decode step")
    table = Table(title="rotary position embedding (RoPE, neox layout: dim i pairs with i + d/2)",
                  title_justify="left", show_edge=False)
    for col in ("layers", "attention", "base θ", "rotated dims", "scaling"):
        table.add_column(col)
    for row in positional_scheme(cfg):
        table.add_row(row["layers"], row["attention"], f"{row['theta']:,.0f}",
                      f"{row['rotated_dims']} of {row['head_dim']}", row["scaling"])
    console.print(table)


def _blocks(console: Console, llm: Any, tracer: RecordingTracer, s: Summary) -> None:
    cfg = llm.model_config
    _heading(console, "3. Blocks")
    decode_steps = max(s.num_decode_steps, 1)
    stages = Table(title=f"time per stage ({s.num_prefill_tokens} prompt tokens in prefill, {s.num_decode_steps} "
                         "decode steps)", title_justify="left", show_edge=False)
    for col in ("stage", "prefill ms", "decode ms", "ms per decode step", "total ms", "share"):
        stages.add_column(col, justify="left" if col == "stage" else "right")
    for stage in STAGES:
        total = s.stage_s[stage]
        stages.add_row(STAGE_LABELS[stage], ms(s.stage_prefill_s[stage]), ms(s.stage_decode_s[stage]),
                       ms(s.stage_decode_s[stage] / decode_steps), ms(total), f"{total / s.total_s:.1%}")
    accounted = sum(s.stage_s.values())
    stages.add_row("not in any stage (driver loop)", "", "", "", ms(s.total_s - accounted),
                   f"{(s.total_s - accounted) / s.total_s:.1%}", style="dim")
    stages.add_row(Text("measured total", style="bold"), "", "", "", ms(s.total_s), "100%")
    console.print(stages)
    console.print(f"stages add up to {s.coverage:.1%} of the measured total")
    console.print(f"forward passes, on the paths an untraced run takes: {describe_paths(s.paths, s.native_gaps)}")
    layers = Table(title="per layer (attention / feed-forward / norms and residuals): from the native calls' own "
                         "counters where steps ran fused, from module hooks where the modules ran",
                   title_justify="left", show_edge=False)
    for col in ("layer", "attention span", "prefill attn ms", "prefill ffn ms", "prefill other ms",
                "decode attn ms/step", "decode ffn ms/step", "decode other ms/step"):
        layers.add_column(col, justify="right" if "ms" in col or col == "layer" else "left")
    pre, dec = tracer.layer_seconds("prefill"), tracer.layer_seconds("decode")
    for i in range(cfg.num_layers):
        span = f"window {cfg.sliding_window}" if cfg.layer_is_sliding[i] else "global"
        layers.add_row(str(i), span, ms(pre["attn"][i]), ms(pre["mlp"][i]), ms(pre["other"][i]),
                       ms(dec["attn"][i] / decode_steps), ms(dec["mlp"][i] / decode_steps),
                       ms(dec["other"][i] / decode_steps))
    console.print(layers)
    _router(console, llm, tracer)


def _router(console: Console, llm: Any, tracer: RecordingTracer) -> None:
    """A mixture of experts' choices: for each step's last row (the one that draws), each layer's experts and their
    weights."""
    steps = [s for s in tracer.steps if s.router]
    if not steps:
        return
    layers = sorted(steps[0].router)
    table = Table(title="router: the experts each step's last row took (expert x weight), per mixture-of-experts "
                        "layer; that row's output drew the token shown", title_justify="left", show_edge=False)
    table.add_column("step", justify="right")
    table.add_column("drew")
    for i in layers:
        table.add_column(f"layer {i}")
    for step in steps[:MAX_TOKEN_ROWS]:
        token = step.sample.token_id if step.sample is not None else None
        cells = [" ".join(f"{e}x{w:.2f}" for e, w in zip(*step.router[i])) if i in step.router else "-"
                 for i in layers]
        table.add_row(str(step.index), "-" if token is None else show_piece(llm.tokenizer, token), *cells)
    console.print(table)


def _output(console: Console, llm: Any, run: RunResult, s: Summary, tracer: RecordingTracer, top_k: int) -> None:
    tok = llm.tokenizer
    p = run.params
    _heading(console, "4. Output")
    h = s.lm_head
    console.print(f"LM head [{h['shape'][0]:,} x {h['shape'][1]:,}] {h['dtype']}, {human_bytes(h['bytes'])}"
                  f"{' (tied: the embedding table)' if h['tied'] else ''}: final hidden state -> one logit per "
                  f"vocabulary entry, computed for the sampled row only")
    if h.get("quantized"):
        console.print("  decode rows: int8 codes per 32 values (two 4-bit kernel calls) for the whole vocabulary, "
                      "then the 32 highest logits recomputed in fp32")
    how = "greedy (argmax after penalties)" if p.is_greedy else \
        f"temperature {p.temperature:g}, top-k {p.top_k or 'off'}, top-p {p.top_p:g}, min-p {p.min_p:g}, seed {p.seed}"
    console.print(f"sampling: {how}; p raw = softmax of the logits, p final = the distribution drawn from")
    show_temp = not p.is_greedy and p.temperature != 1.0  # else "after temperature" repeats raw
    table = Table(show_edge=False, title=f"every step: the top-{top_k} candidates under the raw distribution "
                  "(the drawn one in green)", title_justify="left")
    for col in ("step", "drawn", "p raw", "p final", "rank", "H raw", "H final", "kept"):
        table.add_column(col, justify="left" if col == "drawn" else "right")
    table.add_column(f"candidate: raw{' -> after temperature' if show_temp else ''} -> final")
    for i, rec in enumerate(tracer.samples):
        cands = Table.grid(padding=(0, 1))  # one aligned line per candidate
        for justify in ("left", "right", "right", "right"):
            cands.add_column(justify=justify)  # type: ignore[arg-type]
        for cid, pr, pt, pf in zip(rec.top_ids, rec.raw_probs, rec.temp_probs, rec.final_probs):
            cands.add_row(Text(show_piece(tok, cid)), f"{pr:6.1%}", f"-> {pt:6.1%}" if show_temp else "",
                          f"-> {pf:6.1%}", style="bold green" if cid == rec.token_id else "")
        table.add_row(str(i), Text(show_piece(tok, rec.token_id), style="bold"), f"{rec.drawn_raw_prob:.3f}",
                      f"{rec.drawn_final_prob:.3f}", str(rec.drawn_rank), f"{rec.entropy_raw:.2f}",
                      f"{rec.entropy_final:.2f}", f"{rec.num_kept:,}", cands)
    console.print(table)
    console.print("H = entropy in bits; kept = tokens left with nonzero probability after top-k/top-p/min-p")
    _effects(console, tok, tracer.samples)
    if tracer.speculation:
        print_speculation(console, tok, tracer.speculation)
    console.print(Panel(Text(run.text), title=f"generated ({len(run.output_ids)} tokens, finish: "
                                              f"{run.finish_reason})", title_align="left", expand=False))


def describe_effect(tok: Any, e: Any) -> str:
    """One processor's effect at a step, in words: what it changed, and for a grammar what it allowed."""
    if e.num_allowed is not None:
        shown = ", ".join(show_piece(tok, i) for i in e.allowed_ids)
        more = "" if e.num_allowed <= len(e.allowed_ids) else ", ..."
        return f"allowed {e.num_allowed:,} tokens ({shown}{more}), -inf on {e.num_changed:,}"
    shown = ", ".join(show_piece(tok, i) for i in e.ids) + ("" if e.num_changed <= len(e.ids) else ", ...")
    return f"changed {e.num_changed:,} logit{'' if e.num_changed == 1 else 's'} ({shown})"


def _effects(console: Console, tok: Any, samples: list[Any]) -> None:
    """Per step, each logits processor that changed a logit (the likeliest tokens it touched), and what a grammar
    allowed."""
    rows = [(i, e) for i, rec in enumerate(samples) for e in rec.effects]
    if not rows:
        return
    table = Table(show_edge=False, title="logits processors: what each changed at every step (tokens by raw "
                  "probability)", title_justify="left")
    for col in ("step", "processor", "effect"):
        table.add_column(col, justify="right" if col == "step" else "left")
    for i, e in rows[:MAX_TOKEN_ROWS * 2]:
        table.add_row(str(i), e.name, Text(describe_effect(tok, e)))
    console.print(table)


def _rate(value: float | None, peak: float | None, unit: str) -> str:
    if value is None:
        return "-"
    share = f" ({value / peak:.1%} of peak)" if peak else ""
    return f"{value:,.2f} {unit}{share}"


def _cost(console: Console, s: Summary) -> None:
    cfg = s.cost.config
    _heading(console, "5. Cost")
    t, b = s.timings, s.baseline_timings or {}
    table = Table(show_edge=False)
    table.add_column("")
    table.add_column("untraced", justify="right")
    table.add_column("traced", justify="right")
    table.add_row("time to first token", ms(b.get("time_to_first_token_s")) + " ms",
                  ms(t.get("time_to_first_token_s")) + " ms")
    for key, label in (("prefill_tokens_per_s", "prefill tokens/s"), ("decode_tokens_per_s", "decode tokens/s")):
        table.add_row(label, f"{b[key]:,.1f}" if b.get(key) else "-", f"{t[key]:,.1f}" if t.get(key) else "-")
    console.print(table)
    kv_bytes = s.kv_bytes_per_token / (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim)
    num_tokens = s.num_prefill_tokens + s.num_decode_steps
    console.print(f"KV cache per token: 2 x {cfg.num_layers} layers x {cfg.num_kv_heads} kv heads x {cfg.head_dim} "
                  f"head dim x {kv_bytes:g} bytes = {s.kv_bytes_per_token:,} B; this request: {num_tokens} tokens "
                  f"= {human_bytes(num_tokens * s.kv_bytes_per_token)}")
    console.print(f"allocated: pool {human_bytes(s.kv_pool_bytes)}; this request held {s.blocks_used} blocks x "
                  f"{human_bytes(s.kv_block_bytes)} = {human_bytes(s.blocks_used * s.kv_block_bytes)}")
    c = s.cost
    console.print(f"FLOPs per token = 2 x {c.matmul_params / 1e6:,.1f} M matmul parameters + 4 x layers x context x "
                  f"heads x head dim (nanoGPT estimate_mfu / PaLM appendix B, forward only); LM head only on "
                  f"sampled rows")
    peaks = s.peaks
    gemm, copy = (peaks.gemm_gflops, peaks.copy_gbps) if peaks else (None, None)
    rates = Table(show_edge=False)
    for col in ("phase", "GFLOP", "GB moved (weights + KV)", "forward s", "achieved GFLOP/s", "achieved GB/s"):
        rates.add_column(col, justify="left" if col == "phase" else "right")
    rates.add_row("prefill", f"{s.prefill_flops / 1e9:,.3f}", f"{s.prefill_bytes / 1e9:,.3f}",
                  f"{s.prefill_forward_s:.4f}", _rate(s.prefill_gflops, gemm, "GFLOP/s"),
                  _rate(s.prefill_gbps, copy, "GB/s"))
    rates.add_row("decode", f"{s.decode_flops / 1e9:,.3f}", f"{s.decode_bytes / 1e9:,.3f}",
                  f"{s.decode_forward_s:.4f}", _rate(s.decode_gflops, gemm, "GFLOP/s"),
                  _rate(s.decode_gbps, copy, "GB/s"))
    console.print(rates)
    if peaks:
        console.print(f"machine peaks: {peaks.gemm_gflops:,.1f} GFLOP/s ({peaks.gemm_size}² GEMM, {peaks.gemm_by}), "
                      f"{peaks.copy_gbps:,.1f} GB/s (copy); {'cached, ' if peaks.cached else ''}measured "
                      f"{peaks.measured_at} on {peaks.key}")


def _overhead(console: Console, s: Summary) -> None:
    _heading(console, "Tracing overhead")
    if s.baseline_s is None:
        console.print("no untraced run to compare with")
    else:
        console.print(f"untraced run {ms(s.baseline_s)} ms, traced run {ms(s.total_s)} ms "
                      f"({s.total_s / s.baseline_s:.2f}x; {ms(s.stage_s['trace'])} ms of it the tracer's own work "
                      f"between steps)")
        verdict = "yes" if s.same_tokens else "NO" if s.deterministic else "no (sampling without a seed)"
        console.print(f"same tokens as the untraced run: {verdict}")
    if s.replay is not None:
        console.print(describe_replay(s.replay))


def print_compare(console: Console, llm: Any, labels: list[str], runs: list[RunResult]) -> None:
    """One column per setting; each cell the drawn piece and the entropy (bits) raw -> as sampled."""
    tok = llm.tokenizer
    _heading(console, "Sampling settings compared")
    table = Table(show_edge=False, show_lines=False)
    table.add_column("step", justify="right")
    for label in labels:
        table.add_column(Text(label), overflow="fold")
    samples = [r.tracer.samples for r in runs]
    for i in range(max(len(x) for x in samples)):
        cells: list[Any] = [str(i)]
        for recs in samples:
            if i >= len(recs):
                cells.append("")
                continue
            rec = recs[i]
            cells.append(Text(f"{show_piece(tok, rec.token_id)}  H {rec.entropy_raw:.2f}->{rec.entropy_final:.2f} "
                              f"p {rec.drawn_final_prob:.2f}"))
        table.add_row(*cells)
    table.add_row("text", *(Text(r.text) for r in runs), style="bold")
    console.print(Group(table, Text("H = entropy in bits of the raw distribution -> of the one drawn from; "
                                    "p = probability of the drawn token as sampled")))

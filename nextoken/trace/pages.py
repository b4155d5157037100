"""Small self-contained HTML pages for the glass box's other views (diff, check, the engine view): tables and bars
in one file, no script and no network, readable in any browser and checked in headless Chromium by the tests."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STYLE = """body{font:14px system-ui,sans-serif;background:#fafafa;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
th{background:#eee}.num{text-align:right;font-variant-numeric:tabular-nums}.bar{display:inline-block;height:10px;
background:#225ea8;vertical-align:middle}.note{color:#666}.map{font-family:monospace;line-height:1.1;
letter-spacing:1px;white-space:pre}h2{margin-top:1.5em}"""


def esc(value: Any) -> str:
    return html.escape(str(value))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Sequence[int] = ()) -> str:
    """Rows of cells (already HTML where they are `Raw`, else escaped); `numeric`: right-aligned columns."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td class=\"num\">{_cell(c)}</td>" if i in numeric else f"<td>{_cell(c)}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


class Raw(str):
    """HTML to put in a cell as it is."""


def _cell(value: Any) -> str:
    return value if isinstance(value, Raw) else esc(value)


def bar(fraction: float, width: int = 240) -> Raw:
    """A horizontal bar of `fraction` (0..1) of `width` pixels."""
    return Raw(f"<span class=\"bar\" style=\"width:{max(1, round(width * min(max(fraction, 0.0), 1.0)))}px\"></span>")


def write_page(path: Path, title: str, sections: Sequence[str]) -> Path:
    page = (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{esc(title)}</title><style>{STYLE}</style>"
            f"</head><body><h1>{esc(title)}</h1>{''.join(sections)}</body></html>\n")
    path.write_text(page, encoding="utf-8")
    return path


def diff_page(path: Path, report: Any, piece: Any, lines: Sequence[str]) -> Path:
    """`nextoken diff --html`: the summary, each layer's relative difference as a bar (log scale), and per
    generated position the two runs' tokens, KL and agreement."""
    import math

    def scale(x: float) -> float:  # 1e-8 .. 1 on a log scale
        return 0.0 if x <= 0 else (math.log10(max(x, 1e-8)) + 8) / 8

    summary = "".join(f"<p>{esc(line)}</p>" for line in lines[:-1])
    layers = table(["layer", "max relative difference", ""],
                   [("embedding" if d.layer == -1 else d.layer, f"{d.relative:.2e}",
                     bar(scale(d.relative))) for d in report.layers], numeric=(1,))
    rows = []
    for i, kl in enumerate(report.kl):
        a = piece(report.tokens_a[i])
        b = piece(report.tokens_b[i]) if i < len(report.tokens_b) else "(ended)"
        mark = "" if i < len(report.tokens_b) and report.tokens_b[i] == report.tokens_a[i] else " ≠"
        rows.append((i, repr(a), repr(b) + mark, f"{kl:.3e}", "yes" if report.agree[i] else "no", bar(scale(kl))))
    positions = table(["step", "A's token", "B's token", "KL(A || B)", "same top-1", ""], rows, numeric=(0, 3))
    return write_page(path, "nextoken diff", [
        summary, "<h2>Hidden states, layer by layer</h2><p class=\"note\">the largest relative difference over the "
        "sequence between the two runs' outputs of each layer (log scale, 1e-8 to 1)</p>", layers,
        "<h2>Per position, teacher-forced on A's tokens</h2>", positions])


def check_page(path: Path, model: str, prompts: Sequence[str], reports: Sequence[Any], piece: Any) -> Path:
    """`nextoken check --html`: the formats' agreement and KL against fp32, and the prompts checked."""
    rows = []
    worst_kl = max((r.worst_kl for r in reports), default=0.0) or 1.0
    for r in reports:
        where = "-" if r.worst_at is None else f"prompt {r.worst_at[0]}, position {r.worst_at[1]} " \
                                               f"({piece(r.worst_at[2])!r})"
        rows.append((r.name, ", ".join(f"{k} {v}" for k, v in r.formats.items()), f"{r.top1:.2%}",
                     f"{r.mean_kl:.3e}", f"{r.worst_kl:.3e}", bar(r.worst_kl / worst_kl, 160), where))
    return write_page(path, f"nextoken check: {model}", [
        "<p class=\"note\">each format against nextoken's fp32 route, teacher-forced over the prompts below and the "
        "fp32 route's continuations; KL in nats over the whole vocabulary</p>",
        table(["format", "runs as", "top-1 agreement", "mean KL", "worst KL", "", "worst at"], rows,
              numeric=(2, 3, 4)),
        "<h2>Prompts</h2>", table(["#", "prompt"], list(enumerate(prompts)), numeric=(0,))])


def engine_page(path: Path, observer: Any, num_blocks: int, block_size: int) -> Path:
    """`trace --engine --html`: the steps as a table and the block map after each step that changed it."""
    from nextoken.trace.engine_view import block_map, describe_ran

    rows = []
    for s in observer.steps:
        events = [f"{x} arrives" for x in s.arrived] + [f"{x} preempted" for x in s.preempted] + \
            [f"{x} finished ({why})" for x, why in s.finished]
        rows.append((s.index, f"{s.seconds * 1e3:.1f}", ", ".join(describe_ran(r) for r in s.ran), "; ".join(events),
                     " ".join(f"{k}:{len(v)}" for k, v in s.blocks.items()), s.free_blocks))
    used = max((b for s in observer.steps for t in s.blocks.values() for b in t), default=0) + 1
    maps = []
    previous = None
    for s in observer.steps:
        cells = "".join(block_map(s, num_blocks))[:used]
        if cells != previous:
            maps.append((s.index, Raw(f"<span class=\"map\">{esc(cells)}</span>")))
            previous = cells
    return write_page(path, "nextoken trace --engine", [
        table(["step", "ms", "ran", "events", "blocks held", "free"], rows, numeric=(0, 1, 5)),
        f"<h2>Block map</h2><p class=\"note\">the pool's first {used} of {num_blocks} blocks ({block_size} tokens "
        "each) after each step that changed them: a letter, the request holding the block; *, shared; ., free or "
        "cached</p>", table(["after step", "blocks"], maps, numeric=(0,))])


def replay_page(path: Path, result: Any, piece: Any) -> Path:
    """`nextoken replay --html`: the record's tokens beside the replay's, step by step, the first difference marked."""
    rows = []
    for i, (then, lp_then, now, lp_now) in enumerate(result.steps):
        same = then == now
        mark = "" if same else " ≠" if i == result.first_difference else " (after)"
        rows.append((i, "-" if then < 0 else repr(piece(then)), "-" if then < 0 else f"{lp_then:.4f}",
                     "-" if now is None else repr(piece(now)) + mark, "-" if lp_now is None else f"{lp_now:.4f}",
                     "yes" if same else "no"))
    return write_page(path, "nextoken replay", [
        f"<p>{esc(result.message)}</p>",
        table(["step", "recorded", "log p", "replayed", "log p", "same"], rows, numeric=(0, 2, 4))])

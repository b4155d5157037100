"""`nextoken trace --branch`: one prompt, prefilled once, continued under several sampling settings side by side.

The first setting's request computes the prompt; the others take its blocks (`LLMEngine.add_request`'s
`share_prompt_with`: references to its full blocks, a copy of the one holding its last token, which each branch
computes alone for logits of its own), so every branch starts from the same prefix and the prompt is computed once.
Then, for every step, each branch's probability, under its own sampling distribution at that step (the sampler's
stages: penalties, processors, temperature, top-k, top-p, min-p), of its own token and of the tokens the other
branches drew there: how likely one setting found another's choice. Those distributions are read from one
teacher-forced pass per branch over its own tokens (`ModelRunner.score`).
"""

from __future__ import annotations

import html
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nextoken.engine.inputs import Chat
from nextoken.errors import NextokenError
from nextoken.sampling_params import SamplingParams
from nextoken.trace.probs import sampling_distributions

if TYPE_CHECKING:
    from nextoken.llm import LLM

_ids = itertools.count()


@dataclass
class Branch:
    label: str  # a letter: A, B, ...
    setting: str  # as given
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    computed_prompt_tokens: int = 0  # prompt tokens this branch's request computed itself
    own: list[float] = field(default_factory=list)  # per step: the probability of its own token, as sampled
    others: list[dict[str, float]] = field(default_factory=list)  # per step: other branch label -> its token's


def run_branches(llm: LLM, prompt: str, labels: list[str], settings: list[SamplingParams], *, raw: bool = False,
                 system: str | None = None) -> tuple[list[int], list[Branch]]:
    engine = llm.engine
    if engine.has_unfinished():
        raise NextokenError("the engine is running other requests; a trace needs it to itself")
    _, prompt_ids = llm.inputs.prompt_ids(prompt if raw else Chat.turn(prompt, system), special_tokens=True)
    branches = [Branch(chr(ord("A") + i), label, p) for i, (label, p) in enumerate(zip(labels, settings))]
    ids: list[str] = []
    try:
        for b in branches:
            ids.append(engine.add_request(prompt_ids, b.params, f"branch-{next(_ids)}",
                                          share_prompt_with=ids[0] if ids else None))
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        done: set[str] = set()
        while len(done) < len(ids):
            for out in engine.step():
                if out.request_id in texts:
                    texts[out.request_id].append(out.new_text)
                    if out.finished and out.request is not None:
                        done.add(out.request_id)
                        b = branches[ids.index(out.request_id)]
                        req = out.request
                        b.token_ids, b.finish_reason = list(req.output_ids), req.finish_reason
                        b.computed_prompt_tokens = req.num_prompt_tokens - req.timings.num_cached_prompt_tokens
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.release_threads()
    for rid, b in zip(ids, branches):
        b.text = "".join(texts[rid])
    first = len(prompt_ids) - 1
    for b in branches:
        logits = engine.runner.score(prompt_ids + b.token_ids)
        for i, token in enumerate(b.token_ids):
            _, _, final = sampling_distributions(logits[first + i], b.params, prompt_ids, b.token_ids[:i])
            b.own.append(float(final[token]))
            b.others.append({o.label: float(final[o.token_ids[i]]) for o in branches
                             if o is not b and i < len(o.token_ids)})
    return prompt_ids, branches


def write_branch_html(path: Path, prompt: str, prompt_ids: list[int], branches: list[Branch], piece: object) -> Path:
    """A self-contained page: the branches side by side, a row per step (no script, no network)."""
    show = piece  # type: ignore[assignment]
    head = "".join(f"<th>{b.label}: {html.escape(b.setting)}</th>" for b in branches)
    rows = []
    for i in range(max(len(b.token_ids) for b in branches)):
        cells = []
        for b in branches:
            if i >= len(b.token_ids):
                cells.append("<td></td>")
                continue
            others = ", ".join(f"{html.escape(k)} {v:.3f}" for k, v in b.others[i].items())
            same = all(o.token_ids[i:i + 1] == b.token_ids[i:i + 1] for o in branches)
            cells.append(f"<td class=\"{'same' if same else 'apart'}\"><span class=\"tok\">"
                         f"{html.escape(repr(show(b.token_ids[i])))}</span> <span class=\"p\">p {b.own[i]:.3f}"  # type: ignore[operator]
                         f"</span><div class=\"others\">{others}</div></td>")
        rows.append(f"<tr><td class=\"step\">{i}</td>{''.join(cells)}</tr>")
    texts = "".join(f"<td class=\"text\">{html.escape(b.text)}</td>" for b in branches)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>nextoken branches</title><style>
body{{font:14px system-ui,sans-serif;background:#fafafa;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ddd;padding:4px 8px;vertical-align:top}} .apart{{background:#fff3d6}}
.tok{{font-family:monospace;font-weight:bold}} .p{{color:#225ea8}} .others{{color:#777;font-size:12px}}
.step{{color:#999;text-align:right}} .text{{white-space:pre-wrap;max-width:30em}}</style></head><body>
<h1>Branches of one prompt</h1><p class="prompt">{html.escape(prompt)} ({len(prompt_ids)} tokens, computed once,
shared by every branch)</p><table><tr><th>step</th>{head}</tr>{''.join(rows)}<tr><td>text</td>{texts}</tr></table>
<p>p: the branch's probability of its own token as it sampled; below, its probability of the other branches' tokens
at that step. Shaded: the branches drew different tokens there.</p></body></html>
"""
    path.write_text(page, encoding="utf-8")
    return path


def print_branches(console: object, llm: LLM, prompt_ids: list[int], branches: list[Branch]) -> None:
    from rich.table import Table
    from rich.text import Text

    from nextoken.trace.report import show_piece

    tok = llm.tokenizer
    own = [b.computed_prompt_tokens for b in branches]
    table = Table(show_edge=False, title=f"branches: the prompt's {len(prompt_ids)} tokens computed once ({own[0]} by "
                  f"the first branch; the others took its blocks and computed {max(own[1:], default=0)} each), then "
                  "each setting on its own", title_justify="left")
    table.add_column("step", justify="right")
    for b in branches:
        table.add_column(Text(f"{b.label}: {b.setting}"), overflow="fold")
    for i in range(max(len(b.token_ids) for b in branches)):
        cells: list[str | Text] = [str(i)]
        for b in branches:
            if i >= len(b.token_ids):
                cells.append("")
                continue
            same = all(o.token_ids[i:i + 1] == b.token_ids[i:i + 1] for o in branches)
            others = " ".join(f"{k} {v:.3f}" for k, v in b.others[i].items())
            cells.append(Text(f"{show_piece(tok, b.token_ids[i])} p {b.own[i]:.3f}\n", style="" if same else "bold")
                         + Text(others, style="dim"))
        table.add_row(*cells)
    table.add_row("text", *(Text(b.text) for b in branches), style="bold")
    console.print(table)  # type: ignore[attr-defined]
    console.print("p: the branch's probability of its own token as it sampled; dim: its probability of each other "  # type: ignore[attr-defined]
                  "branch's token at that step (by letter); bold: the branches drew different tokens there")

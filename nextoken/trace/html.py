"""The trace as one self-contained HTML page: inline CSS, JavaScript and data, no network fetch of any kind.

The page shows the prompt and generated tokens (generated ones coloured by the probability of the drawn token); a
click on a token shows its top-K alternatives and the path its step took and, for the layer and head chosen in the
selectors, its attention over the context as a heatmap (one cell per context token), beside the prompt's full
attention matrix, with a note of where the maps came from (the run's own modules, or fused steps re-run on them);
below, a timeline of the stages. Attention rows are stored as uint8 relative to each row's maximum (base64), with the maxima beside
them. Data goes in as JSON with <, > and & escaped, and the script only ever sets textContent, so no token can
inject markup.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import torch

from nextoken.models.probe import MODULES
from nextoken.trace.replay import Agreement
from nextoken.trace.report import (PATH_LABELS, describe_agreement, describe_effect, describe_paths, describe_replay,
                                   show_piece)
from nextoken.trace.run import RunResult
from nextoken.trace.speculation import describe_totals
from nextoken.trace.summary import Summary
from nextoken.trace.tracer import STAGES, RecordingTracer

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:20px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:18px 0 6px} .muted{color:#777}
#tokens{background:#fff;border:1px solid #ddd;padding:10px;line-height:2.1;white-space:pre-wrap}
.tok{padding:2px 1px;margin:0 1px;border-radius:3px;cursor:pointer;border:1px solid transparent}
.tok.prompt{background:#eee;color:#555} .tok.special{color:#a33} .tok.sel{border-color:#000}
.tok.accepted{text-decoration:underline dotted #225ea8 2px}
#panel{display:flex;gap:24px;flex-wrap:wrap;margin-top:10px}
#panel>div{background:#fff;border:1px solid #ddd;padding:10px;min-width:280px}
table{border-collapse:collapse} td,th{padding:2px 8px;text-align:right} td:first-child,th:first-child{text-align:left}
.bar{display:inline-block;height:9px;background:#4a7} .drawn{font-weight:bold;background:#efe}
#heat{display:flex;flex-wrap:wrap;gap:2px;max-width:900px}
.cell{font:11px monospace;padding:3px 4px;border:1px solid #ccc;min-width:14px;text-align:center}
#timeline{position:relative;background:#fff;border:1px solid #ddd;padding:6px 6px 6px 150px}
.lane{position:relative;height:18px;margin:2px 0} .lane b{position:absolute;left:-145px;font-weight:normal}
.seg{position:absolute;top:2px;height:14px;min-width:1px}
"""

_COLORS = {"tokenize": "#8c6bb1", "schedule": "#999", "embedding": "#41b6c4", "blocks": "#225ea8",
           "lm_head": "#fd8d3c", "sampling": "#e31a1c", "detokenize": "#78c679", "trace": "#ccc"}

_JS = r"""
const D = JSON.parse(document.getElementById('trace-data').textContent);
const $ = id => document.getElementById(id);
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
function bytes(b64) { const s = atob(b64); const a = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) a[i] = s.charCodeAt(i); return a; }
function probColor(p) { return 'hsl(' + Math.round(120 * p) + ',70%,78%)'; }
let selected = null;
function attentionRow(q, layerSlot, head) {
  const row = D.attention.rows[q];
  if (!row) return null;
  const v = bytes(row.w), n = q + 1, H = D.attention.heads;
  const off = (layerSlot * H + head) * n, scale = row.scale[layerSlot * H + head];
  return Array.from(v.slice(off, off + n), x => ({rel: x / 255, w: x / 255 * scale}));
}
function showHeat() {
  const heat = $('heat'); heat.textContent = '';
  if (selected === null) return;
  const t = D.tokens[selected];
  const q = t.gen ? t.pos - 1 : t.pos;
  const slot = +$('layer').value, head = +$('head').value;
  $('heat-title').textContent = 'attention of the query at position ' + q + ' (' +
    (t.gen ? 'the step that produced this token' : 'this token') + '), layer ' + D.attention.layers[slot] +
    ', head ' + head;
  const row = attentionRow(q, slot, head);
  if (!row) { heat.appendChild(el('span', {class: 'muted'}, 'no attention row kept for this position')); return; }
  row.forEach((c, i) => {
    const cell = el('div', {class: 'cell', title: i + ' ' + D.tokens[i].text + ': ' + c.w.toFixed(4)},
                    D.tokens[i].text.replace(/\n/g, '\u21b5').trim() || '\u00b7');
    cell.style.background = 'rgba(34,94,168,' + c.rel.toFixed(3) + ')';
    if (c.rel > 0.55) cell.style.color = '#fff';
    heat.appendChild(cell);
  });
  drawMatrix(slot, head);
}
function drawMatrix(slot, head) {
  const cv = $('matrix'), n = D.num_prompt, px = Math.max(2, Math.min(12, Math.floor(360 / n)));
  cv.width = cv.height = n * px;
  const ctx = cv.getContext('2d');
  ctx.fillStyle = '#fff'; ctx.fillRect(0, 0, cv.width, cv.height);
  for (let q = 0; q < n; q++) {
    const row = attentionRow(q, slot, head);
    if (!row) continue;
    row.forEach((c, k) => { ctx.fillStyle = 'rgba(34,94,168,' + c.rel.toFixed(3) + ')';
                            ctx.fillRect(k * px, q * px, px, px); });
  }
}
function select(i) {
  if (selected !== null) $('tok-' + selected).classList.remove('sel');
  selected = i; $('tok-' + i).classList.add('sel');
  const t = D.tokens[i], alt = $('alts'); alt.textContent = '';
  alt.appendChild(el('h2', {}, 'token ' + t.pos + ": '" + t.text.replace(/\n/g, '\u21b5') + "' (id " + t.id + ')'));
  if (t.gen) {
    const s = D.steps[t.step];
    alt.appendChild(el('div', {class: 'muted'}, 'entropy ' + s.h_raw.toFixed(2) + ' bits raw, ' +
      s.h_final.toFixed(2) + ' as sampled; ' + s.kept + ' tokens kept'));
    alt.appendChild(el('div', {class: 'muted path'}, 'computed on: ' + s.path));
    if (s.replay) alt.appendChild(el('div', {class: 'muted'}, s.replay));
    for (const e of s.effects) alt.appendChild(el('div', {class: 'muted effect'}, e));
    if (s.spec) alt.appendChild(el('div', {class: 'muted spec'}, 'speculative decoding: ' + s.spec));
    const tb = el('table'), pct = x => x === null ? '-' : (100 * x).toFixed(1) + '%';
    tb.appendChild(el('tr')).append(el('th', {}, 'candidate'), el('th', {}, 'raw'), el('th', {}, 'after T'),
                                    el('th', {}, 'final'), el('th'));
    s.cands.forEach(c => {
      const tr = el('tr', c[4] ? {class: 'drawn'} : {});
      const bar = el('span', {class: 'bar'}); bar.style.width = Math.round(c[3] * 120) + 'px';
      const td = el('td'); td.appendChild(bar);
      tr.append(el('td', {}, c[0]), el('td', {}, pct(c[1])), el('td', {}, pct(c[2])), el('td', {}, pct(c[3])), td);
      tb.appendChild(tr);
    });
    alt.appendChild(tb);
  } else alt.appendChild(el('div', {class: 'muted'}, 'a prompt token'));
  showHeat();
}
function build() {
  $('generated').textContent = D.text;
  $('paths').textContent = 'forward passes: ' + D.paths;
  $('attn-note').textContent = D.attention.source;
  if (D.speculation) $('paths').after(el('div', {id: 'spec', class: 'muted'}, D.speculation));
  const box = $('tokens');
  D.tokens.forEach((t, i) => {
    const s = el('span', {id: 'tok-' + i, class: 'tok ' + (t.gen ? 'gen' : 'prompt') + (t.special ? ' special' : '') +
                          (t.accepted ? ' accepted' : ''),
                          title: 'pos ' + t.pos + ', id ' + t.id + (t.gen ? ', p ' + t.p.toFixed(3) : '')},
                 t.text.replace(/\n/g, '\u21b5\n'));  // a visible mark for newline tokens
    if (t.gen) s.style.background = probColor(t.p);
    s.onclick = () => select(i);
    box.appendChild(s);
  });
  D.attention.layers.forEach((l, slot) => $('layer').appendChild(el('option', {value: slot}, 'layer ' + l)));
  for (let h = 0; h < D.attention.heads; h++) $('head').appendChild(el('option', {value: h}, 'head ' + h));
  $('layer').onchange = $('head').onchange = showHeat;
  const lanes = $('timeline');
  D.timeline.stages.forEach(stage => {
    const lane = el('div', {class: 'lane'}); lane.appendChild(el('b', {}, stage.name + ' ' +
      (stage.total * 1e3).toFixed(1) + ' ms'));
    stage.spans.forEach(sp => {
      const seg = el('div', {class: 'seg', title: stage.name + ': ' + ((sp[1] - sp[0]) * 1e3).toFixed(3) + ' ms'});
      seg.style.left = (100 * sp[0] / D.timeline.total) + '%';
      seg.style.width = (100 * (sp[1] - sp[0]) / D.timeline.total) + '%';
      seg.style.background = stage.color; lane.appendChild(seg);
    });
    lanes.appendChild(lane);
  });
  const first = D.tokens.findIndex(t => t.gen);
  select(first >= 0 ? first : D.tokens.length - 1);
}
build();
"""


def _replay_text(a: Agreement) -> str:
    return (f"its attention maps come from a re-run of this step on the module path, which "
            f"{'agrees' if a.agrees else 'does NOT agree'}; closest to its bar: {describe_agreement(a)}")


def _attention_data(tracer: RecordingTracer, summary: Summary) -> dict[str, Any]:
    capture = tracer.attention
    if capture is None:
        return {"layers": [], "heads": 0, "rows": {}, "source": "no attention maps were kept"}
    modules = sum(s.path == MODULES for s in tracer.steps)
    source = (f"computed from the q and k of the torch modules: {modules} step{'s' * (modules != 1)} ran on them. "
              if modules else "")
    if summary.replay is not None:
        source += describe_replay(summary.replay)
    rows: dict[str, Any] = {}
    for pos, weights in capture.rows.items():
        w = weights.float()  # [layers, heads, pos + 1]
        peak = w.amax(dim=-1, keepdim=True).clamp(min=1e-12)
        quantized = (w / peak * 255).round().to(torch.uint8)
        rows[str(pos)] = {"w": base64.b64encode(quantized.numpy().tobytes()).decode("ascii"),
                          "scale": [round(x, 6) for x in peak.flatten().tolist()]}
    return {"layers": capture.layers, "heads": capture.num_heads, "rows": rows, "source": source}


def page_data(llm: Any, run: RunResult, summary: Summary) -> dict[str, Any]:
    """Everything the page's script reads: tokens (prompt, then generated), per-step candidates, attention rows
    keyed by query position, and the stage spans for the timeline (seconds since the run began)."""
    tracer = run.tracer
    assert isinstance(tracer, RecordingTracer)
    tok = llm.tokenizer
    tokens: list[dict[str, Any]] = []
    for pos, tid in enumerate(run.prompt_ids):
        tokens.append({"pos": pos, "id": tid, "text": tok.display_piece(tid), "gen": False,
                       "special": tid in tok.special_ids})
    steps = []
    # One entry per generated token: a step verifying proposals yields several, each with a note of how it came.
    made = [(step, rec, note) for step in tracer.steps
            for rec, note in zip(step.samples, step.speculation.token_notes(tok) if step.speculation is not None
                                 else [None] * len(step.samples))]
    for i, (step, rec, note) in enumerate(made):
        tokens.append({"pos": len(run.prompt_ids) + i, "id": rec.token_id, "text": tok.display_piece(rec.token_id),
                       "gen": True, "special": rec.token_id in tok.special_ids, "p": rec.drawn_raw_prob, "step": i,
                       "accepted": note is not None and note.startswith("proposed by")})
        cands = [[show_piece(tok, c), pr, pt, pf, c == rec.token_id]
                 for c, pr, pt, pf in zip(rec.top_ids, rec.raw_probs, rec.temp_probs, rec.final_probs)]
        if rec.token_id not in rec.top_ids:  # drawn from outside the top K: still show it
            cands.append([show_piece(tok, rec.token_id), rec.drawn_raw_prob, None, rec.drawn_final_prob, True])
        steps.append({"cands": cands, "h_raw": rec.entropy_raw, "h_final": rec.entropy_final, "kept": rec.num_kept,
                      "path": f"{step.path} ({PATH_LABELS[step.path]})",
                      "replay": None if step.replay is None else _replay_text(step.replay),
                      "effects": [f"{e.name}: {describe_effect(tok, e)}" for e in rec.effects],
                      "spec": note})
    lanes = []
    for stage in STAGES:
        spans = [list(tracer.spans[stage])] if stage in tracer.spans else []
        spans += [list(s.spans[stage]) for s in tracer.steps if stage in s.spans]
        lanes.append({"name": stage, "color": _COLORS[stage], "total": summary.stage_s[stage], "spans": spans})
    return {"model": summary.model_name, "num_prompt": len(run.prompt_ids), "tokens": tokens, "steps": steps,
            "attention": _attention_data(tracer, summary), "timeline": {"total": run.total_s, "stages": lanes},
            "text": run.text, "paths": describe_paths(summary.paths, summary.native_gaps),
            "speculation": _speculation_text(tracer)}


def _speculation_text(tracer: RecordingTracer) -> str | None:
    """The run's speculative decoding in one line (None without it); accepted proposals are underlined."""
    if not tracer.speculation:
        return None
    return (describe_totals([r for _, r in tracer.speculation]) + " (accepted proposals underlined). Select a "
            "token for how it came.")


def render_html(llm: Any, run: RunResult, summary: Summary) -> str:
    """The whole page as one string (a few hundred KiB for a short run)."""
    data = page_data(llm, run, summary)
    # Escaped so that no string in the data can close the <script> element or open a comment.
    payload = json.dumps(data).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    title = f"nextoken trace: {summary.model_name}"
    p = run.params
    how = "greedy" if p.is_greedy else f"temperature {p.temperature:g}, top-k {p.top_k}, top-p {p.top_p:g}"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{_escape(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{_escape(title)}</h1><div class=\"muted\">{len(run.prompt_ids)} prompt tokens, "
        f"{len(run.output_ids)} generated ({_escape(how)}), {run.total_s * 1e3:,.1f} ms; generated tokens are "
        "coloured by the probability of the drawn token (red low, green high). Click a token.</div>"
        "<div id=\"paths\" class=\"muted\"></div>"
        "<h2>Tokens</h2><div id=\"tokens\"></div><div class=\"muted\">generated text: "
        "<span id=\"generated\"></span></div>"
        "<div id=\"panel\"><div id=\"alts\"></div><div><h2>Attention</h2>"
        "<div id=\"attn-note\" class=\"muted\"></div>"
        "<label>layer <select id=\"layer\"></select></label> <label>head <select id=\"head\"></select></label>"
        "<div id=\"heat-title\" class=\"muted\"></div><div id=\"heat\"></div>"
        "<h2>Prompt attention matrix (query rows, key columns)</h2><canvas id=\"matrix\"></canvas></div></div>"
        "<h2>Timeline of the stages</h2><div id=\"timeline\"></div>"
        f"<script id=\"trace-data\" type=\"application/json\">{payload}</script><script>{_JS}</script>"
        "</body></html>\n")


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def write_html(path: str | Path, llm: Any, run: RunResult, summary: Summary) -> Path:
    path = Path(path)
    path.write_text(render_html(llm, run, summary), encoding="utf-8")
    return path

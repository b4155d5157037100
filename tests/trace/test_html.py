"""The HTML page in a real browser: headless Chromium loads the file (no network), runs its script, and the rendered
DOM holds every token and a heatmap of computed cells; a screenshot shows a page, not a blank.

Chromium is a test requirement (Debian package `chromium`, installed by scripts/setup.sh): when it is missing the
test fails, it does not skip, so a machine without it cannot pass the suite by accident.
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from nextoken import LLM, SamplingParams
from nextoken.sampling_params import StructuredOutputs
from nextoken.trace.command import TraceOptions, trace
from nextoken.trace.report import make_console
from tests.conftest import needs_native
from tests.tiny import write_tiny_model
from tests.trace.png import read_png

# Markup, a character split into byte-level pieces, and quotes: all must come out as text.
PROMPT = '<b>bold</b> & "quotes" 你 </script>'
MAX_TOKENS = 6


def chromium() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if path is None:
        pytest.fail("headless Chromium is required for the HTML trace test and was not found: install the Debian "
                    "package `chromium` (scripts/setup.sh does)")
    return path


def run_chromium(page: Path, tmp: Path, *extra: str, height: int = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp / 'profile'}",
         f"--window-size=1280,{height}", *extra, page.as_uri()],
        capture_output=True, text=True, timeout=60)


class _Dom(HTMLParser):
    """Collects the token spans (class list, text) and heatmap cells (style) of the rendered DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[tuple[str, str]] = []
        self.cells: list[str] = []
        self.segments = 0
        self.scripts_outside_head: list[str] = []
        self._open: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "span" and "tok" in classes:
            self.tokens.append((" ".join(classes), ""))
            self._open.append("tok")
        elif tag == "div" and "cell" in classes:
            self.cells.append(a.get("style") or "")
        elif tag == "div" and "seg" in classes:
            self.segments += 1
        if tag == "script" and a.get("id") != "trace-data":
            self.scripts_outside_head.append(a.get("id") or "")

    def handle_data(self, data: str) -> None:
        if self._open:
            classes, text = self.tokens[-1]
            self.tokens[-1] = (classes, text + data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "span" and self._open:
            self._open.pop()


@pytest.fixture(scope="module")
def page(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LLM]:
    out = tmp_path_factory.mktemp("html") / "trace.html"
    console = make_console(io.StringIO())
    trace(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
          TraceOptions(model=str(tiny_llama), device="cpu", html=out), console)
    return out, LLM(str(tiny_llama), device="cpu", kv_cache_bytes=1 << 20)


def test_page_is_self_contained(page: tuple[Path, LLM]) -> None:
    html = page[0].read_text(encoding="utf-8")
    for needle in ("http://", "https://", " src=", "<link", "@import", "url("):
        assert needle not in html, needle
    assert html.count("</script>") == 2  # the data and the code: the prompt's "</script>" is escaped


def test_rendered_dom_has_the_tokens_and_a_heatmap(page: tuple[Path, LLM], tmp_path: Path) -> None:
    path, llm = page
    result = run_chromium(path, tmp_path, "--dump-dom")
    assert result.returncode == 0, result.stderr[-2000:]
    dom = _Dom()
    dom.feed(result.stdout)
    prompt_ids = llm.render_chat([{"role": "user", "content": PROMPT}])[1]
    shown = [llm.tokenizer.display_piece(i).replace("\n", "\u21b5\n") for i in prompt_ids]
    prompt_tokens = [text for classes, text in dom.tokens if "prompt" in classes]
    generated = [text for classes, text in dom.tokens if "gen" in classes]
    assert prompt_tokens == shown  # every piece, in order, as text (markup and bytes included)
    assert len(generated) == MAX_TOKENS
    assert any("sel" in classes for classes, _ in dom.tokens)  # the page opens on a selected token...
    assert result.stdout.count('<tr class="drawn">') == 1  # ...with its alternatives, the drawn one marked
    # The first generated token was produced by the query at the prompt's last position: one cell per key.
    assert len(dom.cells) == len(prompt_ids)
    # Each cell's colour is the heatmap blue at the weight's opacity (Chromium writes opacity 1 as plain rgb()).
    shades = [re.search(r"background: rgba?\(34, 94, 168(?:, ([\d.]+))?\)", style) for style in dom.cells]
    assert all(shades), dom.cells
    alphas = [float(m.group(1) or 1.0) for m in shades if m]
    assert max(alphas) == 1.0 and len(set(alphas)) > 3  # computed from the weights, not one flat colour
    assert dom.segments > 2 * MAX_TOKENS  # the timeline has a segment per stage per step
    assert dom.scripts_outside_head == [""]  # no script element came from the data


def test_screenshot_is_not_blank(page: tuple[Path, LLM], tmp_path: Path) -> None:
    shot = tmp_path / "trace.png"
    # A window tall enough for the whole page: how far down the attention matrix lands depends on the fonts
    # installed and on the tokens the tiny model drew, and at 900 px it can fall below the fold.
    result = run_chromium(page[0], tmp_path, f"--screenshot={shot}", height=3200)
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    pixels = read_png(shot)[..., :3].reshape(-1, 3).astype(int)
    background = np.array([250, 250, 250])  # the page's #fafafa
    assert (np.abs(pixels - background).sum(axis=1) > 30).mean() > 0.02  # a few percent of the page is drawn
    assert len(np.unique(pixels, axis=0)) > 50
    blue = (pixels[:, 2] > pixels[:, 0] + 60).sum()  # heatmap and matrix cells are shades of rgb(34, 94, 168)
    assert blue > 5000  # the prompt's attention matrix alone is over a hundred 5x5 cells this dark


@needs_native
def test_a_fused_run_says_where_its_maps_came_from(tmp_path: Path) -> None:
    """Steps that ran fused: the page names each step's path, and its attention section says the maps come from
    re-runs on the module path that agreed with the fused steps."""
    model = write_tiny_model(tmp_path / "tiny-llama-q8.gguf", "llama", table=GGMLQuantizationType.Q8_0)
    out = tmp_path / "trace.html"
    trace("the cat sat", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
          TraceOptions(model=str(model), device="cpu", weights="int4", html=out), make_console(io.StringIO()))
    result = run_chromium(out, tmp_path, "--dump-dom")
    assert result.returncode == 0, result.stderr[-2000:]
    text = re.sub(r"<[^>]+>", " ", result.stdout)
    assert "forward passes: prefill: 1 step on" in text and "decode: 2 steps on native step" in text
    assert "computed on: " in text  # the selected token's step
    assert re.search(r"were re-run on the module path \(over a private copy of their cache\) to see inside their "
                     r"layers, and the re-runs agree with the fused steps", text)
    assert len(_cells(result.stdout)) > 0  # and the maps are there


def _cells(dom: str) -> list[str]:
    parsed = _Dom()
    parsed.feed(dom)
    return parsed.cells


def test_the_selected_step_says_what_the_grammar_allowed(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.html"
    params = SamplingParams(temperature=0, max_tokens=3, logit_bias={5: -2.0},
                            structured_outputs=StructuredOutputs(regex="[0-9]{3}"))
    trace("the cat sat", params, TraceOptions(model=str(tiny_llama), device="cpu", html=out),
          make_console(io.StringIO()))
    result = run_chromium(out, tmp_path, "--dump-dom")
    assert result.returncode == 0, result.stderr[-2000:]
    text = re.sub(r"<[^>]+>", " ", result.stdout)
    assert re.search(r"structured_outputs: allowed 10 tokens \('\d', '\d', '\d', '\d', '\d', '\d', \.\.\.\), "
                     r"-inf on [\d,]+", text), text[-3000:]
    assert "logit_bias: changed 1 logit (" in text

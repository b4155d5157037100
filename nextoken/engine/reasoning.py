"""Reasoning models: an answer's thinking section (`<think>` ... `</think>`, as Qwen3 and DeepSeek-R1 write it) apart
from its content, as text streams in.

A model thinks where its chat template knows the closing marker. Its answer may open the section itself (Qwen3), or
the template may have opened it at the end of the prompt (DeepSeek-R1: the generation prompt ends in `<think>`), so
the splitter starts inside it. A template switch such as Qwen3's `enable_thinking=False` writes an empty section
into the prompt, and the answer is all content. Markers may arrive split across deltas: text that could still be
the start of one is held back until it is told apart. The newlines a model writes right after a marker are layout,
not text, and are dropped.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def thinks(template_source: str | None) -> bool:
    """Whether a chat template has a thinking section (it closes one)."""
    return bool(template_source) and END in template_source  # type: ignore[operator]


def opened_by_prompt(prompt_text: str | None) -> bool:
    """Whether the rendered prompt leaves a thinking section open for the answer to continue."""
    if not prompt_text:
        return False
    return prompt_text.rfind(START) > prompt_text.rfind(END)


class ReasoningSplitter:
    """Text deltas of one answer -> (reasoning, content) deltas; `finish` returns what was held back."""

    def __init__(self, thinking: bool = False) -> None:
        self.state = "thinking" if thinking else "start"  # "start": the answer may still open a section
        self.opened = thinking  # whether the answer has a thinking section
        self._held = ""
        self._strip = thinking  # drop the newlines right after a marker

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = [], []
        buf = self._held + text
        self._held = ""
        while buf:
            if self.state == "start":
                body = buf.lstrip()
                if body.startswith(START):
                    buf, self.state, self._strip, self.opened = body[len(START):], "thinking", True, True
                    continue
                if START.startswith(body):  # blank, or a marker's beginning: wait for more
                    self._held = buf
                    break
                self.state = "content"
                continue
            if self._strip:
                buf = buf.lstrip("\n")
                if not buf:
                    break
                self._strip = False
            if self.state == "content":
                content.append(buf)
                break
            at = buf.find(END)  # thinking
            if at >= 0:
                reasoning.append(buf[:at].rstrip("\n"))
                buf, self.state, self._strip = buf[at + len(END):], "content", True
                continue
            keep = _partial_suffix(buf, END)
            # Newlines before a possible end are held too: they belong to the layout around the marker.
            cut = len(buf) - keep
            while cut > 0 and buf[cut - 1] == "\n":
                cut -= 1
            reasoning.append(buf[:cut])
            self._held = buf[cut:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The text held back, once the answer has ended: reasoning if a section is still open, else content."""
        held, self._held = self._held, ""
        if self.state == "thinking":
            return held.rstrip("\n"), ""
        return "", held if self.state == "content" else held.lstrip()


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (0: none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split(text: str, thinking: bool = False) -> tuple[str | None, str]:
    """A whole answer -> (its reasoning, or None where it has no thinking section; its content)."""
    splitter = ReasoningSplitter(thinking)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2 if splitter.opened else None), c1 + c2

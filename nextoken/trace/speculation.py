"""Speculative decoding in a trace: per decode step, who proposed which tokens, which the target's verifying pass
accepted or rejected, and why.

A step's proposals x_1..x_k are verified by rows 0..k of one pass: row j is sampled as plain decoding would sample
it after x_1..x_j, and x_(j+1) is accepted while it equals row j's draw (engine/speculative.py). So a proposal's
verdict is its row's draw: accepted (the target drew it: under sampling it had probability p(x) of that), rejected
(the target drew another token, which the step keeps instead), or unchecked (a proposal before it was rejected).
Proposals a draft drew from its own distribution q (unseeded sampling) meet the rejection rule instead
(engine/rejection.py): x is kept where the uniform u drawn for it has u q(x) < p(x), and at the first rejection the
step draws its token from the residual max(0, p - q). Their verdicts show p(x) (from the trace's own rows), q(x) and
u as the engine drew them. A step that proposed nothing says why: no earlier n-gram matched, the policy held its
offer back as not worth the pass, or max_tokens or the context left no room. Built from what the tracer saw at the
sampler (`SpecRecord.build`), never from the engine's own bookkeeping (but for the rule's q and u), so a trace
checks the engine rather than repeats it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from nextoken.engine.rejection import RuleTrail
from nextoken.engine.spec_policy import SpecChoice
from nextoken.trace.probs import SampleRecord

MAX_STEP_ROWS = 64  # steps listed in the terminal (the page shows every token)


@dataclass(frozen=True)
class Verdict:
    """One proposal at its verifying row."""

    token_id: int  # proposed
    # Its probability at the row: under the distribution drawn from (the chance of its acceptance), or for greedy
    # rows, whose draw is the argmax, the model's own (softmax of the logits).
    target_prob: float
    drawn_id: int  # what the row drew (under the rejection rule: what the step kept there)
    drawn_prob: float
    status: str  # "accepted" | "rejected" | "unchecked"
    # Under the rejection rule: the draft's probability of the proposal, and the uniform drawn for it.
    draft_prob: float | None = None
    uniform: float | None = None


@dataclass
class SpecRecord:
    """A decode step of a request under speculative decoding."""

    proposer: str  # "ngram" | "draft:MODEL" | "self:L"
    choice: SpecChoice | None  # the speculator's offer and its k (None: not recorded)
    match: tuple[int, int] | None  # prompt lookup: (n of the matched n-gram, position the proposals copy from)
    verdicts: list[Verdict] = field(default_factory=list)
    # The tokens the step yields after its first: the accepted proposals' rows' successors (rows 1..m).
    kept: list[SampleRecord] = field(default_factory=list)

    @property
    def num_accepted(self) -> int:
        return sum(v.status == "accepted" for v in self.verdicts)

    @property
    def sampled(self) -> bool:
        """Whether the proposals met the rejection rule (drawn from a draft's distribution)."""
        return any(v.draft_prob is not None for v in self.verdicts)

    @classmethod
    def build(cls, proposer: str, choice: SpecChoice | None, match: tuple[int, int] | None,
              rows: list[SampleRecord], proposed: list[int], greedy: bool,
              trail: RuleTrail | None = None) -> SpecRecord:
        """From the step's sampled rows of this request (row 0, then one per proposal; each with `probs_of` its
        proposal; under the rejection rule, rows 0..m describe the tokens the step kept) and the proposals, with the
        rule's decisions where it applied (`trail`)."""
        assert len(rows) == len(proposed) + 1
        verdicts: list[Verdict] = []
        rejected = False
        for j, (x, row) in enumerate(zip(proposed, rows)):
            decision = trail.decisions[j] if trail is not None and j < len(trail.decisions) else None
            if trail is not None:
                status = "unchecked" if rejected or decision is None else "accepted" if decision.kept else "rejected"
            else:
                status = "unchecked" if rejected else "accepted" if row.token_id == x else "rejected"
            rejected = rejected or status == "rejected"
            raw, final = row.probs_of[x]
            drawn = row.drawn_raw_prob if greedy else row.drawn_final_prob
            verdicts.append(Verdict(x, raw if greedy else final, row.token_id, drawn, status,
                                    None if decision is None else decision.q,
                                    None if decision is None else decision.u))
        record = cls(proposer, choice, match, verdicts)
        record.kept = rows[1:record.num_accepted + 1]
        return record

    def reason(self, tokenizer: Any) -> str:
        """Why the step verified what it did, in words."""
        c = self.choice
        if not self.verdicts:
            if c is None:
                return "not decoding by itself this step"
            if c.room <= 0:
                return "no room: max_tokens or the context's end is reached with the next token"
            if c.available == 0:
                return "no proposal: no earlier n-gram (2 or more tokens) ends the sequence"
            return (f"held back: {c.available} on offer, but what this sequence's proposals have yielded so far "
                    "does not pay for a pass of more rows (checked aside meanwhile; k adapts)")
        head = f"{len(self.verdicts)} proposed by {self.proposer}"
        if self.match is not None:
            head += f" (after a repeated {self.match[0]}-gram, copying from position {self.match[1]})"
        if c is not None and c.probe:
            head += " (a probe: this sequence's drafts are off and are tried again now and then)"
        elif c is not None and c.k < c.available:
            head += f", {c.available} on offer"
        if c is not None:
            head += f"; expected {c.expected:.2f} tokens from this pass"
        m = self.num_accepted
        if m == len(self.verdicts):
            return f"{head}; all accepted, and the target's next token taken with them"
        v = self.verdicts[m]
        if v.draft_prob is not None:
            return (f"{head}; {m} accepted, then {_piece(tokenizer, v.token_id)} rejected: u {v.uniform:.3f} >= "
                    f"p/q = {v.target_prob:.3f}/{v.draft_prob:.3f}, and the target drew "
                    f"{_piece(tokenizer, v.drawn_id)} from the residual max(0, p - q)")
        return (f"{head}; {m} accepted, then {_piece(tokenizer, v.token_id)} rejected: the target drew "
                f"{_piece(tokenizer, v.drawn_id)} (p {v.drawn_prob:.3f}; the proposal had p {v.target_prob:.3f})")

    def token_notes(self, tokenizer: Any) -> list[str]:
        """One note per token this step yields (row 0, then the kept rows): how it came."""
        notes = []
        for j in range(self.num_accepted + 1):
            if j < self.num_accepted:
                v = self.verdicts[j]
                notes.append(f"proposed by {self.proposer}, accepted: " + (
                    f"u {v.uniform:.3f} < p/q = {v.target_prob:.3f}/{v.draft_prob:.3f}" if v.draft_prob is not None
                    else f"the target drew it (p {v.target_prob:.3f})"))
            elif j < len(self.verdicts):
                v = self.verdicts[j]
                notes.append(f"drawn from the residual max(0, p - q) after rejecting the proposal "
                             f"{_piece(tokenizer, v.token_id)} (u {v.uniform:.3f} >= p/q = {v.target_prob:.3f}/"
                             f"{v.draft_prob:.3f})" if v.draft_prob is not None else
                             f"the target's own draw after rejecting the proposal {_piece(tokenizer, v.token_id)} "
                             f"(p {v.target_prob:.3f})")
            elif self.verdicts:
                notes.append(f"the target's next token after all {len(self.verdicts)} proposals were accepted")
            else:
                notes.append(f"no proposal: {self.reason(tokenizer)}")
        return notes


def _piece(tokenizer: Any, token_id: int) -> str:
    return repr(tokenizer.display_piece(token_id))


def totals(records: list[SpecRecord]) -> dict[str, float]:
    """Steps that verified proposals, proposals, accepted ones, and the mean tokens a verifying step yielded."""
    verifying = [r for r in records if r.verdicts]
    proposed = sum(len(r.verdicts) for r in verifying)
    accepted = sum(r.num_accepted for r in verifying)
    return {"steps": len(records), "verifying": len(verifying), "proposed": proposed, "accepted": accepted,
            "rate": accepted / proposed if proposed else 0.0,
            "tokens_per_pass": (accepted + len(verifying)) / len(verifying) if verifying else 1.0}


def describe_totals(records: list[SpecRecord]) -> str:
    t = totals(records)
    return (f"speculative decoding ({records[0].proposer if records else '-'}): {t['proposed']:.0f} tokens proposed "
            f"over {t['verifying']:.0f} of {t['steps']:.0f} decode steps, {t['accepted']:.0f} accepted "
            f"({t['rate']:.0%}); {t['tokens_per_pass']:.2f} tokens per verifying pass")


def print_speculation(console: Console, tokenizer: Any, steps: list[tuple[int, SpecRecord]]) -> None:
    """The per-step table of proposals and verdicts, and the totals."""
    console.print(describe_totals([r for _, r in steps]))
    table = Table(show_edge=False, title="every decode step: proposals (accepted in green, rejected in red, "
                  "unchecked dim) and why", title_justify="left")
    for col in ("token", "proposals", "why"):
        table.add_column(col, justify="right" if col == "token" else "left")
    rows: list[tuple[str, Text, str]] = []
    for first_token, rec in steps:
        reason = rec.reason(tokenizer)
        if not rec.verdicts and rows and not rows[-1][1].plain.strip("- ") and rows[-1][2] == reason:
            rows[-1] = (f"{rows[-1][0].split('-')[0]}-{first_token}", rows[-1][1], reason)  # a run of the same
            continue
        shown = Text()
        for v in rec.verdicts:
            style = {"accepted": "green", "rejected": "bold red", "unchecked": "dim"}[v.status]
            shown.append(tokenizer.display_piece(v.token_id), style=style)
            shown.append(" ")
        rows.append((str(first_token), shown if rec.verdicts else Text("-", style="dim"), reason))
    for first, shown, reason in rows[:MAX_STEP_ROWS]:
        table.add_row(first, shown, Text(reason))
    console.print(table)
    if len(rows) > MAX_STEP_ROWS:
        console.print(f"... {len(rows) - MAX_STEP_ROWS} more rows")

"""The commands that compare: check (formats against the fp32 route), diff (two runs, where they part) and replay (a
recorded request run again). The command line itself: cli.py."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nextoken.errors import NextokenError


def cmd_check(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from nextoken.check import DEFAULT_FORMATS, DEFAULT_PROMPTS, format_kl, run_check

    prompts = list(DEFAULT_PROMPTS)
    if args.prompts is not None:
        try:
            text = sys.stdin.read() if args.prompts == "-" else Path(args.prompts).read_text(encoding="utf-8")
        except OSError as exc:
            raise NextokenError(f"--prompts {args.prompts}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise NextokenError(f"--prompts {args.prompts}: not UTF-8 text") from None
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
        if not prompts:
            raise NextokenError(f"--prompts {args.prompts}: no prompts in it (one per line)")
    formats = args.formats or list(DEFAULT_FORMATS)
    console = Console(stderr=True)
    sequences, reports = run_check(args.model, prompts, formats, continuation=args.continuation,
                                   against=args.against, engine_options={"threads": args.threads},
                                   progress=lambda line: console.print(f"[dim]{line}[/dim]"))
    if args.json:
        print(json.dumps({"model": args.model, "prompts": prompts, "positions": sum(len(s) for s in sequences),
                          "formats": [{"format": r.name, "resolved": r.formats, "top1_agreement": r.top1,
                                       "mean_kl": r.mean_kl, "worst_kl": r.worst_kl,
                                       "worst_at": None if r.worst_at is None else
                                       {"prompt": r.worst_at[0], "position": r.worst_at[1], "token_id": r.worst_at[2]}}
                                      for r in reports]}, ensure_ascii=False))
        return 0
    from nextoken.cli_support import load_text_side

    tok = load_text_side(args.model).tokenizer
    table = Table(title=f"{args.model}: each format against nextoken's fp32 route, teacher-forced over "
                        f"{len(prompts)} prompts and {args.continuation} generated tokens each "
                        f"({sum(len(s) for s in sequences):,} positions)", title_justify="left")
    for col in ("format", "runs as", "top-1 agreement", "mean KL", "worst KL", "worst at"):
        table.add_column(col, justify="right" if col in ("top-1 agreement", "mean KL", "worst KL") else "left")
    for r in reports:
        where = "-" if r.worst_at is None else \
            f"prompt {r.worst_at[0]}, position {r.worst_at[1]} ({tok.display_piece(r.worst_at[2])!r})"
        table.add_row(r.name, ", ".join(f"{k} {v}" for k, v in r.formats.items()), f"{r.top1:.2%}",
                      format_kl(r.mean_kl), format_kl(r.worst_kl), where)
    Console(width=max(Console().width, 140)).print(table)
    print("KL: KL(fp32 || format) in nats over the whole vocabulary, after each position; top-1: the same most "
          "likely next token")
    if args.html is not None:
        from nextoken.trace.pages import check_page
        print(f"wrote {check_page(Path(args.html), args.model, prompts, reports, tok.display_piece)}")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from nextoken.diff import describe, diff

    overrides = {k: v for k, v in (("weights", args.weights), ("kv_dtype", args.kv_dtype), ("lm_head", args.lm_head),
                                   ("activations", args.activations)) if v is not None}
    report, run_a = diff(args.a, args.b, model=args.model, overrides=overrides)
    lines = describe(report, run_a.tokenizer.display_piece)
    for line in lines:
        print(line)
    if args.html is not None:
        from nextoken.trace.pages import diff_page
        print(f"wrote {diff_page(Path(args.html), report, run_a.tokenizer.display_piece, lines)}")
    return 0 if report.first_divergence is None else 1


def cmd_replay(args: argparse.Namespace) -> int:
    from nextoken.engine.record import engine_settings, read_bundle
    from nextoken.llm import LLM

    bundle = read_bundle(args.bundle)
    model = args.model or bundle.data["model"]["path"]
    llm = LLM(model, **engine_settings(bundle))
    result = llm.replay(args.bundle)
    print(result.message)
    if args.html is not None:
        from nextoken.trace.pages import replay_page
        print(f"wrote {replay_page(Path(args.html), result, llm.tokenizer.display_piece)}")
    return 0 if result.identical else 1

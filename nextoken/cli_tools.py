"""The commands that look at models and text without generating: models, tokenize, detokenize, perplexity,
convert (the command line itself: cli.py)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from nextoken.cli_support import engine_options, load_text_side, read_text
from nextoken.errors import NextokenError


def cmd_models(args: argparse.Namespace) -> int:
    from nextoken.loader.gguf import read_gguf
    from nextoken.loader.registry import REGISTRY, is_installed, resolve_model
    from nextoken.models.config import ModelConfig

    rows = []
    for name, entry in REGISTRY.items():
        row: dict[str, Any] = {"name": name, "installed": is_installed(entry), "file": entry.filename,
                               "size_bytes": None, "architecture": None, "quantization": None, "parameters": None,
                               "install": entry.install}
        if row["installed"]:
            path = resolve_model(name)
            config = ModelConfig.from_gguf(read_gguf(path))
            row.update(file=str(path), size_bytes=path.stat().st_size, architecture=config.architecture,
                       quantization=config.quantization, parameters=config.num_parameters)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="nextoken models")
    for col in ("name", "installed", "architecture", "quantization", "parameters", "size", "file"):
        table.add_column(col, no_wrap=col != "file", overflow="fold")
    for r in rows:
        table.add_row(r["name"], "yes" if r["installed"] else f"no: {r['install']}", r["architecture"] or "-",
                      r["quantization"] or "-", f"{r['parameters'] / 1e6:.1f} M" if r["parameters"] else "-",
                      f"{r['size_bytes'] / 2**20:.1f} MiB" if r["size_bytes"] else "-", r["file"])
    console = Console()
    if not console.is_terminal:  # piped: no terminal width to fit, so never cut names short
        console = Console(width=200)
    console.print(table)
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from nextoken.engine.inputs import Chat

    inputs = load_text_side(args.model)
    tok = inputs.tokenizer
    text = read_text(args.text, "text")
    # Without --chat the text is the user's own: its special-token text is control tokens.
    rendered, ids = inputs.prompt_ids(Chat.turn(text) if args.chat else text, special_tokens=True)
    text = rendered if rendered is not None else text
    pieces = [tok.display_piece(i) for i in ids]
    if args.json:
        print(json.dumps({"model": args.model, "ids": ids, "pieces": pieces}, ensure_ascii=False))
        return 0
    for i, piece in zip(ids, pieces):
        print(f"{i:>8}  {piece!r}")
    print(f"{len(ids)} tokens, {len(text)} characters ({len(text) / max(len(ids), 1):.2f} characters per token)")
    return 0


def cmd_detokenize(args: argparse.Namespace) -> int:
    tok = load_text_side(args.model).tokenizer
    ids = []
    for raw in args.ids:
        try:
            ids.append(int(raw))
        except ValueError:
            raise NextokenError(f"token id {raw!r} is not an integer") from None
    print(tok.decode(ids))
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nextoken.llm import LLM

    if args.file == "-":
        text = read_text(None, "text")
    else:
        try:
            text = Path(args.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise NextokenError(f"cannot read {args.file}: {exc.strerror if isinstance(exc, OSError) else exc}") \
                from None
    llm = LLM(args.model, **engine_options(args))
    bar: Any = None
    if not args.json and sys.stderr.isatty():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("perplexity {task.fields[ppl]}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("windows"), TimeElapsedColumn(), transient=True)
        bar.start()
        task = bar.add_task("score", total=None, ppl="-")

    def progress(result: Any, done: int, total: int) -> None:
        if bar is not None:
            bar.update(task, total=total, completed=done, ppl=f"{result.value:.4f}")

    try:
        result = llm.perplexity(text, context=args.context, stride=args.stride, progress=progress)
    finally:
        if bar is not None:
            bar.stop()
    if args.json:
        print(json.dumps({"model": args.model, "perplexity": result.value, "tokens": result.tokens,
                          "scored": result.scored, "nll": result.nll, "windows": result.windows}))
    else:
        print(f"perplexity {result.value:.4f} over {result.scored} tokens ({result.windows} windows; mean "
              f"negative log-likelihood {result.nll / max(result.scored, 1):.4f} nats)")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from nextoken.loader.convert import convert

    result = convert(args.directory, args.out, args.type)
    types = ", ".join(f"{n} {t}" for t, n in sorted(result.types.items()))
    print(f"wrote {result.path}: {result.architecture}, {result.tensors} tensors ({types}), "
          f"{result.bytes / 2**20:,.1f} MiB")
    return 0

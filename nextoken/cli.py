"""The command line: run | chat | serve | trace | models | tokenize | detokenize.

Every user error (a NextokenError) prints one line on stderr and exits with code 2; nothing else is caught, so a
traceback always means a bug in nextoken.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from nextoken.errors import NextokenError
from nextoken.loader.registry import DEFAULT_MODEL

EXIT_USAGE = 2


def _read_text(arg: str | None, what: str) -> str:
    if arg is not None:
        return arg
    if sys.stdin is None or sys.stdin.isatty():
        raise NextokenError(f"no {what} given: pass it as an argument or on standard input")
    return sys.stdin.read()


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"a model name (see `nextoken models`), a path to a .gguf file, or a Hugging Face model "
                        f"directory (config.json, .safetensors, tokenizer.json) (default: {DEFAULT_MODEL})")


def _add_engine(p: argparse.ArgumentParser) -> None:
    _add_model(p)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="float weights (activations stay fp32)")
    p.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16", "int8", "int4"],
                   help="projection weights; auto: --dtype if given, else on CPU int4 for files whose projections "
                        "are all in blocks the kernels hold exactly (Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0: the file's "
                        "weights, a quarter of fp32's bytes), fp32 for others; bf16 on CUDA")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "fp32", "bf16", "int8"],
                   help="KV cache storage; int8 keeps a scale per 32 values (3.8x the tokens of fp32 in the same "
                        "memory); auto: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--lm-head", default="auto", choices=["auto", "fp32", "int8"],
                   help="decode's LM head; int8: a quarter of the bytes (the file's Q8_0 blocks as they are, or "
                        "requantized with its 32 best candidates recomputed in fp32); auto: int8 on CPU unless "
                        "--weights/--dtype ask for float weights")
    p.add_argument("--activations", default="int16", choices=["int16", "int8"],
                   help="how block weights meet the activations in prefill, batches of 12 or more and the LM head "
                        "from 16 rows: two levels of int16 codes per 32 values (fp32's precision), or int8 ones, outlier "
                        "columns in fp32 (products 1.3-1.5x faster on CPUs with AVX-512 VNNI; top-1 agreement "
                        "98.6-99.2%%, above transformers in bf16)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run decode steps op by op instead of replaying CUDA graphs")
    p.add_argument("--threads", "-t", type=int, default=None,
                   help="CPU threads for the kernels (default: one per physical core)")


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"dtype": args.dtype, "weights": args.weights, "kv_dtype": args.kv_dtype, "lm_head": args.lm_head,
            "activations": args.activations,
            "device": args.device, "cuda_graphs": not args.enforce_eager, "threads": args.threads}


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    p.add_argument("--top-k", type=int, default=0, help="0 turns it off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted once from tokens already output")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per occurrence from tokens already output")
    p.add_argument("--beam-width", type=int, default=None, metavar="W",
                   help="beam search with W beams instead of sampling (prints the best beam when it ends)")
    p.add_argument("--length-penalty", type=float, default=1.0,
                   help="beam search: scores are cumulative log-probability / length ** this")
    p.add_argument("--early-stopping", action="store_true",
                   help="beam search: stop as soon as W hypotheses are finished")
    p.add_argument("--logit-bias", type=_logit_bias, action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS in [-100, 100] to token ID's logit (repeatable; -100 bans, 100 forces)")
    p.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="no end-of-sequence token before N tokens were generated (stop strings may still end it)")
    p.add_argument("--bad-words", action="append", default=[], metavar="WORD",
                   help="never generate WORD (tokenized with and without a leading space; repeatable)")
    p.add_argument("--allowed-token-ids", type=_token_ids, default=None, metavar="ID,ID,...",
                   help="generate only these tokens; none given: any")


def _logit_bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if sep:
            return int(token), float(bias)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is not ID=BIAS (a token id and a number)")


def _token_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated token ids") from None


def _sampling_params(args: argparse.Namespace, inputs: Any, **extra: Any) -> Any:
    """The request's SamplingParams; `inputs` (the model's InputProcessor) tokenizes --bad-words and checks the
    processors' ids against the vocabulary. None: the rest only, to fail fast before a model loads."""
    from nextoken.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            seed=args.seed, stop=tuple(args.stop), beam_width=args.beam_width,
                            length_penalty=args.length_penalty, early_stopping=args.early_stopping,
                            logit_bias=dict(args.logit_bias), min_tokens=args.min_tokens,
                            bad_words=inputs.bad_words_ids(args.bad_words) if inputs is not None else (),
                            allowed_token_ids=args.allowed_token_ids, **extra)
    if inputs is not None:
        inputs.check_processor_ids(params)
    return params


def _load_text_side(model: str) -> Any:
    """The input processor of a model (its tokenizer, chat template and vocabulary) without loading its weights."""
    from nextoken.engine.engine import load_text_side
    from nextoken.engine.inputs import InputProcessor
    from nextoken.loader.registry import open_model, resolve_model
    from nextoken.models.config import ModelConfig

    gguf = open_model(resolve_model(model))
    config = ModelConfig.from_gguf(gguf)
    tokenizer, template = load_text_side(gguf, config)
    return InputProcessor(tokenizer, template, config.vocab_size)


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

    inputs = _load_text_side(args.model)
    tok = inputs.tokenizer
    text = _read_text(args.text, "text")
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
    tok = _load_text_side(args.model).tokenizer
    ids = []
    for raw in args.ids:
        try:
            ids.append(int(raw))
        except ValueError:
            raise NextokenError(f"token id {raw!r} is not an integer") from None
    print(tok.decode(ids))
    return 0


class _Answer:
    """An answer streamed to the terminal: a reasoning model's thinking section dimmed where stdout is a terminal, its
    parts kept apart (`reasoning`, `content`)."""

    DIM, RESET = "\x1b[2m", "\x1b[0m"

    def __init__(self, thinks: bool, prompt_text: str | None, echo: bool = True) -> None:
        from nextoken.engine.reasoning import ReasoningSplitter, opened_by_prompt

        self.splitter = ReasoningSplitter(opened_by_prompt(prompt_text)) if thinks else None
        self.echo, self.dim = echo, sys.stdout.isatty()
        self.reasoning, self.content = "", ""

    def add(self, text: str, finished: bool = False) -> None:
        if self.splitter is None:
            self.content += text
            self._write(text)
            return
        reasoning, content = self.splitter.feed(text)
        if finished:
            more = self.splitter.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        if reasoning:
            self._write(f"{self.DIM}{reasoning}{self.RESET}" if self.dim else reasoning)
        if content and not self.content and self.reasoning:
            self._write("\n\n")  # the thinking and the answer apart
        self.reasoning += reasoning
        self.content += content
        self._write(content)

    def _write(self, text: str) -> None:
        if self.echo and text:
            sys.stdout.write(text)
            sys.stdout.flush()


def cmd_run(args: argparse.Namespace) -> int:
    from nextoken.engine.inputs import Chat
    from nextoken.llm import LLM, request_timings

    prompt = _read_text(args.prompt, "prompt")
    _sampling_params(args, None, prompt_logprobs=args.prompt_logprobs)
    llm = LLM(args.model, **_engine_options(args))
    params = _sampling_params(args, llm.inputs, prompt_logprobs=args.prompt_logprobs)
    # --raw: the text as it is, the user's own (its special-token text control tokens); else one chat turn.
    chat = Chat.turn(prompt, args.system)
    if args.no_thinking:
        chat = Chat(chat.messages, template_kwargs={"enable_thinking": False})
    prepared = llm.inputs.process(prompt if args.raw else chat, params, special_tokens=True)
    ids = prepared.prompt_ids
    show = _Answer(llm.inputs.thinks and not args.raw, prepared.text, echo=not args.json)
    text, token_ids, last = [], [], None
    for out in llm.stream(ids, prepared.params[0]):
        show.add(out.new_text, finished=out.finished)
        text.append(out.new_text)
        token_ids.extend(out.new_token_ids)
        last = out
    assert last is not None and last.request is not None
    req = last.request
    if args.json:
        result: dict[str, Any] = {
            "model": args.model, "prompt_token_ids": ids, "token_ids": token_ids, "text": "".join(text),
            "finish_reason": req.finish_reason,
            **({"reasoning_content": show.reasoning, "content": show.content} if show.splitter else {}),
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(token_ids),
                      "total_tokens": len(ids) + len(token_ids)},
            "timings": request_timings(req),
        }
        if req.beams is not None:
            result["beams"] = [{"token_ids": h.token_ids,
                                "text": llm.tokenizer.decode(h.token_ids, skip_special_tokens=True),
                                "cumulative_logprob": h.cumulative_logprob, "finish_reason": h.finish_reason}
                               for h in req.beams]
        if args.prompt_logprobs is not None:
            result["prompt_logprobs"] = [[[i, lp] for i, lp in row] for row in req.prompt_logprobs]
            # Each prompt token's own [log p, rank] given those before it (null for the first).
            result["prompt_token_logprobs"] = [None if e is None else [e[0], e[1]] for e in req.prompt_token_logprobs]
        print(json.dumps(result, ensure_ascii=False))
    else:
        print()
        if args.verbose:
            t = request_timings(req)
            print(f"[{len(ids)} prompt tokens, {len(token_ids)} generated, finish: {req.finish_reason}, "
                  f"TTFT {t['time_to_first_token_s'] or 0:.3f} s, decode {t['decode_tokens_per_s'] or 0:.1f} tok/s]",
                  file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from nextoken.engine.inputs import Chat
    from nextoken.llm import LLM

    llm = LLM(args.model, **_engine_options(args))
    params = _sampling_params(args, llm.inputs)
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        messages.append({"role": "user", "content": line})
        kwargs = {"enable_thinking": False} if args.no_thinking else {}
        prepared = llm.inputs.process(Chat(messages, template_kwargs=kwargs), params)
        show = _Answer(llm.inputs.thinks, prepared.text)
        for out in llm.stream(prepared.prompt_ids, prepared.params[0]):
            show.add(out.new_text, finished=out.finished)
        print()
        # The history keeps the answers, not their thinking (as reasoning models' templates expect).
        messages.append({"role": "assistant", "content": show.content})


def cmd_perplexity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nextoken.llm import LLM

    if args.file == "-":
        text = _read_text(None, "text")
    else:
        try:
            text = Path(args.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise NextokenError(f"cannot read {args.file}: {exc.strerror if isinstance(exc, OSError) else exc}") \
                from None
    llm = LLM(args.model, **_engine_options(args))
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


def cmd_trace(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nextoken.trace.command import TraceOptions, trace

    prompt = _read_text(args.prompt, "prompt")
    options = TraceOptions(model=args.model, **_engine_options(args), raw=args.raw, system=args.system,
                           top_k=args.top, html=Path(args.html) if args.html else None,
                           compare=tuple(args.compare or ()))
    return trace(prompt, _sampling_params(args, _load_text_side(args.model)), options)


def cmd_serve(args: argparse.Namespace) -> int:
    from nextoken.config import EngineConfig
    from nextoken.server.bind import check_bind

    check_bind(args.host, args.api_key, args.allow_insecure_bind)  # before torch and the model load: fail fast
    from nextoken.server.serve import serve

    config = EngineConfig(model=args.model, **_engine_options(args), max_waiting=args.max_waiting,
                          kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
                          max_tokens_default=args.max_tokens_default)
    return serve(config, host=args.host, port=args.port, api_key=args.api_key,
                 allow_insecure_bind=args.allow_insecure_bind, drain_timeout=args.drain_timeout,
                 stream_timeout=args.stream_timeout, request_timeout=args.request_timeout)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, not a usage dump
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nextoken", description="An LLM inference engine that shows its work.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("run", help="answer one prompt, streaming the text",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("prompt", nargs="?", help="the prompt (read from standard input when absent)")
    _add_engine(p)
    _add_sampling(p)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--system", default=None, help="a system message for the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                   help="with --json: the top-K next-token log-probabilities at every prompt position, and each "
                        "prompt token's own log-probability and rank")
    p.add_argument("--verbose", "-v", action="store_true", help="print token counts and speed to stderr")
    p.add_argument("--no-thinking", action="store_true",
                   help="a reasoning model answers without its thinking section (the template's enable_thinking)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="a multi-turn chat in the terminal (/exit to leave)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_engine(p)
    _add_sampling(p)
    p.add_argument("--system", default=None)
    p.add_argument("--no-thinking", action="store_true", help="as for run")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("perplexity", help="score a text file: the model's perplexity on it, in windows")
    p.add_argument("file", help="a UTF-8 text file ('-': standard input)")
    _add_engine(p)
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="tokens per window (default: the context length, at most 1024)")
    p.add_argument("--stride", type=int, default=None, metavar="S",
                   help="tokens between the starts of two windows (default: half a window)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser("convert", help="write a Hugging Face model directory as a GGUF file")
    p.add_argument("directory", help="the directory: config.json, *.safetensors, tokenizer.json")
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--type", default="f16", choices=["f32", "f16", "bf16", "q8_0", "q4_0"],
                   help="the matrices' type (vectors stay f32; default f16)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("models", help="list the known models and whether they are installed")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("tokenize", help="text -> token pieces and ids")
    p.add_argument("text", nargs="?")
    _add_model(p)
    p.add_argument("--chat", action="store_true", help="render TEXT as one user turn through the chat template")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("detokenize", help="token ids -> text")
    p.add_argument("ids", nargs="+")
    _add_model(p)
    p.set_defaults(func=cmd_detokenize)
    p = sub.add_parser("trace", help="run one prompt and show every stage: tokens, timings, candidates, cost")
    p.add_argument("prompt", nargs="?", help="the prompt (read from standard input when absent)")
    _add_engine(p)
    _add_sampling(p)
    p.set_defaults(max_tokens=16)  # a trace prints a table row per generated token
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--system", default=None, help="a system message for the chat template")
    p.add_argument("--top", type=int, default=5, metavar="K", help="candidates shown per generated token")
    p.add_argument("--html", default=None, metavar="FILE", help="also write a self-contained HTML page")
    p.add_argument("--compare", nargs="+", default=None, metavar="SETTING",
                   help='run the prompt under each setting, e.g. "temperature=0.2" "temperature=1.0,top_p=0.9" '
                        '(put the prompt before --compare)')
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    _add_engine(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed when ready)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--allow-insecure-bind", action="store_true",
                   help="allow binding a non-loopback address without --api-key")
    p.add_argument("--max-waiting", type=int, default=1024, help="queued requests beyond which new ones get 503")
    p.add_argument("--max-num-seqs", type=int, default=128, help="requests running at once")
    p.add_argument("--max-tokens-default", type=int, default=2048,
                   help="max_tokens of a request that gives none (capped by the room its prompt leaves)")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="KV cache size (default: a share of free memory)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM lets in-flight requests finish before aborting them")
    p.add_argument("--stream-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a stream whose client reads nothing for this long is closed and its requests aborted")
    p.add_argument("--request-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request's headers, then its body, must each arrive within this long (else the connection "
                        "is closed, or the answer is 408)")
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "verbose", False):
        import logging

        logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except NextokenError as e:
        print(f"nextoken: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0

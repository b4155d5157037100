"""The command line: run | chat | serve | trace | perplexity | convert | models | tokenize | detokenize (their shared
options and answer printing: cli_support.py; check, diff and replay: cli_compare.py; the commands that do not
generate: cli_tools.py).

Every user error (a NextokenError) prints one line on stderr and exits with code 2; nothing else is caught, so a
traceback always means a bug in nextoken.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from nextoken.cli_support import (AnswerPrinter, DefaultsHelp, add_engine, add_model, add_parallel, add_sampling,
                                  add_speculative, engine_options, load_text_side, read_text, sampling_params)
from nextoken.cli_compare import cmd_check, cmd_diff, cmd_replay
from nextoken.cli_tools import cmd_convert, cmd_detokenize, cmd_models, cmd_perplexity, cmd_tokenize
from nextoken.errors import NextokenError
from nextoken.server.replica_options import add_replicas, replica_options

EXIT_USAGE = 2


def cmd_run(args: argparse.Namespace) -> int:
    from nextoken.engine.inputs import Chat
    from nextoken.llm import LLM, request_timings

    prompt = read_text(args.prompt, "prompt")
    sampling_params(args, None, prompt_logprobs=args.prompt_logprobs)
    llm = LLM(args.model, **engine_options(args))
    params = sampling_params(args, llm.inputs, prompt_logprobs=args.prompt_logprobs)
    # --raw: the text as it is, the user's own (its special-token text control tokens); else one chat turn.
    chat = Chat.turn(prompt, args.system)
    if args.no_thinking:
        chat = Chat(chat.messages, template_kwargs={"enable_thinking": False})
    prepared = llm.inputs.process(prompt if args.raw else chat, params, special_tokens=True)
    ids = prepared.prompt_ids
    show = AnswerPrinter(llm.inputs.thinks and not args.raw, prepared.text, echo=not args.json)
    text, token_ids, last = [], [], None
    run_params = prepared.params[0]
    if args.record is not None:
        from nextoken.engine.record import with_logprobs
        if params.beam_width is not None:
            raise NextokenError("--record writes one sampled or greedy request; not with --beam-width")
        run_params = with_logprobs(run_params)  # the record's top-K per token: the tokens drawn are the same
    for out in llm.stream(ids, run_params):
        show.add(out.new_text, finished=out.finished)
        text.append(out.new_text)
        token_ids.extend(out.new_token_ids)
        last = out
    assert last is not None and last.request is not None
    req = last.request
    if args.record is not None:
        from nextoken.engine.record import make_bundle, write_bundle
        write_bundle(args.record, make_bundle(llm.engine, req, prepared.text, "".join(text), prepared.params[0]))
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

    llm = LLM(args.model, **engine_options(args))
    params = sampling_params(args, llm.inputs)
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
        show = AnswerPrinter(llm.inputs.thinks, prepared.text)
        for out in llm.stream(prepared.prompt_ids, prepared.params[0]):
            show.add(out.new_text, finished=out.finished)
        print()
        # The history keeps the answers, not their thinking (as reasoning models' templates expect).
        messages.append({"role": "assistant", "content": show.content})


def cmd_trace(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nextoken.trace.command import TraceOptions, trace

    prompt = read_text(args.prompt, "prompt")
    options = TraceOptions(model=args.model, **engine_options(args), raw=args.raw, system=args.system,
                           top_k=args.top, html=Path(args.html) if args.html else None,
                           compare=tuple(args.compare or ()), branch=tuple(args.branch or ()),
                           engine=args.engine, arrive_every=args.arrive_every, kv_cache_bytes=args.kv_cache_bytes,
                           max_num_batched_tokens=args.max_num_batched_tokens)
    return trace(prompt, sampling_params(args, load_text_side(args.model)), options)


def cmd_serve(args: argparse.Namespace) -> int:
    from nextoken.config import EngineConfig
    from nextoken.server.bind import check_bind

    check_bind(args.host, args.api_key, args.allow_insecure_bind)  # before torch and the model load: fail fast
    from nextoken.server.serve import serve

    config = EngineConfig(model=args.model, **engine_options(args), max_waiting=args.max_waiting,
                          kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
                          max_tokens_default=args.max_tokens_default)
    return serve(config, host=args.host, port=args.port, api_key=args.api_key,
                 allow_insecure_bind=args.allow_insecure_bind, drain_timeout=args.drain_timeout,
                 stream_timeout=args.stream_timeout, request_timeout=args.request_timeout, record_dir=args.record_dir,
                 replicas=replica_options(args))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, not a usage dump
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nextoken", description="An LLM inference engine that shows its work.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("run", help="answer one prompt, streaming the text",
                       formatter_class=DefaultsHelp)
    p.add_argument("prompt", nargs="?", help="the prompt (read from standard input when absent)")
    add_engine(p)
    add_speculative(p)
    add_parallel(p)
    add_sampling(p)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--system", default=None, help="a system message for the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                   help="with --json: the top-K next-token log-probabilities at every prompt position, and each "
                        "prompt token's own log-probability and rank")
    p.add_argument("--verbose", "-v", action="store_true", help="print token counts and speed to stderr")
    p.add_argument("--no-thinking", action="store_true",
                   help="a reasoning model answers without its thinking section (the template's enable_thinking)")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="write the request to FILE, to replay (`nextoken replay FILE`): the model's identity, the "
                        "prompt's ids, the parameters and seed, the engine's settings, each token's top-5")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check", help="how far each weight / KV / activation format is from fp32, on your prompts",
                       formatter_class=DefaultsHelp)
    add_model(p)
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="prompts, one per line ('-': standard input); default: eight built-in ones")
    p.add_argument("--formats", nargs="+", default=None, metavar="FORMAT",
                   help="'default' (the engine's own choice) or key=value[,key=value] over weights, kv_dtype, "
                        "lm_head, activations, dtype (default: default weights=int8 kv_dtype=int8 activations=int8)")
    p.add_argument("--continuation", type=int, default=32, metavar="N",
                   help="tokens the fp32 route generates after each prompt, scored with it")
    p.add_argument("--against", choices=["transformers"], default=None,
                   help="also compare transformers' own forward of the file (where it is installed)")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: one per physical core)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--html", default=None, metavar="FILE", help="also write a self-contained HTML page")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("diff", help="where two runs of one prompt part: two records, or a record and a new setting")
    p.add_argument("a", help="a record (`nextoken run --record`)")
    p.add_argument("b", nargs="?", default=None, help="another record of the same prompt")
    p.add_argument("--model", "-m", default=None, help="run A's request on this model file instead (same tokenizer)")
    p.add_argument("--weights", default=None, choices=["fp32", "bf16", "int8", "int4"])
    p.add_argument("--kv-dtype", default=None, choices=["fp32", "bf16", "int8"])
    p.add_argument("--lm-head", default=None, choices=["fp32", "int8"])
    p.add_argument("--activations", default=None, choices=["int16", "int8"])
    p.add_argument("--html", default=None, metavar="FILE", help="also write a self-contained HTML page")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("replay", help="run a recorded request again and say whether it is identical, or where not")
    p.add_argument("bundle", help="a file written by `nextoken run --record`")
    p.add_argument("--model", "-m", default=None,
                   help="the model file to run it on (default: the recorded path); refused unless it is the same file")
    p.add_argument("--html", default=None, metavar="FILE", help="also write a self-contained page, step by step")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("chat", help="a multi-turn chat in the terminal (/exit to leave)",
                       formatter_class=DefaultsHelp)
    add_engine(p)
    add_speculative(p)
    add_parallel(p)
    add_sampling(p)
    p.add_argument("--system", default=None)
    p.add_argument("--no-thinking", action="store_true", help="as for run")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("perplexity", help="score a text file: the model's perplexity on it, in windows")
    p.add_argument("file", help="a UTF-8 text file ('-': standard input)")
    add_engine(p)
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
    add_model(p)
    p.add_argument("--chat", action="store_true", help="render TEXT as one user turn through the chat template")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("detokenize", help="token ids -> text")
    p.add_argument("ids", nargs="+")
    add_model(p)
    p.set_defaults(func=cmd_detokenize)

    p = sub.add_parser("trace", help="run one prompt and show every stage: tokens, timings, candidates, cost",
                       formatter_class=DefaultsHelp)
    p.add_argument("prompt", nargs="?", help="the prompt (read from standard input when absent)")
    add_engine(p)
    add_speculative(p)
    add_sampling(p)
    p.set_defaults(max_tokens=16)  # a trace prints a table row per generated token
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--system", default=None, help="a system message for the chat template")
    p.add_argument("--top", type=int, default=5, metavar="K", help="candidates shown per generated token")
    p.add_argument("--html", default=None, metavar="FILE", help="also write a self-contained HTML page")
    p.add_argument("--engine", type=int, default=0, metavar="N",
                   help="run N requests of the prompt (seeds 0..N-1) as a batch and show the engine step by step: "
                        "what each step ran, prefill chunks, prefix-cache hits, preemptions, a block map")
    p.add_argument("--arrive-every", type=int, default=2, metavar="K", help="with --engine: a request every K steps")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="with --engine: the KV pool's size (small: preemption shows)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="with --engine: tokens one step may process (small: prompts are chunked)")
    p.add_argument("--branch", nargs="+", default=None, metavar="SETTING",
                   help='prefill the prompt once and continue it under each setting side by side, e.g. '
                        '"temperature=0" "temperature=1,top_p=0.9,seed=3", with each branch\'s probability of the '
                        "others' tokens (put the prompt before --branch)")
    p.add_argument("--compare", nargs="+", default=None, metavar="SETTING",
                   help='run the prompt under each setting, e.g. "temperature=0.2" "temperature=1.0,top_p=0.9" '
                        '(put the prompt before --compare)')
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_engine(p)
    add_speculative(p)
    add_parallel(p)
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
    p.add_argument("--record-dir", default=None, metavar="DIR",
                   help="where requests sent with the header 'X-Nextoken-Record: 1' are written as records to "
                        "replay (`nextoken replay`); without it such requests are refused")
    p.add_argument("--request-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request's headers, then its body, must each arrive within this long (else the connection "
                        "is closed, or the answer is 408)")
    add_replicas(p)
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

"""What the commands share: the model and engine options, the sampling controls and the request's SamplingParams made
from them (checked against the model's vocabulary through its input processor), reading text from an argument or
standard input, and how run and chat print an answer."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from nextoken.loader.registry import DEFAULT_MODEL


class DefaultsHelp(argparse.HelpFormatter):
    """Help that shows each option's default, where it has one worth showing and its text does not already say."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default == [] or default == argparse.SUPPRESS \
                or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"a model name (see `nextoken models`), a path to a .gguf file, or a Hugging Face model "
                        f"directory (config.json, .safetensors, tokenizer.json) (default: {DEFAULT_MODEL})")


def add_engine(p: argparse.ArgumentParser) -> None:
    add_model(p)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="float weights (activations stay fp32)")
    p.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16", "int8", "int4"],
                   help="projection weights; auto: --dtype if given, else on CPU int4 for files whose projections "
                        "are all in blocks the kernels hold exactly (Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0: the file's "
                        "weights, a quarter of fp32's bytes), fp32 for others; bf16 on CUDA (where int4 and int8 run the "
                        "blocks in Triton kernels, fp32 activations)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "fp32", "bf16", "int8"],
                   help="KV cache storage; int8 keeps a scale per 32 values (3.8x the tokens of fp32 in the same "
                        "memory); auto: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--lm-head", default="auto", choices=["auto", "fp32", "int8"],
                   help="decode's LM head; int8: a quarter of the bytes (the file's Q8_0 blocks as they are, or "
                        "requantized with its 32 best candidates recomputed in fp32); auto: int8 on CPU unless "
                        "--weights/--dtype ask for float weights")
    p.add_argument("--activations", default="int16", choices=["int16", "int8"],
                   help="how block weights meet the activations: two levels of codes per 32 values, int16 codes "
                        "and int8 codes of what they leave (exact to the fp32 reference), or (AVX-512 VNNI CPUs) one "
                        "level of int8 codes in every product, a few outlier columns in fp32, fixed per product by a "
                        "calibration pass at load so that a sequence's numbers do not depend on its batch (prefill "
                        "2.1-2.4x, decode of one sequence 0.7-1.1x; top-1 agreement above transformers in bf16)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run decode steps op by op instead of replaying CUDA graphs")
    p.add_argument("--threads", "-t", type=int, default=None,
                   help="CPU threads for the kernels (default: one per physical core)")


def add_speculative(p: argparse.ArgumentParser) -> None:
    """Speculative decoding's options (run, chat, serve, trace)."""
    p.add_argument("--speculative", default=None, metavar="PROPOSER",
                   help="speculative decoding: ngram (tokens proposed by prompt lookup over the sequence's own "
                        "tokens), draft:MODEL (by a model sharing the vocabulary, e.g. the same one in int4 for "
                        "an fp32 target), self:L (by the model's first L layers and its head) or head:N (by the whole "
                        "model through its head's N likeliest tokens, e.g. head:16384), verified in one pass; the "
                        "output is unchanged, k adapts to what pays")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="with --speculative: the most tokens proposed per step (1-64; default 24)")


def add_parallel(p: argparse.ArgumentParser) -> None:
    """Tensor parallelism's option (run, chat, serve)."""
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model's attention heads and feed-forward columns across N processes, started "
                        "here on 127.0.0.1 (or joined under torchrun), each with 1/N of the threads; on one CPU it "
                        "costs more than it gives (docs/scale-out.md)")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    options = {"dtype": args.dtype, "weights": args.weights, "kv_dtype": args.kv_dtype, "lm_head": args.lm_head,
               "activations": args.activations,
               "device": args.device, "cuda_graphs": not args.enforce_eager, "threads": args.threads}
    if hasattr(args, "speculative"):  # the commands that take add_speculative's options
        options.update(speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens)
    if hasattr(args, "tensor_parallel"):  # add_parallel's
        options["tensor_parallel"] = args.tensor_parallel
    return options


def add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="the most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K likeliest tokens; 0 turns it off")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the likeliest tokens holding this much probability; 1 turns it off")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this times the likeliest; 0 turns it off")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already in the prompt or output")
    p.add_argument("--seed", type=int, default=None, help="a seeded request draws the same tokens every time")
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
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    shape.add_argument("--json-schema", metavar="FILE", default=None,
                       help="the output is JSON matching the JSON schema in FILE")
    shape.add_argument("--regex", metavar="REGEX", default=None, help="the output matches REGEX, whole")
    shape.add_argument("--grammar", metavar="FILE", default=None,
                       help="the output follows the grammar in FILE (Lark, or llama.cpp's GBNF)")
    shape.add_argument("--choice", action="append", default=None, metavar="TEXT",
                       help="the output is one of these texts (repeatable)")


def structured_outputs(args: argparse.Namespace) -> Any:
    """--json-object, --json-schema, --regex, --grammar or --choice as a StructuredOutputs (None: free text)."""
    from nextoken.errors import InvalidInput
    from nextoken.sampling_params import StructuredOutputs

    def read(flag: str, path: str) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidInput(f"{flag} {path}: {exc.strerror if isinstance(exc, OSError) else 'not UTF-8 text'}") \
                from None

    if args.json_object:
        return StructuredOutputs(json_object=True)
    if args.json_schema is not None:
        return StructuredOutputs(json=read("--json-schema", args.json_schema))
    if args.regex is not None:
        return StructuredOutputs(regex=args.regex)
    if args.grammar is not None:
        return StructuredOutputs(grammar=read("--grammar", args.grammar))
    if args.choice is not None:
        return StructuredOutputs(choice=tuple(args.choice))
    return None


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


def sampling_params(args: argparse.Namespace, inputs: Any, **extra: Any) -> Any:
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
                            allowed_token_ids=args.allowed_token_ids, structured_outputs=structured_outputs(args),
                            **extra)
    if inputs is not None:
        flag = next((f"--{n.replace('_', '-')}" for n in ("json_object", "json_schema", "regex", "grammar", "choice")
                     if getattr(args, n) not in (None, False)), "structured_outputs")
        inputs.check_processor_ids(params, flag)
    return params


def read_text(arg: str | None, what: str) -> str:
    """The command's text: its argument, else standard input where that is not a terminal."""
    if arg is not None:
        return arg
    if sys.stdin is None or sys.stdin.isatty():
        from nextoken.errors import NextokenError

        raise NextokenError(f"no {what} given: pass it as an argument or on standard input")
    return sys.stdin.read()


def load_text_side(model: str) -> Any:
    """The input processor of a model (its tokenizer, chat template and vocabulary) without loading its weights."""
    from nextoken.loader.text_side import load_text_side
    from nextoken.engine.inputs import InputProcessor
    from nextoken.loader.registry import open_model, resolve_model
    from nextoken.models.config import ModelConfig

    gguf = open_model(resolve_model(model))
    config = ModelConfig.from_gguf(gguf)
    tokenizer, template = load_text_side(gguf, config)
    return InputProcessor(tokenizer, template, config.vocab_size, end_ids=config.eog_ids)


class AnswerPrinter:
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

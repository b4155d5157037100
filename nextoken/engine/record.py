"""Record and replay: one request written down whole, so that "why did I get a different answer?" has an answer.

A bundle (JSON, `FORMAT` version `VERSION`) holds what decides a request's tokens: the model file's identity (its
SHA-256, architecture, size) and the formats it ran in, the tokenizer's and chat template's hashes, the rendered
prompt and its ids, the sampling parameters with the seed, the engine's settings, and per generated token the token
with its log-probability and the top-K (`TOP_K`) of the raw distribution. `replay` runs the same ids with the same
parameters on the same model file and engine settings and compares step by step: the same tokens are "identical"
(and how far the log-probabilities moved is reported beside it); otherwise the first step whose token differs is
named with both candidates' log-probabilities. A bundle that is not JSON, is cut short, is of a newer format, or
was made with another model file than the one at hand is refused with one line saying which: replay never runs a
different model silently.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nextoken.config import cache_dir
from nextoken.errors import NextokenError
from nextoken.sampling_params import SamplingParams, StructuredOutputs

if TYPE_CHECKING:
    from nextoken.engine.engine import LLMEngine
    from nextoken.engine.request import Request

FORMAT = "nextoken-record"
VERSION = 1
TOP_K = 5
ENGINE_KEYS = ("dtype", "weights", "kv_dtype", "lm_head", "activations", "device", "threads", "block_size",
               "max_model_len", "enable_chunked_prefill", "enable_prefix_caching")


class BundleError(NextokenError):
    """A bundle that cannot be replayed: unreadable, cut short, from a newer format, or of another model file."""


def file_sha256(path: Path) -> str:
    """A model file's (or directory's files') SHA-256, cached by path, size and modification time: hashing a
    270 MB file takes about half a second, a lookup nothing."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stamp = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    key = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:32]
    cached = cache_dir() / "sha256" / key
    try:
        return cached.read_text().strip()
    except OSError:
        pass
    digest = hashlib.sha256()
    for p in files:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    value = digest.hexdigest()
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(value)
        tmp.replace(cached)
    except OSError:
        pass  # an unwritable cache only costs the next hash
    return value


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def tokenizer_sha256(engine: LLMEngine) -> str:
    """The tokenizer's identity: every id's bytes, its special ids and its BOS/EOS rules."""
    tok = engine.tokenizer
    digest = hashlib.sha256()
    for i in range(tok.vocab_size):
        piece = tok.piece_bytes(i)
        digest.update(len(piece).to_bytes(4, "little") + piece)
    digest.update(json.dumps([sorted(tok.special_ids), tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos,
                              tok.add_space_prefix, tok.kind]).encode())
    return digest.hexdigest()


def model_identity(engine: LLMEngine) -> dict[str, Any]:
    runner, config = engine.runner, engine.model_config
    return {"name": engine.model_name, "path": str(engine.model_path), "sha256": file_sha256(engine.model_path),
            "architecture": config.architecture, "vocab_size": config.vocab_size,
            "formats": {"weights": runner.weights, "kv_dtype": runner.kv_dtype, "lm_head": runner.lm_head,
                        "activations": runner.activations, "device": str(runner.device)}}


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    out = dataclasses.asdict(params)
    out["logit_bias"] = [list(p) for p in params.logit_bias_pairs]
    if params.structured_outputs is not None:
        out["structured_outputs"] = {"kind": params.structured_outputs.kind,
                                     "spec": params.structured_outputs.schema}
    return out


def params_from_json(data: dict[str, Any]) -> SamplingParams:
    data = dict(data)
    data["logit_bias"] = {int(t): b for t, b in data.get("logit_bias", [])}
    for key in ("stop", "stop_token_ids"):
        data[key] = tuple(data.get(key, ()))
    data["bad_words"] = tuple(tuple(w) for w in data.get("bad_words", ()))
    if data.get("allowed_token_ids") is not None:
        data["allowed_token_ids"] = tuple(data["allowed_token_ids"])
    so = data.get("structured_outputs")
    if so is not None:
        kind, spec = so["kind"], so["spec"]
        data["structured_outputs"] = StructuredOutputs(json_object=True) if kind == "json_object" else \
            StructuredOutputs(choice=tuple(json.loads(spec))) if kind == "choice" else StructuredOutputs(**{kind: spec})
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    return SamplingParams(**{k: v for k, v in data.items() if k in known})


def with_logprobs(params: SamplingParams) -> SamplingParams:
    """The params a recorded request runs with: its own, with at least TOP_K log-probabilities per token (they are
    read from the raw distribution: the tokens drawn stay the same)."""
    if params.logprobs is not None and params.logprobs >= TOP_K:
        return params
    return dataclasses.replace(params, logprobs=TOP_K)


def make_bundle(engine: LLMEngine, request: Request, prompt_text: str | None, text: str,
                params: SamplingParams | None = None) -> dict[str, Any]:
    """A finished request as a bundle: `params` as the caller gave them (default: the request's), and the top-K
    log-probabilities of each token (the request ran `with_logprobs`)."""
    steps = [{"token": t, "logprob": lp[0], "top": [[i, v] for i, v in lp[1][:TOP_K]]}
             for t, lp in zip(request.output_ids, request.logprobs)]
    return {
        "format": FORMAT, "version": VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": model_identity(engine),
        "tokenizer_sha256": tokenizer_sha256(engine),
        "chat_template_sha256": text_sha256(engine.chat_template.source),
        "engine": {k: getattr(engine.config, k) for k in ENGINE_KEYS},
        "prompt": {"text": prompt_text, "ids": list(request.prompt_ids)},
        "params": params_to_json(params or request.params),
        "steps": steps, "text": text, "finish_reason": request.finish_reason,
    }


def write_bundle(path: str | Path, bundle: dict[str, Any]) -> None:
    try:
        Path(path).write_text(json.dumps(bundle, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    except OSError as exc:
        raise NextokenError(f"cannot write the record {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class Bundle:
    path: str
    data: dict[str, Any]

    @property
    def params(self) -> SamplingParams:
        return params_from_json(self.data["params"])

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.data["prompt"]["ids"])

    @property
    def steps(self) -> list[dict[str, Any]]:
        return list(self.data["steps"])


def read_bundle(path: str | Path) -> Bundle:
    """A bundle, checked: BundleError naming what is wrong in one line."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise BundleError(f"cannot read the record {path}: {exc.strerror}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BundleError(f"the record {path} is corrupt: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        what = "corrupt" if raw.rstrip().endswith(b"}") else "truncated"  # a whole bundle ends its object
        raise BundleError(f"the record {path} is {what}: not valid JSON (line {exc.lineno}, column {exc.colno})") \
            from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BundleError(f"{path} is not a nextoken record (no \"format\": \"{FORMAT}\")")
    version = data.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise BundleError(f"the record {path} is of format version {version!r}; this nextoken reads up to {VERSION}")
    bundle = Bundle(str(path), data)
    try:
        _check_fields(bundle)
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(f"the record {path} is corrupt: a field is missing or malformed ({exc})") from None
    except NextokenError as exc:
        raise BundleError(f"the record {path} is corrupt: {exc}") from None
    return bundle


def engine_settings(bundle: Bundle) -> dict[str, Any]:
    """The engine settings a bundle was recorded with, as LLM(...) keywords."""
    return {k: v for k, v in bundle.data["engine"].items() if k in ENGINE_KEYS}


def _check_fields(bundle: Bundle) -> None:
    """Every field replay reads, of the type it reads: KeyError, TypeError or ValueError where one is not."""
    data = bundle.data
    bundle.params  # noqa: B018 - SamplingParams validates every parameter
    if not all(isinstance(t, int) for t in bundle.prompt_ids):
        raise ValueError("prompt ids that are not integers")
    for step in bundle.steps:
        int(step["token"]), float(step["logprob"])
        for i, v in step["top"]:
            int(i), float(v)
    for key in ("sha256", "path"):
        str(data["model"][key])
    if not isinstance(data["engine"], dict) or not isinstance(data["tokenizer_sha256"], str):
        raise TypeError("engine settings or tokenizer hash of the wrong type")


def check_model(bundle: Bundle, engine: LLMEngine) -> None:
    """Refuse to replay on another model file, tokenizer or chat template than the bundle's."""
    recorded, actual = bundle.data["model"]["sha256"], file_sha256(engine.model_path)
    if recorded != actual:
        raise BundleError(f"the record {bundle.path} was made with another model file ({bundle.data['model']['path']},"
                          f" sha256 {recorded[:12]}...) than {engine.model_path} (sha256 {actual[:12]}...)")
    if bundle.data["tokenizer_sha256"] != tokenizer_sha256(engine):
        raise BundleError(f"the record {bundle.path} was made with another tokenizer than {engine.model_path}'s")


@dataclass
class ReplayResult:
    identical: bool
    num_steps: int
    first_difference: int | None  # the first step whose token differs (None: none)
    message: str
    max_logprob_change: float  # over the steps both runs share, of the chosen tokens' log-probabilities
    # Per step, for a page: (recorded token, its log p, replayed token or None, its log p or None).
    steps: list[tuple[int, float, int | None, float | None]] = dataclasses.field(default_factory=list)


def compare(bundle: Bundle, token_ids: list[int], logprobs: list[tuple[float, list[tuple[int, float]]]],
            finish_reason: str | None, piece: Any) -> ReplayResult:
    """A replay's tokens against the record's, step by step. `piece(id)` shows a token."""
    result = _compare(bundle, token_ids, logprobs, finish_reason, piece)
    result.steps = [(s["token"], s["logprob"], token_ids[i] if i < len(token_ids) else None,
                     logprobs[i][0] if i < len(logprobs) else None) for i, s in enumerate(bundle.steps)]
    result.steps += [(-1, float("nan"), token_ids[i], logprobs[i][0] if i < len(logprobs) else None)
                     for i in range(len(bundle.steps), len(token_ids))]
    return result


def _compare(bundle: Bundle, token_ids: list[int], logprobs: list[tuple[float, list[tuple[int, float]]]],
             finish_reason: str | None, piece: Any) -> ReplayResult:
    steps = bundle.steps
    change = 0.0
    for i, step in enumerate(steps):
        if i >= len(token_ids):
            return ReplayResult(False, len(steps), i, f"differs at step {i}: the record goes on with "
                                f"{piece(step['token'])!r} where the replay ended ({finish_reason})", change)
        now_lp = logprobs[i][0] if i < len(logprobs) else float("nan")
        if token_ids[i] != step["token"]:
            recorded_now = dict(logprobs[i][1]).get(step["token"]) if i < len(logprobs) else None
            then = dict((int(t), v) for t, v in step["top"]).get(token_ids[i])
            return ReplayResult(False, len(steps), i, (
                f"differs at step {i}: recorded {piece(step['token'])!r} (id {step['token']}, log p "
                f"{step['logprob']:.4f}; now {_lp(recorded_now)}), replayed {piece(token_ids[i])!r} "
                f"(id {token_ids[i]}, log p {now_lp:.4f}; then {_lp(then)})"), change)
        change = max(change, abs(now_lp - step["logprob"]))
    if len(token_ids) > len(steps):
        i = len(steps)
        return ReplayResult(False, len(steps), i, f"differs at step {i}: the replay goes on with "
                            f"{piece(token_ids[i])!r} where the record ended ({bundle.data.get('finish_reason')})",
                            change)
    return ReplayResult(True, len(steps), None, f"identical: {len(steps)} tokens, the chosen tokens' log-probabilities "
                        f"within {change:.2e} of the record's", change)


def _lp(value: float | None) -> str:
    return "not in the top-K" if value is None else f"log p {value:.4f}"

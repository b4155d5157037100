"""Process-wide settings: the engine's defaults and the cache directory ($NEXTOKEN_CACHE_DIR). The native kernels'
switches are read where they are built (ops/native: NEXTOKEN_NATIVE=0 turns them off, NEXTOKEN_NATIVE_SANITIZE=1
builds them under the sanitizers, CC picks the compiler). Tensor parallelism's collective timeout:
$NEXTOKEN_TP_TIMEOUT (seconds, `tensor_parallel_timeout`).

Engine configuration dataclasses are frozen and validated once, at the edge.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def cache_dir() -> Path:
    """Where assembled model files, built tokenizers and the native kernels are kept ($NEXTOKEN_CACHE_DIR, default
    ~/.cache/nextoken)."""
    return Path(os.environ.get("NEXTOKEN_CACHE_DIR") or Path.home() / ".cache" / "nextoken")


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def tensor_parallel_timeout() -> float:
    """Seconds a rank waits in one collective (an all-reduce, a step's inputs, the start) before it gives up on the
    others ($NEXTOKEN_TP_TIMEOUT, default 60): a lost rank fails the step with an error instead of hanging it. An idle
    worker waits for the next step without it."""
    value = os.environ.get("NEXTOKEN_TP_TIMEOUT", "")
    try:
        seconds = float(value) if value else 60.0
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        from nextoken.errors import NextokenError

        raise NextokenError(f"invalid NEXTOKEN_TP_TIMEOUT={value!r} (a positive number of seconds)")
    return seconds


TENSOR_PARALLEL_BACKENDS = ("auto", "gloo", "nccl")
SPECULATIVE_PROPOSERS = (None, "ngram")
MAX_SPECULATIVE_TOKENS = 64
# On CPUs a pass of 12 or more rows runs as a GEMM whose cost per row falls with the rows (ops/quant_linear.py), so
# long proposals are where speculation pays there; k adapts below this.
DEFAULT_SPECULATIVE_TOKENS = 24


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model. Validated on construction; every field is a user-facing setting."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # float weights: "float32" | "bfloat16" | "auto" (decided by `weights`)
    # Projection weights: "fp32" | "bf16" | "int8" (a scale per 32) | "int4" (a scale and offset per 32): the block
    # formats run in the native kernels on CPU, in Triton kernels on CUDA (ops/cuda_blocks.py) | "auto": the dtype
    # asked for if any, else on CPU int4 for files whose projections the kernels hold exactly (Q4_0, Q4_1, Q4_K,
    # Q5_0, Q6_K, Q8_0 blocks), fp32 for others; bf16 on CUDA.
    weights: str = "auto"
    # LM head for decode rows: "fp32" | "int8" (a cheap int8 pass over the vocabulary, its 32 best candidates
    # recomputed in fp32; CPU only) | "auto": int8 on CPU unless float weights were asked for, else fp32.
    lm_head: str = "auto"
    # How block weights (int4, int8) meet the activations in products of many rows (prefill, batches of 12 or more
    # sequences, the LM head from 16 rows) on CPUs with AVX-512 VNNI: "int16": two levels of codes per 32 values (int16
    # codes, then int8 codes of what they leave: each value within 2^-24 of its block's largest) | "int8": one level
    # of int8 codes per 32 values, their outlier columns in fp32 (faster products, less precise).
    activations: str = "int16"
    # KV cache storage: "fp32" | "bf16" | "int8" (a fp16 scale per 32 values) | "auto": fp32 on CPU, bf16 on CUDA.
    kv_dtype: str = "auto"
    device: str = "auto"  # "cpu" | "cuda" | "auto" (CUDA when present)
    block_size: int = 16
    kv_cache_bytes: int | None = None  # the KV pool's size; None: kv_cache_fraction of available memory
    kv_cache_fraction: float = 0.1
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 128  # requests running at once
    max_num_batched_tokens: int = 2048  # tokens one step may process
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_waiting: int = 1024  # queued requests beyond which add_request refuses
    # The server's max_tokens for a request that gives none (OpenAI's API lets it run to the context's end): a
    # forgotten field costs at most this many tokens of one sequence, never the whole context.
    max_tokens_default: int = 2048
    cuda_graphs: bool = True  # on CUDA, replay pure decode steps from CUDA graphs (engine/graphs.py)
    # CPU threads for the kernels (torch's and nextoken's own); None: torch's default, one per physical core. Set
    # process-wide (torch.set_num_threads) when the engine is built.
    threads: int | None = None
    # Speculative decoding (engine/speculative.py): None (off) | "ngram" (prompt lookup over the sequence's own
    # tokens) | "draft:MODEL" (a model sharing the vocabulary drafts, engine/draft.py) | "self:L" (the model's first
    # L layers, its final norm and head draft: early exit) | "head:N" (the whole model drafts with its head cut to
    # the N tokens it deems likeliest, over its own cache; verifying computes only the full head, engine/head_draft.py).
    # num_speculative_tokens: the most tokens proposed per
    # sequence and step (k adapts below it, down to 0); None: DEFAULT_SPECULATIVE_TOKENS.
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    # Tensor parallelism (parallel/): the model's attention heads and feed-forward columns split across this many
    # processes, which nextoken starts itself (or joins, under torchrun). backend: "gloo" (CPU tensors) | "nccl" (CUDA
    # tensors) | "auto" (the device's).
    tensor_parallel: int = 1
    tensor_parallel_backend: str = "auto"

    @property
    def draft_model(self) -> str | None:
        """The draft model of speculative="draft:MODEL"."""
        spec = self.speculative
        return spec[len("draft:"):].strip() or None if spec is not None and spec.startswith("draft:") else None

    def _speculative_count(self, prefix: str) -> int | None:
        """The positive whole number after `prefix` in `speculative` ("self:" or "head:"), else None."""
        spec = self.speculative
        if not isinstance(spec, str) or not spec.startswith(prefix):
            return None
        count = spec[len(prefix):]
        return int(count) if count.isdigit() and int(count) > 0 else None

    @property
    def self_draft_layers(self) -> int | None:
        """L of speculative="self:L" (checked against the model's layers when loaded)."""
        return self._speculative_count("self:")

    @property
    def head_draft_vocab(self) -> int | None:
        """N of speculative="head:N" (checked against the vocabulary when loaded)."""
        return self._speculative_count("head:")

    @property
    def max_speculative_tokens(self) -> int:
        """K: the most tokens a sequence may propose per step (0 without speculation)."""
        if self.speculative is None:
            return 0
        return DEFAULT_SPECULATIVE_TOKENS if self.num_speculative_tokens is None else self.num_speculative_tokens

    def __post_init__(self) -> None:
        from nextoken.errors import NextokenError

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise NextokenError(f"invalid engine setting: {what}")

        need(self.dtype in ("auto", "float32", "bfloat16"), f"dtype={self.dtype!r} (auto, float32 or bfloat16)")
        need(self.weights in ("auto", "fp32", "bf16", "int8", "int4"),
             f"weights={self.weights!r} (auto, fp32, bf16, int8 or int4)")
        need(self.lm_head in ("auto", "fp32", "int8"), f"lm_head={self.lm_head!r} (auto, fp32 or int8)")
        need(self.activations in ("int16", "int8"), f"activations={self.activations!r} (int16 or int8)")
        need(self.kv_dtype in ("auto", "fp32", "bf16", "int8"), f"kv_dtype={self.kv_dtype!r} (auto, fp32, bf16 or int8)")
        need(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"device={self.device!r} (auto, cpu or cuda)")
        need(self.block_size in (8, 16, 32, 64, 128), f"block_size={self.block_size} (8, 16, 32, 64 or 128)")
        need(self.kv_cache_bytes is None or self.kv_cache_bytes > 0, f"kv_cache_bytes={self.kv_cache_bytes}")
        need(0 < self.kv_cache_fraction <= 0.9, f"kv_cache_fraction={self.kv_cache_fraction} (in (0, 0.9])")
        need(self.max_model_len is None or self.max_model_len > 0, f"max_model_len={self.max_model_len}")
        need(self.max_num_seqs >= 1, f"max_num_seqs={self.max_num_seqs}")
        need(self.max_num_batched_tokens >= self.block_size,
             f"max_num_batched_tokens={self.max_num_batched_tokens} (at least one block)")
        need(self.max_waiting >= 1, f"max_waiting={self.max_waiting}")
        need(self.max_tokens_default >= 1, f"max_tokens_default={self.max_tokens_default}")
        need(self.speculative in SPECULATIVE_PROPOSERS
             or (isinstance(self.speculative, str) and self.speculative.startswith("draft:") and bool(self.draft_model))
             or self.self_draft_layers is not None or self.head_draft_vocab is not None,
             f"speculative={self.speculative!r} (ngram: prompt lookup over the sequence's own tokens; draft:MODEL: "
             "a model sharing the vocabulary proposes; self:L: the model's first L layers and its head propose; "
             "head:N: the whole model proposes through its head's N likeliest tokens)")
        k = self.num_speculative_tokens
        need(k is None or (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_SPECULATIVE_TOKENS),
             f"num_speculative_tokens={k!r} (a whole number from 1 to {MAX_SPECULATIVE_TOKENS})")
        need(k is None or self.speculative is not None, "num_speculative_tokens is set but speculative is not")
        need(self.threads is None or (isinstance(self.threads, int) and not isinstance(self.threads, bool)
                                      and self.threads >= 1), f"threads={self.threads!r} (a whole number, at least 1)")
        tp = self.tensor_parallel
        need(isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1,
             f"tensor_parallel={tp!r} (a whole number of processes, at least 1)")
        backend = self.tensor_parallel_backend
        need(backend in TENSOR_PARALLEL_BACKENDS, f"tensor_parallel_backend={backend!r} (auto, gloo or nccl)")
        need(not (backend == "nccl" and self.device == "cpu"),
             "tensor_parallel_backend='nccl' moves CUDA tensors, but device='cpu' (use gloo or auto)")
        need(not (backend == "gloo" and self.device.startswith("cuda")),
             f"tensor_parallel_backend='gloo' is for CPU tensors, but device={self.device!r} (use nccl or auto)")
        need(tp == 1 or self.speculative is None,
             f"speculative={self.speculative!r} with tensor_parallel={tp}: speculative decoding runs on one process "
             "only")

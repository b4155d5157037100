"""What a forward pass should cost, from the model's shapes alone, and what this machine can do at best.

FLOPs and bytes are computed from ModelConfig, never measured: the tracer divides them by measured times to get
achieved GFLOP/s and GB/s. Machine peaks (one GEMM: the faster of torch's and nextoken's own on CPU fp32; one memory
copy) are measured once per device, dtype and torch build and cached as JSON under `nextoken.config.cache_dir()`;
delete the file to measure again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from nextoken.config import cache_dir
from nextoken.models.config import ModelConfig
from nextoken.ops import native

PEAKS_FILE = "machine_peaks.json"
# Dense GEMM side and copy size used to estimate peaks: large enough to leave the caches, small enough to take a
# fraction of a second on a laptop CPU.
GEMM_SIZE = {"cpu": 1024, "cuda": 4096}
COPY_BYTES = 64 << 20
MIN_MEASURE_S = 0.25  # each peak is the best of as many repeats as fit in this time (at least 3)


@dataclass(frozen=True)
class ModelCost:
    """Static counts for one model; `*_params` are the weights multiplied by every token (matmuls only).

    FLOPs follow nanoGPT's `estimate_mfu` (after the PaLM paper, appendix B), forward pass only: 2 FLOPs per
    parameter per token for the matmuls, plus 2 x 2 x n_ctx x n_heads x head_dim per layer per token for attention
    (q·kᵀ and the weighted sum of v, one multiply-add each per key). nanoGPT's 6N + 12·L·H·Q·T counts forward and
    backward; the forward third is 2N + 4·L·H·Q·T. Unlike training, a causal decoder's token at position p only
    attends to p + 1 keys (or the sliding window), so `n_ctx` here is each token's actual context. Embedding lookups,
    norms, RoPE and softmax are left out: they are O(hidden) per token, under 1% of the total.
    """

    config: ModelConfig
    block_params: int  # q/k/v/o and (gate/)up/down projections, all layers
    head_params: int  # the LM head (the embedding table when tied)
    weight_bytes: int  # bytes of block projections + LM head as stored (what one forward pass reads)
    kv_bytes_per_token: int  # 2 x layers x kv_heads x head_dim x KV dtype bytes (+ int8's scales)

    @classmethod
    def from_config(cls, config: ModelConfig, projection_bytes: float = 4, head_bytes: float = 4,
                    kv_bytes_per_token: int | None = None) -> ModelCost:
        """projection_bytes: bytes per element of block projection weights (fp32 4, bf16 2, int4 0.625);
        head_bytes: the same for the LM head (fp32 4; quantized 1.25). kv_bytes_per_token: as the pool stores it; default fp32."""
        q = config.num_heads * config.head_dim
        kv = config.num_kv_heads * config.head_dim
        per_layer = (config.hidden_size * (q + 2 * kv)  # qkv_proj
                     + q * config.hidden_size  # o_proj
                     + _ffn_params(config))
        block_params = config.num_layers * per_layer
        head_params = config.hidden_size * config.vocab_size
        return cls(config=config, block_params=block_params, head_params=head_params,
                   weight_bytes=int(block_params * projection_bytes + head_params * head_bytes),
                   kv_bytes_per_token=kv_bytes_per_token if kv_bytes_per_token is not None
                   else 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4)

    @property
    def matmul_params(self) -> int:
        return self.block_params + self.head_params

    def attention_flops(self, context_len: int) -> int:
        """Attention FLOPs of one token that sees `context_len` keys (itself included), over all layers."""
        cfg = self.config
        total = 0
        for sliding in cfg.layer_is_sliding:
            seen = min(context_len, cfg.sliding_window) if sliding and cfg.sliding_window else context_len
            total += 4 * seen * cfg.num_heads * cfg.head_dim
        return total

    def forward_flops(self, first_position: int, num_tokens: int, num_logits: int = 1) -> int:
        """FLOPs of one forward pass over positions [first_position, first_position + num_tokens) of one sequence,
        with `num_logits` rows through the LM head (the engine keeps only the last row of a prefill)."""
        flops = 2 * self.block_params * num_tokens + 2 * self.head_params * num_logits
        return flops + sum(self.attention_flops(p + 1) for p in range(first_position, first_position + num_tokens))

    def forward_bytes(self, first_position: int, num_tokens: int) -> int:
        """Least memory traffic of that pass: every weight read once, the new K/V written, the context's K/V read.
        Activations are left out (they stay in cache for small batches), so achieved GB/s is a lower bound."""
        context = first_position + num_tokens
        return self.weight_bytes + self.kv_bytes_per_token * (num_tokens + context)


@dataclass(frozen=True)
class MachinePeaks:
    """Best measured dense GEMM rate and memory-copy bandwidth of one device."""

    key: str
    gemm_gflops: float
    copy_gbps: float
    gemm_size: int
    copy_bytes: int
    measured_at: str
    gemm_by: str = "torch.mm"  # the faster of torch's GEMM and nextoken's own (CPU fp32), which prefill uses
    cached: bool = False  # True when read back from the cache file rather than measured now


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Smallest wall time of `fn()` over repeats filling MIN_MEASURE_S (after one warm-up call)."""
    fn()
    _sync(device)
    best, spent, repeats = float("inf"), 0.0, 0
    while repeats < 3 or spent < MIN_MEASURE_S:
        start = time.perf_counter()
        fn()
        _sync(device)
        elapsed = time.perf_counter() - start
        best, spent, repeats = min(best, elapsed), spent + elapsed, repeats + 1
    return best


def peaks_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a peak depends on: device model, dtype, torch build and the threads torch may use."""
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"cpu x{os.cpu_count()} threads={torch.get_num_threads()}"
    return f"{device.type}|{where}|{dtype}|torch {torch.__version__}"


def measure_peaks(device: torch.device, dtype: torch.dtype) -> MachinePeaks:
    n = GEMM_SIZE.get(device.type, 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    gemm_s, gemm_by = _best_seconds(lambda: torch.mm(a, b), device), "torch.mm"
    lib = native.library() if device.type == "cpu" and dtype == torch.float32 else None
    if lib is not None:  # the GEMM block-quantized projections run for prefill: a peak below it would be exceeded
        panels, out = native.pack(lib, b.t()), torch.empty(n, n)
        own_s = _best_seconds(lambda: native.sgemm(lib, a, panels, n, out), device)
        if own_s < gemm_s:
            gemm_s, gemm_by = own_s, "nextoken sgemm"
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), device)
    return MachinePeaks(key=peaks_key(device, dtype), gemm_gflops=2 * n**3 / gemm_s / 1e9,
                        # A copy reads and writes every byte once.
                        copy_gbps=2 * COPY_BYTES / copy_s / 1e9, gemm_size=n, copy_bytes=COPY_BYTES,
                        measured_at=time.strftime("%Y-%m-%d %H:%M:%S"), gemm_by=gemm_by)


def machine_peaks(device: torch.device, dtype: torch.dtype, path: Path | None = None) -> MachinePeaks:
    """The cached peaks for (device, dtype), measured and stored on first use. A damaged cache file is rewritten."""
    path = path or cache_dir() / PEAKS_FILE
    key = peaks_key(device, dtype)
    try:
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict):
            stored = {}
    except (OSError, ValueError):
        stored = {}
    entry = stored.get(key)
    if isinstance(entry, dict):
        try:
            return MachinePeaks(**{**entry, "cached": True})
        except TypeError:
            pass  # written by another version: measure again
    peaks = measure_peaks(device, dtype)
    stored[key] = {k: v for k, v in asdict(peaks).items() if k != "cached"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=2))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one, never half of it
    except OSError:
        pass  # a read-only cache only costs a new measurement next time
    return peaks


def _ffn_params(config: ModelConfig) -> int:
    """The feed-forward weights one token multiplies: gate (if gated), up and down; in a mixture of experts, the router
    and the experts it takes (not the others), and the shared expert with its gate."""
    h = config.hidden_size
    if config.recipe.mlp == "moe":
        return (h * config.num_experts + config.experts_per_token * 3 * h * config.expert_ffn_size
                + (3 * h * config.shared_expert_ffn_size + h if config.shared_expert_ffn_size else 0))
    return (3 if config.recipe.mlp == "gated" else 2) * h * config.ffn_size

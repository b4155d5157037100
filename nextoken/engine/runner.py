"""The model runner owns the model and the KV pool and turns a schedule into logits.

It picks the device and dtype (CUDA and bf16 when a GPU is present, else CPU and fp32), sizes the KV pool from the
engine's byte budget, and runs one forward pass per step under inference mode: on CUDA, pure decode steps replay
CUDA graphs (engine/graphs.py). Under tensor parallelism (parallel/) it holds this rank's share of the model and a KV
pool of its KV heads alone; rank 0's runner sends each pass's inputs to the workers before running it, and every
rank's pool has the same blocks. The fused native paths and CUDA graphs stay off there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from nextoken.cache.kv_pool import KV_DTYPES, KVPool, KVShape
from nextoken.config import EngineConfig, available_memory_bytes
from nextoken.engine.batch import DecodeBatch, ForwardBatch
from nextoken.engine.graphs import DecodeGraphs
from nextoken.engine.model_loader import load_model
from nextoken.engine.sampler import Sampler
from nextoken.engine.scheduler import ScheduledRequest
from nextoken.errors import NextokenError
from nextoken.loader.gguf import ModelFile
from nextoken.models.base import FusedPath
from nextoken.models.config import ModelConfig
from nextoken.ops import calibration, native
from nextoken.ops.attention import AttentionMetadata
from nextoken.ops.fused import FusedDecoder, NativeStep
from nextoken.ops.hugepages import HugePageMove
from nextoken.ops.quant_linear import EXACT_BLOCK_TYPES
from nextoken.parallel.group import Command, TensorParallelGroup
from nextoken.parallel.shard import plan_shards, shard_model

logger = logging.getLogger("nextoken.engine")

MAX_KV_BYTES_DEFAULT = 1 << 30  # a default, not a limit: kv_cache_bytes can ask for more


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise NextokenError(f"device {name!r} requested but no CUDA device is available")
    return torch.device(name)


def resolve_weights(config: EngineConfig, device: torch.device, gguf: ModelFile) -> str:
    """The projection weight format: explicit `weights`, else the explicit `dtype`, else the device's default.

    On CPU that is int4 when every projection in the file is in blocks the native kernels hold exactly (Q4_0, Q4_1,
    Q4_K as 4-bit; Q5_0, Q6_K, Q8_0 as 8-bit): the same weights as fp32, at a fraction of the bytes (SmolLM2 Q4_1
    and Gemma 3 Q4_K_M: 100% top-1 agreement with fp32). Files of other types would be requantized, which costs
    quality, so they stay fp32; so does every file where the native kernels cannot be built. On CUDA, bf16; int4
    and int8 there run the blocks in Triton kernels (ops/cuda_blocks.py) with fp32 activations.
    """
    weights = config.weights
    if weights == "auto":
        if config.dtype != "auto":
            weights = "fp32" if config.dtype == "float32" else "bf16"
        elif device.type == "cuda":
            weights = "bf16"
        else:
            weights = "int4" if native.library() is not None and _all_projections_exact(gguf) else "fp32"
    if weights in ("int4", "int8") and device.type != "cpu":
        from nextoken.ops import cuda_blocks  # noqa: PLC0415 - imports Triton

        if device.type != "cuda" or not cuda_blocks.available():
            raise NextokenError(f"weights={weights} on {device.type} needs CUDA and Triton (ops/cuda_blocks.py); "
                                f"use bf16 or fp32")
    return weights


def resolve_lm_head(config: EngineConfig, device: torch.device) -> str:
    """The LM head's decode path: "int8" (ops/quant_linear.Int8GroupHead: int8 codes per 32 values for the whole
    vocabulary, then its 32 best candidates recomputed in fp32) on CPU, unless float weights were asked for
    explicitly, which keep the plain fp32 head. The int8 pass reads a quarter of fp32's bytes, and greedy and the top
    log-probabilities stay those of the fp32 head."""
    if config.lm_head == "auto":
        float_asked = config.weights in ("fp32", "bf16") or (config.weights == "auto" and config.dtype != "auto")
        return "int8" if device.type == "cpu" and not float_asked else "fp32"
    if config.lm_head == "int8" and device.type != "cpu":
        raise NextokenError(f"lm_head=int8 uses a CPU kernel; on {device.type} use fp32")
    return config.lm_head


def resolve_kv_dtype(config: EngineConfig, device: torch.device) -> str:
    """The KV cache's storage: explicit `kv_dtype`, else fp32 on CPU (a decode step reads its context as a view,
    with no conversion) and bf16 on CUDA."""
    if config.kv_dtype != "auto":
        return config.kv_dtype
    return "bf16" if device.type == "cuda" else "fp32"


def _all_projections_exact(gguf: ModelFile) -> bool:
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    projections = [t for name, t in gguf.tensors.items()
                   if name.startswith("blk.") and name.split(".")[2] in kinds]
    return bool(projections) and all(t.qtype in EXACT_BLOCK_TYPES for t in projections)


class ModelRunner:
    def __init__(self, gguf: ModelFile, model_config: ModelConfig, config: EngineConfig,
                 max_model_len: int, tp: TensorParallelGroup | None = None) -> None:
        """`tp`: a worker's tensor-parallel group; rank 0 starts its own where `config.tensor_parallel` > 1."""
        self.config = config
        self.model_config = model_config
        self.model_path = gguf.path
        self.device = resolve_device(config.device)
        self.weights = resolve_weights(config, self.device, gguf)
        self.tp = tp
        try:
            self._load(gguf, model_config, config, max_model_len)
        except BaseException:
            if self.tp is not None:
                self.tp.fail(f"rank {self.tp.rank} failed to start")
            raise

    def _load(self, gguf: ModelFile, model_config: ModelConfig, config: EngineConfig, max_model_len: int) -> None:
        self.dtype = torch.bfloat16 if self.weights == "bf16" else torch.float32  # of the float projection weights
        self.lm_head = resolve_lm_head(config, self.device)
        if config.activations == "int8" and (self.weights not in ("int4", "int8") or self.device.type != "cpu"):
            raise NextokenError(f"activations=int8 applies to block weights (int4 or int8) on CPU; these weights "
                                f"are {self.weights} on {self.device.type}")
        self.activations = config.activations
        shards = plan_shards(model_config, config.tensor_parallel, self.weights in ("int4", "int8")) \
            if config.tensor_parallel > 1 else None
        if shards is not None and self.tp is None:  # rank 0: the workers load beside it
            self.tp = TensorParallelGroup.launch(config, self.device)
        if self.tp is not None and self.tp.backend == "nccl":
            self.device = self.tp.device
        start = time.perf_counter()
        self.model = load_model(gguf, model_config, dtype=self.dtype, device=self.device,
                                quant=self.weights if self.weights in ("int4", "int8") else None,
                                quantize_head=self.lm_head == "int8")
        if shards is not None and self.tp is not None:
            shard_model(self.model, shards[self.tp.rank], self.tp.all_reduce)
        if config.activations == "int8":
            self.model.set_activations("int8")
            lib = native.library()
            if lib is None or not lib.nt_has_vnni512():
                logger.warning("activations=int8 needs AVX-512 VNNI, which this CPU lacks: it changes nothing here")
        self.load_seconds = time.perf_counter() - start
        # The weights a decode step streams, onto huge pages in the background (1.06-1.17x decode at batch 1); the
        # swap happens between steps (execute).
        self.huge_pages = HugePageMove(self.model) if self.device.type == "cpu" and self.model.fused else None
        self._logits: torch.Tensor | None = None  # execute()'s logits buffer
        self._logits_views: dict[int, torch.Tensor] = {}  # its leading rows, by count (_logits_rows)
        # Pure decode steps in one native call where the model allows (ops/fused.py), rebuilt with the decoder.
        self._step: tuple[FusedPath | None, NativeStep | None] = (None, None)
        # Activations are fp32 whatever the weight format; the KV cache may be stored narrower.
        self.kv_dtype = resolve_kv_dtype(config, self.device)
        num_kv_heads = model_config.num_kv_heads if shards is None or self.tp is None \
            else shards[self.tp.rank].num_kv_heads
        self.kv_shape = KVShape(model_config.num_layers, num_kv_heads, model_config.head_dim, KV_DTYPES[self.kv_dtype])
        self.block_size = config.block_size
        # Blocks for requests; with CUDA graphs one more, after them, where padding rows write (engine/graphs.py).
        # Under tensor parallelism every rank's pool has rank 0's count (its share of the heads is the largest).
        if self.tp is None or self.tp.rank == 0:
            self.num_blocks = num_blocks = self._num_blocks(max_model_len)
            if self.tp is not None:
                self.tp.send(Command.INIT, num_blocks)
        else:
            command, num_blocks, _, _ = self.tp.receive()
            assert command == Command.INIT, f"rank {self.tp.rank} expected its pool size, got {command.name}"
            self.num_blocks = num_blocks
        use_graphs = self.device.type == "cuda" and config.cuda_graphs and self.tp is None
        # Where the native decode attention reads this cache (CPU activations are fp32), no unwritten slot is ever
        # read and the pool needs no zero fill. Padded reads need one (torch's batched decode, CUDA graphs' fixed
        # widths): masked slots get zero weight, and zero times a stray NaN would still be NaN.
        zero_fill = use_graphs or not native.attends(self.device, self.kv_shape.dtype, model_config.head_dim)
        self.kv_pool = KVPool(self.kv_shape, num_blocks + int(use_graphs), self.block_size, self.device,
                              zero_fill=zero_fill)
        self.graphs = DecodeGraphs(self.model, self.kv_pool.layers, self.block_size, pad_block=num_blocks,
                                   max_blocks=-(-max_model_len // self.block_size), max_rows=config.max_num_seqs,
                                   max_model_len=max_model_len, device=self.device) if use_graphs else None
        per_value = {"fp32": "4 bytes", "bf16": "2 bytes", "int8": "1 byte + a 2-byte scale per 32"}[self.kv_dtype]
        logger.info("KV cache (%s): %d bytes per token (2 x %d layers x %d kv heads x %d head dim x %s); "
                    "%d blocks of %d tokens = %d tokens, %.1f MiB", self.kv_dtype, self.kv_shape.bytes_per_token,
                    model_config.num_layers, num_kv_heads, model_config.head_dim, per_value,
                    num_blocks, self.block_size, self.kv_pool.num_tokens, self.kv_pool.nbytes / 2**20)

    def _num_blocks(self, max_model_len: int) -> int:
        block_bytes = self.kv_shape.bytes_per_token * self.block_size
        if self.config.kv_cache_bytes is not None:
            budget = self.config.kv_cache_bytes
        else:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
            else:
                free = available_memory_bytes()
            budget = min(int(free * self.config.kv_cache_fraction), MAX_KV_BYTES_DEFAULT)
            # No use holding more than every running sequence at full length.
            budget = min(budget, block_bytes * self.config.max_num_seqs * -(-max_model_len // self.block_size))
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise NextokenError(f"a KV cache of {budget} bytes holds no block of {self.block_size} tokens "
                                f"({block_bytes} bytes); raise kv_cache_bytes")
        return num_blocks

    def copy_block(self, src: int, dst: int) -> None:
        """Copy KV block `src` into `dst` in every layer (K, V and their scales): a forked beam's own copy of the
        block it shares with its parent and is about to write (engine/beam.py). Rank 0 has its workers copy too."""
        if self.tp is not None and self.tp.rank == 0:
            self.tp.send(Command.COPY_BLOCK, src, dst)
        for layer in self.kv_pool.layers:
            for t in (layer.k, layer.v, layer.k_scale, layer.v_scale):
                if t is not None:
                    t[dst].copy_(t[src])

    def execute(self, scheduled: list[ScheduledRequest]) -> tuple[ForwardBatch | DecodeBatch, torch.Tensor]:
        """Run one forward pass over the scheduled chunks -> (the batch, fp32 logits [num_logits, vocab])."""
        self.settle(wait=False)
        native = self._native_step(scheduled)
        if native is not None:
            return native
        drafted = self._verify_drafted(scheduled)
        if drafted is not None:
            return drafted
        return self._forward(scheduled)

    @torch.inference_mode()
    def _verify_drafted(self, scheduled: list[ScheduledRequest]) -> tuple[ForwardBatch, torch.Tensor] | None:
        """A step verifying proposals whose passes through every block the head draft already ran over these
        requests' own caches (engine/head_draft.py, `Request.spec_hidden`): only each chunk's last token runs
        through the blocks, then the LM head takes the draft's rows and those, in the rows' usual order. None
        unless every chunk is one known token that samples, with the draft's rows for all its proposals (None
        sends the step through the ordinary forward pass, which computes every proposal again)."""
        if self.tp is not None or not any(item.spec_ids for item in scheduled):
            return None
        rows: list[tuple[list[int], int, int]] = []
        for item in scheduled:
            req, k = item.request, len(item.spec_ids)
            p = req.num_computed_tokens
            if item.num_new_tokens != 1 or not item.samples or (req.params.prompt_logprobs is not None
                                                                and p < req.num_prompt_tokens):
                return None
            # Row j of the draft's passes followed the drafted tokens before it: they must be the proposals here.
            if k and (req.spec_hidden is None or req.spec_hidden[0] != p
                      or req.spec_hidden[1][:k - 1] != item.spec_ids[:k - 1] or len(req.spec_hidden[1]) < k):
                return None
            rows.append((req.block_table, item.spec_ids[-1] if k else req.all_ids[p], p + k))
        batch = ForwardBatch.single_tokens(rows, self.block_size, self.device)
        last = self.model(batch.input_ids, batch.positions, self.kv_pool.layers, batch.attn, head=False)
        parts: list[torch.Tensor] = []
        batch.sample_rows = []
        at = 0
        for i, item in enumerate(scheduled):
            batch.sample_rows.append(at)
            if item.spec_ids:
                parts.append(item.request.spec_hidden[2][:len(item.spec_ids)])  # type: ignore[index]
            parts.append(last[i:i + 1])
            at += len(item.spec_ids) + 1
        hidden = torch.cat(parts)
        return batch, self.model.compute_logits(hidden, self._logits_buffer(hidden.shape[0]))

    def _native_step(self, scheduled: list[ScheduledRequest]) -> tuple[DecodeBatch, torch.Tensor] | None:
        """A pure decode step in one native call (NativeStep), where it applies; None otherwise. Where the sampler
        says each row's argmax is all the step needs (`Sampler.argmax_only`), the call takes it too and the batch
        carries it (`argmax_ids`); the logits are written either way."""
        fused = self.model.fused
        if fused is None:
            return None
        if self._step[0] is not fused:
            self._step = (fused, NativeStep.build(self.model))
        step = self._step[1]
        if step is None or not step.applies(len(scheduled), self.kv_pool.layers):
            return None
        batch = DecodeBatch.build(scheduled, self.block_size)
        if batch is None:
            return None
        logits = self._logits_buffer(batch.rows)
        argmax = Sampler.argmax_only(item.request.params for item in scheduled)
        batch.argmax_ids = step.run(batch.ints, batch.rows, batch.table_stride, self.kv_pool.layers, logits, argmax)
        batch.logits = self._logits_rows(batch.rows)
        return batch, batch.logits

    @torch.inference_mode()
    def _forward(self, scheduled: list[ScheduledRequest]) -> tuple[ForwardBatch, torch.Tensor]:
        batch = ForwardBatch.build(scheduled, self.block_size, self.device)
        if self.tp is not None:
            return batch, self._forward_parallel(batch)
        logits = self.graphs.run(batch) if self.graphs is not None else None
        if logits is None:
            logits = self.model(batch.input_ids, batch.positions, self.kv_pool.layers, batch.attn,
                                batch.logits_indices, self._logits_out(batch))
        return batch, logits

    def _forward_parallel(self, batch: ForwardBatch) -> torch.Tensor:
        """Rank 0's pass under tensor parallelism: the inputs to the workers, then its own share. A pass that
        fails part way leaves the ranks out of step: the group is stopped."""
        assert self.tp is not None
        self.tp.send_step(batch.input_ids, batch.positions, batch.attn)
        try:
            return self.model(batch.input_ids, batch.positions, self.kv_pool.layers, batch.attn,
                              batch.logits_indices, self._logits_out(batch))
        except BaseException as exc:
            if self.tp.broken is None:
                error = self.tp.fail(f"rank 0's forward pass raised {type(exc).__name__}")
                if isinstance(exc, Exception):  # an interrupt stays one
                    raise error from exc
            raise

    def settle(self, wait: bool = True) -> bool:
        """Finish the background move of the weights onto huge pages (waiting for its copy, or only if it is ready)
        and run on the copies from now on: the fused decoder is rebuilt over their addresses. Returns whether the
        move is still pending."""
        move = self.huge_pages
        if move is None or not (wait or move.ready):
            return move is not None
        self.huge_pages = None
        if move.apply(wait=True):
            self.model.fused = FusedDecoder.build(self.model)
        return False

    def _logits_out(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Where a step's logits go: one buffer kept between steps (the logits are used before the next step;
        fresh pages would fault in on every step), grown to the largest batch yet, up to max_num_seqs rows (past
        that, a prompt's logprob rows, a fresh tensor)."""
        rows = len(batch.logits_indices) if batch.logits_indices is not None else len(batch.input_ids)
        return self._logits_buffer(rows) if rows <= self.config.max_num_seqs else None

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        if self._logits is None or self._logits.shape[0] < rows:
            self._logits = torch.empty(rows, self.model_config.vocab_size, device=self.device)
            self._logits_views = {rows: self._logits}
        return self._logits

    def _logits_rows(self, rows: int) -> torch.Tensor:
        """The buffer's first `rows` rows, the same view from step to step (slicing is a torch op)."""
        view = self._logits_views.get(rows)
        if view is None:
            view = self._logits_views[rows] = self._logits_buffer(rows)[:rows]
        return view

    @torch.inference_mode()
    def score(self, token_ids: list[int], *, modules: bool = False) -> torch.Tensor:
        """Teacher-forced fp32 logits at every position of `token_ids` ([len, vocab]), in one forward pass over a
        private cache: the engine's pool and running requests are untouched. `modules`: every block through its
        torch modules (the definition), so that hooks on them see each layer."""
        n = len(token_ids)
        pool, meta = self.score_cache(n)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        if self.tp is not None:
            self.tp.send(Command.SCORE, payload=ids)
        return self.model(ids, torch.arange(n, device=self.device), pool.layers, meta, modules=modules).float()

    def calibrate(self, token_ids: list[int]) -> None:
        """Under int8 activations, fix each block product's outlier columns from one exact pass over `token_ids`
        (ops/calibration.py: cached on disk by model file), so that every product, a decode step's included, takes
        the int8 GEMM with them and a sequence's numbers do not depend on its batch. Rank 0 has its workers calibrate
        their shares in the same pass (not cached: the ranks must agree on running it)."""
        lib = native.library()
        if self.activations != "int8" or lib is None or not lib.nt_has_vnni512():
            return
        path = self.calibration_path("columns", token_ids)
        columns = calibration.load_columns(path) if path is not None else None
        if columns is not None:
            try:
                calibration.fix_outliers(self.model, columns)
                return
            except ValueError as exc:
                logger.info("calibration cache %s not used: %s", path, exc)
        if self.tp is not None:
            self.tp.send(Command.CALIBRATE, payload=torch.tensor(token_ids, dtype=torch.long))
        n = len(token_ids)
        pool, meta = self.score_cache(n)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        with torch.inference_mode(), calibration.recording(self.model) as seen:
            self.model(ids, torch.arange(n, device=self.device), pool.layers, meta, modules=True)
        columns = calibration.columns_of(seen)
        calibration.fix_outliers(self.model, columns)
        if path is not None:
            calibration.save_columns(path, columns)

    def calibration_path(self, what: str, token_ids: Sequence[int], suffix: str = ".json") -> Path | None:
        """Where a result of a pass over `token_ids` in this model's formats is cached (ops/calibration.py); None
        under tensor parallelism (the ranks must agree on running the pass)."""
        if self.tp is not None:
            return None
        formats = f"{self.weights},{self.lm_head},{self.activations}"
        return calibration.cache_path(self.model_path, formats, token_ids, what, suffix)

    def score_cache(self, num_tokens: int) -> tuple[KVPool, AttentionMetadata]:
        """A private KV pool for one sequence of `num_tokens` and the metadata of its one pass (`score`)."""
        num_blocks = -(-num_tokens // self.block_size)
        pool = KVPool(self.kv_shape, num_blocks, self.block_size, self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device), query_start_loc=[0, num_tokens],
            seq_lens=[num_tokens], block_tables=torch.arange(num_blocks, device=self.device)[None],
            block_size=self.block_size)
        return pool, meta

    def close(self) -> None:
        """Stop the tensor-parallel workers, where there are any."""
        if self.tp is not None:
            self.tp.close()

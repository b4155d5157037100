"""A tensor-parallel worker: rank 1.. of the group. It loads the model with rank 0's settings, keeps its share (the
runner shards it) and then runs each forward pass rank 0 sends it, without an LM head, a scheduler or a sampler,
until told to stop.

`python -m nextoken.parallel.worker RANK WORLD PORT BACKEND` is how rank 0 spawns one: the engine settings come as
one JSON line on standard input, which then stays open as rank 0's lifeline (its end means rank 0 is gone: exit).
Under torchrun, ranks above 0 enter `run_worker` from the engine instead.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import torch

from nextoken.cache.kv_pool import KVCacheLayer
from nextoken.config import EngineConfig
from nextoken.errors import NextokenError
from nextoken.engine.runner import ModelRunner
from nextoken.loader.registry import open_model, resolve_model
from nextoken.models.base import CausalLM
from nextoken.models.config import ModelConfig
from nextoken.ops import calibration
from nextoken.ops.attention import AttentionMetadata
from nextoken.parallel.group import Command, TensorParallelError, TensorParallelGroup, decode_step, rank_threads


def run_worker(config: EngineConfig, group: TensorParallelGroup) -> None:
    """Load this rank's share of the model, then serve rank 0's messages until STOP."""
    torch.set_num_threads(rank_threads(config))
    gguf = open_model(resolve_model(config.model))
    model_config = ModelConfig.from_gguf(gguf)
    max_model_len = min(config.max_model_len or model_config.context_length, model_config.context_length)
    runner = ModelRunner(gguf, model_config, config, max_model_len, tp=group)
    serve_messages(runner, group)


def run_launched(config: EngineConfig) -> None:
    """A rank above 0 started by a launcher (torchrun): join its group, then serve as `run_worker`."""
    from nextoken.engine.runner import resolve_device
    from nextoken.parallel.group import backend_for

    group = TensorParallelGroup.join_launcher(config, backend_for(config, resolve_device(config.device)))
    try:
        run_worker(config, group)
    except RuntimeError as exc:  # a collective failed: rank 0 has gone, and says why itself
        raise TensorParallelError(f"rank {group.rank} stopped: {str(exc).splitlines()[0][:200]}") from None


@torch.inference_mode()
def serve_messages(runner: ModelRunner, group: TensorParallelGroup) -> None:
    while True:
        command, a, b, payload = group.receive()
        if command == Command.STOP:
            return
        if command == Command.STEP:
            ids, positions, meta = decode_step(payload, a, b, runner.block_size, runner.device)
            run_blocks(runner.model, ids, positions, runner.kv_pool.layers, meta)
        elif command == Command.COPY_BLOCK:
            runner.copy_block(a, b)
        elif command == Command.SCORE:
            pool, meta = runner.score_cache(len(payload))
            run_blocks(runner.model, payload.to(runner.device), torch.arange(len(payload), device=runner.device),
                       pool.layers, meta)
        elif command == Command.CALIBRATE:  # int8 activations' outlier columns of this rank's share
            pool, meta = runner.score_cache(len(payload))
            with calibration.recording(runner.model) as seen:
                run_blocks(runner.model, payload.to(runner.device), torch.arange(len(payload), device=runner.device),
                           pool.layers, meta)
            calibration.fix_outliers(runner.model, calibration.columns_of(seen), every_product=False)
        else:
            raise TensorParallelError(f"rank {group.rank}: unexpected message {command.name}")


def run_blocks(model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCacheLayer],
               meta: AttentionMetadata) -> None:
    """A worker's share of a forward pass: the embedding and its share of every block (their all-reduces with the
    other ranks); the final norm and LM head are rank 0's alone."""
    x = model.embed(input_ids, positions)  # [num_tokens, hidden]
    for layer, kv_cache in zip(model.layers, kv_caches):
        x = layer(x, positions, kv_cache, meta)


def _exit_when_parent_exits() -> None:
    """Read the pipe from rank 0 to its end (rank 0 closed it, or exited), then leave at once."""
    while sys.stdin.buffer.read(1 << 12):
        pass
    os._exit(0)


def main(argv: list[str]) -> int:
    rank, world, port = (int(v) for v in argv[:3])
    backend = argv[3]
    # Rank 0 owns the terminal and the service: Ctrl+C and SIGTERM reach it, and it stops its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = EngineConfig(**json.loads(sys.stdin.buffer.readline()))
    threading.Thread(target=_exit_when_parent_exits, name="nextoken-lifeline", daemon=True).start()
    group = TensorParallelGroup.join(rank, world, port, backend)
    try:
        run_worker(config, group)
    except NextokenError as exc:
        print(f"nextoken: tensor-parallel rank {rank}: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a collective failed: rank 0 has gone or failed, and says why itself
        print(f"nextoken: tensor-parallel rank {rank} stopped: {str(exc).splitlines()[0][:200]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # nothing left to tear down: the group's threads are not joined against a peer gone first

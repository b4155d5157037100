"""The tensor-parallel process group: its start (workers spawned on loopback, or joined under torchrun), the
all-reduce the sharded blocks call, and the messages rank 0 sends its workers.

Rank 0 runs the engine (scheduler, sampler, server); every other rank only runs its share of each forward pass.
Before each pass rank 0 broadcasts the step's inputs (a header, then one int64 payload: token ids, positions, slots
and the attention metadata), so all ranks run the same pass with the same inputs and meet at the same all-reduces.
Collectives time out after `tensor_parallel_timeout()`; only an idle worker waiting for its next message waits
without limit. A rank whose peer dies gets an error at once (the connection closes), never a hang. Spawned workers
read rank 0's pipe on their standard input: when rank 0 exits, however it exits, the pipe closes and they exit too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import weakref
from datetime import timedelta
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from nextoken.config import EngineConfig, tensor_parallel_timeout
from nextoken.errors import NextokenError
from nextoken.ops.attention import AttentionMetadata

IDLE_WAIT = timedelta(days=365)  # an idle worker's wait for its next message: no limit in practice
START_TIMEOUT_S = 300.0  # for a spawned worker to start (import torch, connect), while it is alive
HEADER = 4  # ints: command, payload length, two arguments


class TensorParallelError(NextokenError):
    """A tensor-parallel group that cannot start or lost a rank: names the rank and what happened."""

    http_status = 500


class Command(IntEnum):
    STOP = 0
    STEP = 1  # args: num_tokens, num_seqs
    COPY_BLOCK = 2  # args: src, dst
    SCORE = 3  # payload: token ids
    INIT = 4  # args: num_blocks
    CALIBRATE = 5  # payload: token ids (ops/calibration.py)


def rank_threads(config: EngineConfig) -> int:
    """Each rank's share of the CPU threads: `threads` (default: torch's, one per physical core) // ranks, >= 1."""
    threads = config.threads if config.threads is not None else torch.get_num_threads()
    return max(1, threads // config.tensor_parallel)


def torchrun_rank() -> int | None:
    """This process's rank where torchrun (or another launcher) set RANK, WORLD_SIZE and MASTER_ADDR; else None."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return int(os.environ["RANK"])
    return None


def backend_for(config: EngineConfig, device: torch.device) -> str:
    backend = config.tensor_parallel_backend
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if (backend == "gloo") != (device.type == "cpu"):
        raise TensorParallelError(f"tensor_parallel_backend={backend!r} does not move {device.type} tensors "
                                  f"(gloo: cpu, nccl: cuda)")
    return backend


class TensorParallelGroup:
    """One rank's view of the group. Use `launch` (rank 0) or `join` (a worker)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, backend: str, loopback: bool) -> None:
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = timedelta(seconds=tensor_parallel_timeout())
        self.store = store  # kept alive with the group
        # NCCL: this machine's GPU of the rank's local index (torchrun's LOCAL_RANK across machines).
        local = int(os.environ.get("LOCAL_RANK", rank))
        self.device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
        self.broken: str | None = None
        self.pg = _process_group(store, rank, world_size, backend, loopback, self.timeout)
        self._header = torch.zeros(HEADER, dtype=torch.long, device=self.device)
        # Rank 0's end of the group, run once: at close, when the group is collected, or at exit (a finalizer's
        # default), whichever comes first.
        self._shutdown = _Shutdown(self.pg, self.device)
        self._finalizer = weakref.finalize(self, self._shutdown) if rank == 0 else None

    @property
    def procs(self) -> list[subprocess.Popen]:
        """Rank 0's spawned workers, by rank from 1 (none under a launcher)."""
        return self._shutdown.procs

    # --- start and stop --------------------------------------------------------------------------------------

    @classmethod
    def launch(cls, config: EngineConfig, device: torch.device) -> TensorParallelGroup:
        """Rank 0's group: joined under torchrun (RANK etc. set), else with `tensor_parallel - 1` workers spawned on
        127.0.0.1 that load the same model with the same settings."""
        world = config.tensor_parallel
        backend = backend_for(config, device)
        if backend == "nccl" and torch.cuda.device_count() < world:
            raise TensorParallelError(f"tensor_parallel={world} needs {world} CUDA devices; "
                                      f"{torch.cuda.device_count()} are visible")
        if torchrun_rank() is not None:
            return cls.join_launcher(config, backend)
        store = dist.TCPStore("127.0.0.1", 0, world, True, timedelta(seconds=START_TIMEOUT_S), wait_for_workers=False)
        spec = json.dumps(dataclasses.asdict(config)).encode() + b"\n"
        procs = []
        try:
            for rank in range(1, world):
                proc = subprocess.Popen([sys.executable, "-m", "nextoken.parallel.worker", str(rank), str(world),
                                         str(store.port), backend], stdin=subprocess.PIPE)
                procs.append(proc)
                assert proc.stdin is not None
                proc.stdin.write(spec)
                proc.stdin.flush()
            _await_workers(store, procs)
            group = cls(store, 0, world, backend, loopback=True)
        except BaseException:
            _stop_procs(procs, wait_s=0.0)
            raise
        group._shutdown.procs = procs
        return group

    @classmethod
    def join(cls, rank: int, world: int, port: int, backend: str) -> TensorParallelGroup:
        """A spawned worker's group, through rank 0's store on 127.0.0.1:`port`."""
        store = dist.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=START_TIMEOUT_S))
        store.set(f"joined/{rank}", "1")
        return cls(store, rank, world, backend, loopback=True)

    @classmethod
    def join_launcher(cls, config: EngineConfig, backend: str) -> TensorParallelGroup:
        """This rank's group from the launcher's environment (torchrun's RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
        world = int(os.environ["WORLD_SIZE"])
        if world != config.tensor_parallel:
            raise TensorParallelError(f"tensor_parallel={config.tensor_parallel} but the launcher started "
                                      f"WORLD_SIZE={world} processes")
        store, rank, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=START_TIMEOUT_S)))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        return cls(store, rank, world, backend, loopback=False)

    def close(self) -> None:
        """Stop the workers: a STOP message where the group is in step, then (spawned ones) their pipe closed and
        their exit awaited, killed after 5 s."""
        if self.broken is None:
            self.broken = "the group was closed"
        if self._finalizer is not None:
            self._finalizer()

    def fail(self, reason: str) -> TensorParallelError:
        """Mark the group broken (its ranks may be out of step: no STOP message) and stop the workers; the error to
        raise."""
        if self.broken is None:
            self.broken = reason
        self._shutdown.in_step = False
        if self._finalizer is not None:
            self._finalizer()
        return TensorParallelError(f"tensor parallelism stopped: {self.broken}")

    # --- collectives -----------------------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum `x` across the ranks, in place."""
        try:
            self.pg.allreduce([x]).wait()
        except RuntimeError as exc:
            raise self.fail(f"an all-reduce failed ({self._lost(exc)})") from None

    def send(self, command: Command, a: int = 0, b: int = 0, payload: torch.Tensor | None = None) -> None:
        """Rank 0: a message for every worker (`payload`: int64 [n] on any device)."""
        assert self.rank == 0
        if self.broken is not None:
            raise TensorParallelError(f"tensor parallelism stopped: {self.broken}")
        try:
            self._broadcast_header(command, 0 if payload is None else payload.numel(), a, b)
            if payload is not None and payload.numel():
                self._broadcast(payload.to(self.device, torch.long).contiguous(), self.timeout)
        except RuntimeError as exc:
            raise self.fail(f"sending a step failed ({self._lost(exc)})") from None

    def receive(self) -> tuple[Command, int, int, torch.Tensor]:
        """A worker: the next message, (command, a, b, payload), waiting without limit for its header."""
        self._broadcast(self._header, IDLE_WAIT)
        command, length, a, b = self._header.tolist()
        payload = torch.empty(length, dtype=torch.long, device=self.device)
        if length:
            self._broadcast(payload, self.timeout)
        return Command(command), a, b, payload

    def _broadcast_header(self, command: Command, length: int, a: int, b: int) -> None:
        self._header.copy_(torch.tensor([int(command), length, a, b]))
        self._broadcast(self._header, self.timeout)

    def _broadcast(self, x: torch.Tensor, timeout: timedelta) -> None:
        _broadcast(self.pg, x, timeout)

    def _lost(self, exc: RuntimeError) -> str:
        """Which spawned worker has exited, with its exit code, else the collective's own message."""
        time.sleep(0.05)  # a crashed worker's exit is reaped a moment after its connection closes
        gone = [f"worker rank {r} exited with code {p.poll()}" for r, p in enumerate(self.procs, 1)
                if p.poll() is not None]
        return "; ".join(gone) if gone else str(exc).splitlines()[0][:200]

    # --- a step's inputs -------------------------------------------------------------------------------------

    def send_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Rank 0: a forward pass's inputs, for the workers to run the same pass (`decode_step`)."""
        firsts = meta.first_blocks or [None] * meta.num_seqs
        lists = torch.tensor(meta.query_start_loc + meta.seq_lens + [-1 if f is None else f for f in firsts])
        payload = torch.cat((input_ids.cpu(), positions.cpu(), meta.slot_mapping.cpu(), lists,
                             meta.block_tables.cpu().flatten()))
        self.send(Command.STEP, len(input_ids), meta.num_seqs, payload)


def decode_step(payload: torch.Tensor, num_tokens: int, num_seqs: int, block_size: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A worker: (input_ids, positions, metadata) from a STEP payload, as `send_step` laid them out: ids, positions
    and slots [num_tokens] each, query starts [num_seqs + 1], context lengths and first blocks (-1: none)
    [num_seqs] each, then the block tables [num_seqs, max_blocks]."""
    n, s = num_tokens, num_seqs
    ints = payload[3 * n:3 * n + 3 * s + 1].tolist()
    firsts = [None if f < 0 else f for f in ints[2 * s + 1:]]
    tables = payload[3 * n + 3 * s + 1:].view(s, -1).to(device)
    meta = AttentionMetadata(slot_mapping=payload[2 * n:3 * n].to(device), query_start_loc=ints[:s + 1],
                             seq_lens=ints[s + 1:2 * s + 1], block_tables=tables, block_size=block_size,
                             first_blocks=firsts)
    return payload[:n].to(device), payload[n:2 * n].to(device), meta


def _process_group(store: dist.Store, rank: int, world: int, backend: str, loopback: bool,
                   timeout: timedelta) -> Any:
    """A gloo group bound to 127.0.0.1 where `loopback` (else the launcher's interface), or an NCCL one: the
    backend object itself, outside torch.distributed's global state, so that a process may hold several groups one
    after another (an `LLM` closed, another made)."""
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise TensorParallelError("tensor_parallel_backend='nccl': this torch build has no NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    gloo = dist.ProcessGroupGloo
    if not loopback:
        return gloo(store, rank, world, timeout)
    opts = gloo._Options()  # type: ignore[attr-defined]  # the one way to bind gloo to an address
    opts._devices = [gloo.create_device(hostname="127.0.0.1")]  # every connection on loopback
    opts._timeout = timeout
    return gloo(store, rank, world, opts)


def _broadcast(pg: Any, x: torch.Tensor, timeout: timedelta) -> None:
    """Rank 0's `x` into every rank's."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, timeout
    pg.broadcast([x], opts).wait()


class _Shutdown:
    """Rank 0's end of a group: STOP to the workers where the ranks are still in step, then the spawned workers'
    pipes closed and their exit awaited (killed after 5 s)."""

    def __init__(self, pg: Any, device: torch.device) -> None:
        self.pg, self.device = pg, device
        self.procs: list[subprocess.Popen] = []
        self.in_step = True

    def __call__(self) -> None:
        if self.in_step:
            self.in_step = False
            try:
                _broadcast(self.pg, torch.tensor([int(Command.STOP), 0, 0, 0], device=self.device),
                           timedelta(seconds=5))
            except RuntimeError:
                pass  # a worker already gone: the rest are stopped below
        _stop_procs(self.procs, 5.0)


def _await_workers(store: dist.TCPStore, procs: list[subprocess.Popen]) -> None:
    """Wait until every spawned worker has connected, failing at once if one exits first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for rank, proc in enumerate(procs, 1):
        while not store.check([f"joined/{rank}"]):
            if proc.poll() is not None:
                raise TensorParallelError(f"tensor-parallel worker rank {rank} exited with code {proc.returncode} "
                                          "before joining (see its message above)")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel worker rank {rank} did not start within "
                                          f"{START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)


def _stop_procs(procs: list[subprocess.Popen], wait_s: float) -> None:
    """Close each worker's pipe (it exits when it reads the end), wait up to `wait_s` in all, then kill."""
    for proc in procs:
        if proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
    deadline = time.monotonic() + wait_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

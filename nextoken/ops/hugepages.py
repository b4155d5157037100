"""The weights a decode step reads, moved onto 2 MB pages.

A decode step at batch 1 streams every weight from memory once, and with 4 KB pages that stream crosses a page,
and misses the TLB, every 4 KB: the hardware prefetchers stop at page boundaries, so each new page starts cold.
On 2 MB pages the same read ran 1.3-1.4x faster (Gemma 3's 253 MB on 2 Zen 4 cores: 38 GB/s from the file's page
cache, 35 GB/s from ordinary anonymous memory, 54 GB/s from huge pages). Linux hands anonymous memory huge pages
where they are asked for (`madvise(MADV_HUGEPAGE)`) when transparent huge pages are set to `madvise` or `always`;
the file's own pages (a read-only mmap of the page cache) never get them.

`HugePageMove` copies the block tensors of a loaded model (projections, the block token table and the LM head
over it) into one such buffer in the background, and points the modules at the copies when asked; the originals
are freed. Where the kernel gives no huge pages (THP off, or not Linux) the copy still works: it is ordinary memory
then.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import sys
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from nextoken.ops.quant_head import BlockEmbedding, Int8GroupHead
    from nextoken.ops.quant_linear import BlockWeight

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23  # linux/mman.h (the second from Linux 5.14)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library on Linux (madvise, malloc_trim), through ctypes, which lets go of the GIL for each call."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _madvise(address: int, length: int, advice: int) -> bool:
    libc = _libc()
    return libc is not None and libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) == 0


def huge_buffer(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 tensor of `nbytes` on 2 MB pages where the kernel gives them (any memory otherwise).

    A fresh anonymous mapping, never memory a heap hands back (whose pages may be in place already, as 4 KB ones),
    advised for huge pages and populated in one call: 30 ms for 300 MB of huge pages on 2 Zen 4 cores, against
    300-670 ms faulting them in by first writes (135 ms for 4 KB pages); on a VM whose host backs fresh guest memory
    on first touch, up to 0.8 s. The tensor keeps the mapping alive."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags) if flags else mmap.mmap(-1, nbytes + HUGE_PAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    if _madvise(raw.data_ptr() + start, length, MADV_HUGEPAGE):  # else no THP here: plain pages
        _madvise(raw.data_ptr() + start, length, MADV_POPULATE_WRITE)
    return raw[start:start + nbytes]


class _Arena:
    """Where each of a set of CPU tensors (each counted once, by identity) goes in one buffer, 64-byte aligned."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        unique: dict[int, torch.Tensor] = {}
        for t in tensors:
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("only contiguous CPU tensors move onto huge pages")
            unique.setdefault(id(t), t)
        self.tensors, self.offsets, self.size = unique, {}, 0
        for key, t in unique.items():
            self.offsets[key] = self.size
            self.size += -(-t.nbytes // ALIGN) * ALIGN
        self.buffer: torch.Tensor | None = None

    def fill(self) -> None:
        """Allocate the buffer and copy every tensor into it: ctypes calls past the allocation, the GIL let go."""
        if self.size == 0:
            return
        buffer = huge_buffer(self.size)
        base = buffer.data_ptr()
        for key, t in self.tensors.items():
            ctypes.memmove(base + self.offsets[key], t.data_ptr(), t.nbytes)
        self.buffer = buffer

    def copies(self) -> dict[int, torch.Tensor]:
        """The filled copies, keyed by id() of the original."""
        if self.buffer is None:
            return {}
        return {key: self.buffer[at:at + t.nbytes].view(t.dtype).view(t.shape)
                for key, t in self.tensors.items() for at in (self.offsets[key],)}


def gather(tensors: Iterable[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Copies of contiguous CPU `tensors` (each counted once, by identity) in one huge_buffer, keyed by id() of the
    original. The buffer lives as long as any copy does."""
    arena = _Arena(tensors)
    arena.fill()
    return arena.copies()


class HugePageMove:
    """Moves the block tensors of a loaded model (BlockLinear parts, BlockEmbedding, Int8GroupHead) onto huge pages:
    the copy runs in a background thread from construction, and `apply` points the modules at the copies once they
    are ready (the originals are then freed). The engine applies it between steps, so nothing runs over a tensor
    while it is swapped, and a load does not wait for the huge pages. Whatever holds the tensors' addresses
    (FusedDecoder) must be rebuilt after `apply`."""

    def __init__(self, model: nn.Module) -> None:
        from nextoken.ops.quant_head import BlockEmbedding, Int8GroupHead  # noqa: PLC0415
        from nextoken.ops.quant_linear import BlockLinear  # noqa: PLC0415

        self._weights: list[BlockWeight] = []
        self._tables: list[BlockEmbedding | Int8GroupHead] = []
        for module in model.modules():
            if isinstance(module, BlockLinear) and module.lib is not None:
                self._weights += module.parts
            elif isinstance(module, Int8GroupHead) and module.lib is not None:
                self._weights.append(module.blocks)
                if module.codes is not None:
                    self._tables.append(module)
            elif isinstance(module, BlockEmbedding):
                self._tables.append(module)
        tensors = [t for w in self._weights for t in (w.qs, w.d, w.m) if t is not None]
        tensors += [t for m in self._tables for t in (m.codes, m.scales) if t is not None]
        self._arena = _Arena(tensors)
        self.bytes = self._arena.size
        self.applied = False
        # Not a daemon: a process quitting mid-copy waits for it (at most the population's time) rather than have
        # the interpreter stop the thread in a native call, which aborted a quick `nextoken run` error exit.
        self._thread = threading.Thread(target=self._fill, name="nextoken-huge-pages")
        self._thread.start()

    def _fill(self) -> None:
        try:
            self._arena.fill()
        except (OSError, ValueError) as e:  # out of memory or address space: the weights stay where they are
            logger.warning("weights not moved onto huge pages: %s", e)

    @property
    def ready(self) -> bool:
        return not self._thread.is_alive()

    def apply(self, wait: bool = False) -> bool:
        """Point the modules at the copies, once they are ready (at once with `wait`); True when that happened in
        this call."""
        if self.applied or not (wait or self.ready):
            return False
        self._thread.join()
        self.applied = True
        copies = self._arena.copies()
        if not copies:
            return False
        for w in self._weights:
            w.qs, w.d = copies[id(w.qs)], copies[id(w.d)]
            if w.m is not None:
                w.m = copies[id(w.m)]
        for m in self._tables:
            m.codes, m.scales = copies[id(m.codes)], copies[id(m.scales)]
        self._weights, self._tables, self._arena = [], [], _Arena(())
        _release_freed_memory()
        return True


def _release_freed_memory() -> None:
    """Hand the freed originals' memory back to the system: glibc keeps what the loader's many smaller allocations
    freed (Gemma 3: 771 MB resident after the move, 663 MB after this, 700 MB before the move)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):  # glibc's
        libc.malloc_trim(0)

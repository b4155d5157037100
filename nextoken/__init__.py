"""nextoken: an LLM inference engine that shows its work.

Public API: `LLM`, `SamplingParams`, `EngineConfig`. Imports are lazy, so `import nextoken` loads neither torch nor
a model.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# OpenMP's workers (libgomp's: torch's parallel regions and the native kernels') spin this many rounds waiting for
# the next region before they sleep. libgomp's default, 300,000 rounds (milliseconds), costs nothing on an idle
# machine, but beside another busy process the waiting threads burn the time slices that the threads they wait for
# need: two processes decoding at once on 2 cores each ran at a quarter of their speed alone, or far less, instead
# of about half. 300 rounds (microseconds) still spans the gaps between the default formats' regions, which then
# decode alone as fast as before (fp32 weights, with Python between torch's regions, about 7% slower: see
# docs/design-cpu.md and benchmarks/contention.py). libgomp reads it when it loads, so it counts only where nextoken
# is imported before torch; a value already set in the environment is kept.
SPIN_ROUNDS = "300"
os.environ.setdefault("GOMP_SPINCOUNT", SPIN_ROUNDS)

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "__version__"]

if TYPE_CHECKING:
    from nextoken.config import EngineConfig
    from nextoken.llm import LLM
    from nextoken.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from nextoken.llm import LLM

        return LLM
    if name == "SamplingParams":
        from nextoken.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from nextoken.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'nextoken' has no attribute {name!r}")

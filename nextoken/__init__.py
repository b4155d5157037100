"""nextoken: an LLM inference engine that shows its work.

Public API: `LLM`, `SamplingParams`, `EngineConfig`. Imports are lazy, so `import nextoken` loads neither torch nor
a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

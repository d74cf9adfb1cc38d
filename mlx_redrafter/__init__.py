"""mlx-redrafter: ReDrafter speculative decoding for mlx-lm models."""

from .config import DEFAULT_TREE, CacheConfig, SamplingConfig, StopConfig, TreeConfig
from .drafter import Drafter, DrafterConfig
from .generate import (
    GenerationResponse,
    batch_generate,
    generate,
    stream_batch,
    stream_generate,
)
from .loading import load, load_drafter
from .policy import SpeedGuard, TreePolicy
from .prompt_cache import PrefixStore, PromptCache
from .session import DecodingSession, Request, Update

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TREE",
    "CacheConfig",
    "DecodingSession",
    "Drafter",
    "DrafterConfig",
    "GenerationResponse",
    "PrefixStore",
    "PromptCache",
    "Request",
    "SamplingConfig",
    "SpeedGuard",
    "StopConfig",
    "TreeConfig",
    "TreePolicy",
    "Update",
    "batch_generate",
    "generate",
    "load",
    "load_drafter",
    "stream_batch",
    "stream_generate",
]

"""mlx-redrafter: ReDrafter speculative decoding for mlx-lm models."""

from .config import BeamConfig, CacheConfig, SamplingConfig, StopConfig
from .drafter import Drafter, DrafterConfig
from .generate import (
    GenerationResponse,
    batch_generate,
    generate,
    stream_batch,
    stream_generate,
)
from .loading import load, load_drafter

__version__ = "0.1.0"

__all__ = [
    "BeamConfig",
    "CacheConfig",
    "Drafter",
    "DrafterConfig",
    "GenerationResponse",
    "SamplingConfig",
    "StopConfig",
    "batch_generate",
    "generate",
    "load",
    "load_drafter",
    "stream_batch",
    "stream_generate",
]

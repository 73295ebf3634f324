"""tinydraft-mlx: exact speculative decoding on Apple MLX."""

from .loading import ModelLoadError, load_models
from .sampling import ParameterError, SamplingParams, warp
from .speculative import Token, generate, stream_generate
from .stats import GenerationStats

__all__ = [
    "GenerationStats",
    "ModelLoadError",
    "ParameterError",
    "SamplingParams",
    "Token",
    "generate",
    "load_models",
    "stream_generate",
    "warp",
]
__version__ = "0.1.0"

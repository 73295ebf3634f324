"""tinydraft-mlx: exact speculative decoding on Apple MLX."""

from .backend import active_blas, preload_blas

preload_blas()  # must precede the first `import mlx.core` (see backend.py)

from .api import generate, stream_generate
from .batching import batch_generate
from .engine.drafters import Hybrid
from .engine.lookup import PromptLookup
from .engine.policy import DraftLengthPolicy
from .engine.rounds import BatchDecoder, Finished, Token
from .engine.sampling import ParameterError, SamplingParams, warp
from .engine.stats import GenerationStats
from .loading import ModelLoadError, load_models
from .options import Options, make_options
from .prompt_cache import PromptCache, PromptCacheError
from .text import GenerationResponse

__all__ = [
    "active_blas",
    "BatchDecoder",
    "batch_generate",
    "Finished",
    "DraftLengthPolicy",
    "GenerationResponse",
    "Hybrid",
    "PromptCache",
    "PromptCacheError",
    "PromptLookup",
    "GenerationStats",
    "ModelLoadError",
    "Options",
    "ParameterError",
    "SamplingParams",
    "Token",
    "generate",
    "load_models",
    "make_options",
    "stream_generate",
    "warp",
]
__version__ = "0.2.0"

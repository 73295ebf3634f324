"""tinydraft-mlx: exact speculative decoding on Apple MLX."""

from .engine.backend import active_blas, preload_blas

preload_blas()  # must precede the first `import mlx.core` (see backend.py)

from .engine.drafters import (
    HostDrafter,
    HostProposal,
    Hybrid,
    Source,
    register_drafter,
    registered_drafters,
    unregister_drafter,
)
from .engine.drafters.lookup import PromptLookup
from .engine.drafters.mtp import MtpHead
from .engine.policy import DraftLengthPolicy
from .engine.rounds import BatchDecoder, Finished, Token
from .engine.sampling import ParameterError, SamplingParams, warp
from .engine.stats import GenerationStats
from .generation.api import generate, stream_generate
from .generation.batching import batch_generate
from .generation.loading import ModelLoadError, load_head, load_models
from .generation.options import Options, make_options
from .generation.prompt_cache import PromptCache, PromptCacheError
from .generation.text import GenerationResponse

__all__ = [
    "active_blas",
    "BatchDecoder",
    "batch_generate",
    "Finished",
    "DraftLengthPolicy",
    "GenerationResponse",
    "HostDrafter",
    "HostProposal",
    "Hybrid",
    "PromptCache",
    "PromptCacheError",
    "PromptLookup",
    "GenerationStats",
    "ModelLoadError",
    "MtpHead",
    "Options",
    "ParameterError",
    "SamplingParams",
    "Source",
    "Token",
    "generate",
    "load_head",
    "load_models",
    "make_options",
    "register_drafter",
    "registered_drafters",
    "stream_generate",
    "unregister_drafter",
    "warp",
]
__version__ = "0.2.0"

"""Sampling and acceptance, the pure parts: one warp for draft and target and the draws
(warp.py), the acceptance rule of speculative decoding (rejection.py), and a seed's noise and
coupling (seeded.py)."""

from .warp import (
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    ParameterError,
    Processor,
    SamplingParams,
    check_float,
    check_int,
    draw,
    draw_at,
    invert_cdf,
    process_logits,
    sample_rows,
    sampling_groups,
    warp,
    with_warp,
)

__all__ = [
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "ParameterError",
    "Processor",
    "SamplingParams",
    "check_float",
    "check_int",
    "draw",
    "draw_at",
    "invert_cdf",
    "process_logits",
    "sample_rows",
    "sampling_groups",
    "warp",
    "with_warp",
]

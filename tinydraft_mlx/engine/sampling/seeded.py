"""Seeded sampling: randomness keyed by (seed, absolute position), so that a seed fixes the text.

A seeded sequence's token at position t (its index in prompt + output) is the Gumbel-max sample
argmax_x(log p_t(x) + G_t(x)), where p_t is the target's warped distribution there and G_t(x) a
standard Gumbel variate computed from (seed, t, x) alone (`noise`): an exact draw from p_t, and
what plain decoding with that seed emits. In a speculative round the draft proposes with the same
noise (argmax_x(log q + G_t(x)) at each position t it drafts), the target's choice is made at
each verified position, and the drafts are accepted while they equal it; the token after them is
the target's own choice. So every emitted token is the one plain decoding with the seed emits,
whatever the drafter, k, or the rows beside it: the text depends only on the prompt, the settings
and the seed. A draft is accepted with probability P(argmax(log p + G) = argmax(log q + G)),
which is at most sum_x min(p, q), the acceptance of min(1, p/q) rejection sampling (unseeded rows
keep that rule; what the difference costs is measured in results/seeded.json).

The noise is a counter-based hash (MurmurHash3's 32-bit finalizer, chained over the seed's two
halves, the position and the token id); it needs no state, so a position's noise is the same in
any round, batch or process, on any backend. Two hashes give a uniform w in (0, 1) with 48 bits
(`gumbel_of`), and the noise is the Gumbel quantile at 1 - w, -log(-log1p(-w)), computed from w
so that float32 keeps its resolution where the upper tail needs it: the noise spans about
[-3.5, 33.6], and a token whose probability is down to e^-36 of the top one's can still be drawn
(24 bits would bound it to [-2.8, 17.3]: no token below e^-20 of the top). The draw differs
from an exact Gumbel-max only on events of probability below 2^-47.
"""

from __future__ import annotations

import mlx.core as mx

_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35  # MurmurHash3 fmix32's multipliers
_GOLDEN = 0x9E3779B9  # spreads token ids apart before mixing
_SECOND = 0x27D4EB2F  # the second chain's constant (xxHash's 32-bit prime 3)


def _u32(value: int) -> mx.array:
    return mx.array(value & 0xFFFFFFFF, dtype=mx.uint32)


def _mix(x: mx.array) -> mx.array:
    """MurmurHash3's fmix32 on uint32 arrays (multiplication wraps modulo 2^32)."""
    x = x ^ (x >> _u32(16))
    x = x * _u32(_M1)
    x = x ^ (x >> _u32(13))
    x = x * _u32(_M2)
    return x ^ (x >> _u32(16))


_TOP = 1.0 - 2.0**-24  # the largest float32 below 1


def gumbel_of(high: mx.array, low: mx.array) -> mx.array:
    """Standard Gumbel variates from two uint32 hashes: w = (high's top 24 bits + (low's top 24
    bits + 1/2) / 2^24) / 2^24, a uniform in (0, 1) with 48 bits, fine near 0; the quantile
    -log(-log(1 - w)) taken as -log(-log1p(-w)), so that a small w (the upper tail) keeps its
    precision."""
    w = ((high >> _u32(8)).astype(mx.float32) * 2.0**-24
         + ((low >> _u32(8)).astype(mx.float32) + 0.5) * 2.0**-48)
    w = mx.minimum(w, _TOP)  # a rounding up to 1 is the lower tail's last step
    return -mx.log(-mx.log1p(-w))


def _gumbel(seed_lo: mx.array, seed_hi: mx.array, positions: mx.array,
            tokens: mx.array) -> mx.array:
    base = _mix(_mix(_mix(seed_hi) ^ seed_lo) ^ positions)  # (n, 1)
    high = _mix(base ^ (tokens * _u32(_GOLDEN)))  # (n, V)
    # the low bits from a second chain (other order and constants), not from `high`
    base2 = _mix(_mix(_mix(seed_lo ^ _u32(_SECOND)) ^ seed_hi) ^ positions)
    low = _mix(base2 ^ (tokens * _u32(_SECOND)))
    return gumbel_of(high, low)


def _scores(probs: mx.array, gumbel: mx.array) -> mx.array:
    return mx.where(probs > 0, mx.log(mx.maximum(probs, 1e-38)) + gumbel, -mx.inf)


@mx.compile
def _picked(probs: mx.array, seed_lo: mx.array, seed_hi: mx.array, positions: mx.array,
            tokens: mx.array) -> mx.array:
    return mx.argmax(_scores(probs, _gumbel(seed_lo, seed_hi, positions, tokens)),
                     axis=-1).astype(mx.int32)


@mx.compile
def _coupled(p: mx.array, drafts: mx.array, seed_lo: mx.array, seed_hi: mx.array,
             positions: mx.array, tokens: mx.array) -> mx.array:
    chosen = _picked(p, seed_lo, seed_hi, positions, tokens)  # (k + 1,)
    same = (chosen[:-1] == drafts).astype(mx.int32)
    n = mx.cumprod(same).sum().reshape(1).astype(mx.int32)
    return mx.concatenate([n, mx.take(chosen, n)])


_TOKENS: dict[int, mx.array] = {}  # width -> token ids 0..width-1 (uint32)


def _inputs(seed: int, start: int, n: int, width: int) -> tuple[mx.array, ...]:
    tokens = _TOKENS.get(width)
    if tokens is None:
        tokens = _TOKENS[width] = mx.arange(width, dtype=mx.uint32)[None]
    positions = mx.arange(start, start + n, dtype=mx.uint32)[:, None]
    return _u32(seed), _u32(seed >> 32), positions, tokens


def noise(seed: int, start: int, n: int, width: int) -> mx.array:
    """(n, width) float32 standard Gumbel variates for positions start..start+n-1 and token ids
    0..width-1 of the sequence seeded with `seed` (0 <= seed < 2^63)."""
    return _gumbel(*_inputs(seed, start, n, width))


def choose(probs: mx.array, seed: int, start: int) -> mx.array:
    """The seeded choices at positions start..start+n-1 from `probs` (n, V): argmax(log probs +
    `noise`) per position, in one compiled graph (a zero-probability token is never chosen)."""
    n, width = probs.shape
    return _picked(probs, *_inputs(seed, start, n, width))


def coupled_accept(p: mx.array, drafts: mx.array, seed: int, start: int) -> mx.array:
    """[n, token] of a seeded row's drafting round: p (k + 1, V) its warped target distributions
    at positions start..start+k, `drafts` (k,) its proposals; the target's choice at every
    position, the drafts accepted while they equal it, then the target's choice after them."""
    k1, width = p.shape
    return _coupled(p, drafts.astype(mx.int32), *_inputs(seed, start, k1, width))

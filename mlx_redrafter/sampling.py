"""The target's token choice at every tree node: greedy or sampled.

Shapes: B batch, N packed tokens, V vocabulary.
"""

from __future__ import annotations

import mlx.core as mx

from .config import SamplingConfig


def normalize(logits: mx.array) -> mx.array:
    """Log-probabilities, computed as mlx-lm does before it samples. (..., V) -> (..., V)"""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def filter_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (ties kept).

    A token survives when the mass of the tokens strictly ranked above it is below top_p.
    (..., V) -> (..., V) with dropped tokens at -inf.
    """
    descending = -mx.sort(-logprobs, axis=-1)  # (..., V)
    probs = mx.exp(descending.astype(mx.float32))
    mass_before = mx.cumsum(probs, axis=-1) - probs  # (..., V) exclusive cumulative mass
    total = mx.sum(probs, axis=-1, keepdims=True)
    num_kept = mx.sum(mass_before < top_p * total, axis=-1, keepdims=True)  # (..., 1) >= 1
    threshold = mx.take_along_axis(descending, num_kept - 1, axis=-1)  # (..., 1)
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


def filter_top_k(logprobs: mx.array, top_k: int) -> mx.array:
    """Keep the top_k most likely tokens. (..., V) -> (..., V) with the rest at -inf."""
    vocab_size = logprobs.shape[-1]
    if top_k >= vocab_size:
        return logprobs
    dropped = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, dropped, mx.array(-mx.inf, logprobs.dtype), axis=-1)


def target_distribution(logits: mx.array, sampling: SamplingConfig) -> mx.array:
    """Log-weights of the distribution plain sampling draws from (unnormalized).

    (..., V) -> (..., V); for greedy, the normalized log-probs (argmax is the choice).
    """
    logprobs = normalize(logits)
    if sampling.greedy:
        return logprobs
    if sampling.top_p < 1.0:
        logprobs = filter_top_p(logprobs, sampling.top_p)
    if sampling.top_k > 0:
        logprobs = filter_top_k(logprobs, sampling.top_k)
    return logprobs * (1.0 / sampling.temperature)


def choose_tokens(logits: mx.array, sampling: SamplingConfig, key: mx.array | None) -> mx.array:
    """One target choice per node: argmax, or an independent sample.

    logits: (B, N, V); key: an MLX PRNG key (required when sampling) -> (B, N) int32
    """
    weights = target_distribution(logits, sampling)
    if sampling.greedy:
        return mx.argmax(weights, axis=-1).astype(mx.int32)
    return mx.random.categorical(weights, axis=-1, key=key).astype(mx.int32)

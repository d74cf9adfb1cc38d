"""The target's token choice at every tree node: greedy or sampled.

Shapes: B batch, N packed tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .config import SamplingConfig


def normalize(logits: mx.array) -> mx.array:
    """Log-probabilities, computed as mlx-lm does before it samples. (..., V) -> (..., V)"""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def filter_top_p(logprobs: mx.array, top_p: float | mx.array) -> mx.array:
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
    Without top-p and top-k the logits are only tempered: a sample does not change when
    every log-weight of a node moves by the same amount, so the log-softmax (an exp
    over the vocabulary at every node) is skipped.
    """
    if not sampling.greedy and sampling.top_p >= 1.0 and sampling.top_k == 0:
        return logits * (1.0 / sampling.temperature)
    logprobs = normalize(logits)
    if sampling.greedy:
        return logprobs
    if sampling.top_p < 1.0:
        logprobs = filter_top_p(logprobs, sampling.top_p)
    if sampling.top_k > 0:
        logprobs = filter_top_k(logprobs, sampling.top_k)
    return logprobs * (1.0 / sampling.temperature)


def scramble_keys(keys: mx.array) -> mx.array:
    """A row's key as `position_keys` takes it: the request's key split once.
    (B, 2) -> (B, 2). The position enters the second word of a row key, so without
    the split keys from small seeds (`mx.random.key(s)` is (0, s)) would share noise
    across requests: seed s at position p would draw what seed s' draws at position
    p ^ s ^ s'. Done once per request, when its row is made (`decode.row_keys`)."""
    return mx.vmap(lambda key: mx.random.split(key, 2)[0])(keys)  # (B, 2)


def position_keys(row_keys: mx.array, positions: mx.array) -> mx.array:
    """The PRNG key of the token at each position: (B, 2) row keys (`scramble_keys`),
    (B, N) -> (B, N, 2)."""
    batch_size, num_tokens = positions.shape
    first = mx.broadcast_to(row_keys[:, None, 0], (batch_size, num_tokens))
    second = row_keys[:, None, 1] ^ positions.astype(mx.uint32)
    return mx.stack([first, second], axis=-1)


def gumbel_max(weights: mx.array, noise: mx.array) -> mx.array:
    """Gumbel-max sampling with the noise of each node's position.

    weights: (B, N, V) unnormalized log-weights; noise: (B, N, V) -> (B, N) int32.
    With `position_noise` of `position_keys`, the noise of a node depends only on its
    row's key and its absolute position: the walk uses one node per position, so each
    emitted token is an independent exact sample, and a seeded row emits the same
    tokens as plain sampling with that seed, whatever the tree or the batch.
    """
    return mx.argmax(weights + noise, axis=-1).astype(mx.int32)


def position_noise(keys: mx.array, vocab_size: int) -> mx.array:
    """The Gumbel noise a sample at each key's position adds to the log-weights:
    the same bits wherever it is drawn (verification, or the drafter drafting the token
    the target will sample there). (B, N, 2) keys -> (B, N, V)"""
    batch_size, num_tokens = keys.shape[:2]
    flat_keys = keys.reshape(batch_size * num_tokens, 2)  # (B*N, 2)
    noise = mx.vmap(lambda key: mx.random.gumbel(shape=(vocab_size,), key=key))(flat_keys)
    return noise.reshape(batch_size, num_tokens, vocab_size)  # (B, N, V)


def choose_tokens(
    logits: mx.array,
    sampling: SamplingConfig | Sequence[SamplingConfig],
    noise: mx.array | None,
) -> mx.array:
    """One target choice per node: argmax, or an independent sample.

    logits: (B, N, V); sampling: one config for all rows, or one per row;
    noise: (B, N, V) the Gumbel noise of each node's position (`position_noise`;
    required when a row samples) -> (B, N) int32
    """
    if not isinstance(sampling, SamplingConfig):
        if len(set(sampling)) > 1:
            return choose_tokens_per_row(logits, sampling, noise)
        sampling = sampling[0]
    weights = target_distribution(logits, sampling)
    if sampling.greedy:
        return mx.argmax(weights, axis=-1).astype(mx.int32)
    if noise is None:
        raise ValueError("sampling needs the nodes' noise")
    return gumbel_max(weights, noise)


def greedy_tokens(logits: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy choices from the raw fp32 logits, and whether mlx-lm's could differ anywhere.

    mlx-lm takes the argmax of logits - logsumexp(logits). Subtracting one number and
    rounding keeps the order of the logits but may merge values closer than one
    rounding step of the result; the merged results near the top lie within log V of
    zero, below 16 for any vocabulary under 8.8M tokens, where a step is at most 8 eps.
    When a merge makes an earlier index tie with the maximum, mlx-lm's argmax (first
    index) picks it. So the raw argmax is mlx-lm's choice unless an earlier logit lies
    within that step of the maximum; `unsure` flags that case (a margin of 128 eps),
    and the caller then takes `choose_tokens`. This skips the log-softmax (an exp over
    the whole vocabulary at every node), the costliest part of greedy verification,
    and reads the logits twice (their maximum, then the first index near it): with a
    262k vocabulary each pass over N x V logits is a cost of its own.

    logits: (B, N, V) float32 -> choices (B, N) int32, unsure () bool
    """
    best = mx.max(logits, axis=-1, keepdims=True)  # (B, N, 1)
    margin = 128 * mx.finfo(logits.dtype).eps
    # The first index within the margin of the maximum: the raw argmax when it holds
    # the maximum itself, else an earlier near-tie that mlx-lm's rounding may merge.
    first_near = mx.argmax(logits >= best - margin, axis=-1).astype(mx.int32)  # (B, N)
    value = mx.take_along_axis(logits, first_near[..., None], axis=-1)  # (B, N, 1)
    return first_near, mx.any(value < best)


def choose_tokens_quickly(
    logits: mx.array,
    sampling: SamplingConfig | Sequence[SamplingConfig],
    noise: mx.array | None,
) -> tuple[mx.array, mx.array]:
    """`choose_tokens`, skipping the log-softmax when every row is greedy and the
    logits are fp32 (in half precision a rounding step is so coarse that near-ties are
    common, so the exact choice is taken directly).

    logits: (B, N, V) -> choices (B, N) int32, unsure () bool: when True, the choices
    may differ from `choose_tokens` and must be replaced by it (see `greedy_tokens`).
    """
    rules = [sampling] if isinstance(sampling, SamplingConfig) else list(sampling)
    if logits.dtype == mx.float32 and all(rule.greedy for rule in rules):
        return greedy_tokens(logits)
    return choose_tokens(logits, sampling, noise), mx.array(False)


def choose_tokens_per_row(
    logits: mx.array, configs: Sequence[SamplingConfig], noise: mx.array | None
) -> mx.array:
    """`choose_tokens` with each row's own temperature, top-p and top-k (one batch, mixed
    requests). The same rules, vectorized over rows; a top-k cut keeps every token tied
    with the k-th (mlx-lm keeps exactly k; ties of float log-probs are rare).

    logits: (B, N, V) -> (B, N) int32
    """
    logprobs = normalize(logits)  # (B, N, V)
    vocab_size = logprobs.shape[-1]
    greedy = mx.argmax(logprobs, axis=-1).astype(mx.int32)
    if all(c.greedy for c in configs):
        return greedy
    temperature = mx.array([c.temperature or 1.0 for c in configs])[:, None, None]  # (B, 1, 1)
    top_p = mx.array([c.top_p for c in configs])[:, None, None]
    top_k = mx.array([c.top_k or vocab_size for c in configs], dtype=mx.int32)[:, None, None]
    filtered = filter_top_p(logprobs, top_p)  # top_p = 1 keeps every token of nonzero mass
    descending = -mx.sort(-filtered, axis=-1)  # (B, N, V)
    kth = mx.take_along_axis(
        descending, mx.broadcast_to(top_k - 1, (*descending.shape[:2], 1)), axis=-1
    )  # (B, N, 1)
    filtered = mx.where(filtered < kth, -mx.inf, filtered)
    if noise is None:
        raise ValueError("sampling needs the nodes' noise")
    sampled = gumbel_max(filtered / temperature, noise)
    is_greedy = mx.array([c.greedy for c in configs])[:, None]  # (B, 1)
    return mx.where(is_greedy, greedy, sampled)

"""Log-probabilities of the emitted tokens under the target (OpenAI's `logprobs`).

Shapes: B batch, N packed tokens, L emitted tokens per step (at most), V
vocabulary, K top alternatives.

Every emitted token is the target's choice at one verified node: the root for the
first token, then each accepted node in turn (`Acceptance.path`). The target's
logits at that node are its next-token distribution there, the same logits plain
decoding computes at that position, so the figures are exact under speculation:
log-softmax of the raw logits, before temperature, top-p or top-k, as mlx-lm
reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import mlx.core as mx

MAX_TOP = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token: its log-probability and the `top` most likely tokens at its
    position with theirs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class EmittedLogprobs:
    """A step's figures on the device: chosen (B, L), top_ids and top_values (B, L, K)."""

    chosen: mx.array
    top_ids: mx.array
    top_values: mx.array

    def arrays(self) -> tuple[mx.array, mx.array, mx.array]:
        return self.chosen, self.top_ids, self.top_values

    def to_host(self, tokens: list[list[int]]) -> list[list[TokenLogprob]]:
        """Each row's emitted `tokens` (host lists, row b's first len(tokens[b]) of the
        step) with their figures, read back once the arrays are evaluated."""
        chosen = cast(list[list[float]], self.chosen.tolist())
        ids = cast(list[list[list[int]]], self.top_ids.tolist())
        values = cast(list[list[list[float]]], self.top_values.tolist())
        return [
            [
                TokenLogprob(token, float(chosen[b][j]), tuple(zip(ids[b][j], values[b][j])))
                for j, token in enumerate(row)
            ]
            for b, row in enumerate(tokens)
        ]


def emitted_logprobs(
    logits: mx.array, path: mx.array, tokens: mx.array, top: int
) -> EmittedLogprobs:
    """The target's log-probability of each emitted token and its `top` alternatives.

    logits: (B, N, V) the verified nodes' logits; path: (B, L) the node each emitted
    token was chosen at; tokens: (B, L) the emitted tokens.
    """
    # Past a row's accepted nodes, `path` may hold N (a node that was not packed):
    # clamp it in range; those positions are never reported.
    path = mx.minimum(path, logits.shape[1] - 1)  # (B, L)
    node_logits = mx.take_along_axis(logits, path[:, :, None], axis=1)  # (B, L, V)
    node_logits = node_logits.astype(mx.float32)
    logprobs = node_logits - mx.logsumexp(node_logits, axis=-1, keepdims=True)  # (B, L, V)
    chosen = mx.take_along_axis(logprobs, tokens[:, :, None], axis=-1)[..., 0]  # (B, L)
    if top <= 0:
        empty = mx.zeros((*chosen.shape, 0), dtype=mx.int32)  # (B, L, 0)
        return EmittedLogprobs(chosen, empty, empty.astype(mx.float32))
    ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[..., :top]  # (B, L, K)
    values = mx.take_along_axis(logprobs, ids, axis=-1)  # (B, L, K)
    order = mx.argsort(-values, axis=-1)  # most likely first
    ids = mx.take_along_axis(ids, order, axis=-1).astype(mx.int32)
    return EmittedLogprobs(chosen, ids, mx.take_along_axis(values, order, axis=-1))

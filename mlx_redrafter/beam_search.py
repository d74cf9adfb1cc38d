"""Beam search in the drafter.

Shapes: B batch, W beam width, L beam length, D hidden size, Vd draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from .drafter import Drafter


def beam_search(
    drafter: Drafter,
    embed: Callable[[mx.array], mx.array],
    hidden: mx.array,
    root_tokens: mx.array,
    beam_width: int,
    beam_length: int,
) -> mx.array:
    """Draft W candidate continuations of length L for every row.

    drafter: the recurrent drafter; embed: the target's token embedding (ids -> (..., D)).
    hidden: (B, D) target hidden state at the last committed position.
    root_tokens: (B,) the target's own next token; it opens every beam.
    Returns beams (B, W, L) int32 target token ids, best beam first.

    Scores start at [0, -inf, ...] so the first expansion grows beam 0 only and
    the W picks are W distinct tokens. Each step advances the recurrence with
    every beam's last token, adds the draft log-probs to the beam scores, and
    keeps the top W of the W * Vd continuations.
    """
    batch_size, hidden_size = hidden.shape
    beams = mx.broadcast_to(root_tokens[:, None, None], (batch_size, beam_width, 1))  # (B, W, 1)
    if beam_length == 1:
        return beams.astype(mx.int32)
    scores = mx.where(mx.arange(beam_width) == 0, 0.0, -mx.inf)  # (W,)
    scores = mx.broadcast_to(scores[None], (batch_size, beam_width)).astype(mx.float32)
    state = mx.zeros((batch_size, beam_width, hidden_size), dtype=hidden.dtype)  # (B, W, D)
    beam_hidden = mx.broadcast_to(hidden[:, None, :], state.shape)  # (B, W, D)
    last_tokens = beams[:, :, 0]  # (B, W)
    for _ in range(beam_length - 1):
        state = drafter.recurrent_step(state, embed(last_tokens))  # (B, W, D)
        logits = drafter.draft_logits(beam_hidden, state).astype(mx.float32)  # (B, W, Vd)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        draft_vocab_size = logprobs.shape[-1]
        candidates = (scores[:, :, None] + logprobs).reshape(batch_size, -1)  # (B, W*Vd)
        top = mx.argpartition(-candidates, kth=beam_width - 1, axis=-1)[:, :beam_width]  # (B, W)
        top_scores = mx.take_along_axis(candidates, top, axis=-1)  # (B, W)
        rank = mx.argsort(-top_scores, axis=-1)  # best first
        top = mx.take_along_axis(top, rank, axis=-1)  # (B, W) flat index into W*Vd
        scores = mx.take_along_axis(top_scores, rank, axis=-1)  # (B, W)
        parents = top // draft_vocab_size  # (B, W)
        tokens = drafter.to_target_ids(top % draft_vocab_size).astype(mx.int32)  # (B, W)
        beams = mx.take_along_axis(beams, parents[:, :, None], axis=1)  # (B, W, k)
        beams = mx.concatenate([beams, tokens[:, :, None]], axis=-1)  # (B, W, k + 1)
        state = mx.take_along_axis(state, parents[:, :, None], axis=1)  # (B, W, D)
        last_tokens = tokens
    return beams.astype(mx.int32)

"""Beam search in the drafter.

Shapes: B batch, W beam width, L beam length, D hidden size, Vd draft vocabulary.

A sampled row drafts with the target's own noise (`Coupling`): the target samples
the token at position p as argmax(w + g_p), with Gumbel noise g_p fixed by the row's
key and p (`sampling.position_noise`). Scoring the drafter's candidates for p with
its log-weights q / T plus that same g_p makes its best guess at p (each token of a
single beam; the first token of W beams) the token the target will draw whenever the
two perturbed argmaxes agree: always when q = p, where an unperturbed guess (the
drafter's argmax) is accepted with probability p(argmax) only.
The target's choices are untouched, so the output stays exactly plain sampling.
Beam scores then add the log-softmax of the perturbed logits: how clearly each
candidate wins the perturbed contest at its position.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx

from .drafter import Drafter


class Expansion(NamedTuple):
    """One beam-search step's choice: the W best continuations of W beams.

    scores: (B, W) new beam scores, best first.
    parents: (B, W) the beam each continuation extends.
    draft_tokens: (B, W) the appended token, as a draft-vocabulary index.
    """

    scores: mx.array
    parents: mx.array
    draft_tokens: mx.array


class ScoredBeams(NamedTuple):
    """Beams with two scores of each of their prefixes (0 at the root, never above the
    parent's).

    beams: (B, W, L) int32 target token ids, best beam first.
    scores: (B, W, L) the prefix's draft log-probability at the row's temperature,
        without the coupling's noise: the chance a sample takes it, by the drafter.
    contest: (B, W, L) the log-softmax of the perturbed logits the search ranked by,
        summed: how clearly each token won its position's perturbed contest (the
        scores themselves for greedy rows).
    """

    beams: mx.array
    scores: mx.array
    contest: mx.array


class Coupling(NamedTuple):
    """The target's sampling noise for the positions a beam search drafts.

    scale: (B,) 1 / temperature of each row (1 for a greedy row).
    noise: (B, L-1, Vd) the Gumbel noise of the target's sample at the position each
        drafted token takes, on the draft vocabulary (0 for a greedy row).
    """

    scale: mx.array
    noise: mx.array


def expand_beams(scores: mx.array, logits: mx.array) -> Expansion:
    """Keep the W best of the W * Vd one-token continuations (the pure-MLX reference).

    scores: (B, W) current beam scores; logits: (B, W, Vd) drafter logits per beam.
    A candidate's score is its beam's score plus the log-softmax of its logit. The
    result is fully determined, ties included: candidates are ordered by score, then
    by flat index (parent * Vd + token), lowest first, and the first W are kept in
    that order. (Kernels must reproduce exactly this.)
    """
    batch_size, beam_width, draft_vocab_size = logits.shape
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (B, W, Vd)
    candidates = (scores[:, :, None] + logprobs).reshape(batch_size, -1)  # (B, W*Vd)
    flat_size = candidates.shape[-1]
    flat_index = mx.arange(flat_size, dtype=mx.int32)
    # The W-th best score, then everything above it plus the lowest-index ties.
    best = -mx.partition(-candidates, kth=beam_width - 1, axis=-1)  # (B, W*Vd)
    threshold = best[:, beam_width - 1 : beam_width]  # (B, 1)
    above = candidates > threshold  # (B, W*Vd)
    tied = candidates == threshold
    room = beam_width - mx.sum(above, axis=-1, keepdims=True)  # (B, 1) ties that fit
    keep = above | (tied & (mx.cumsum(tied.astype(mx.int32), axis=-1) <= room))
    # The kept candidates' flat indices are the W smallest keys (the rest are shifted
    # past flat_size): a partition finds them, a sort of W puts them in index order.
    key = mx.where(keep, flat_index, flat_size + flat_index)  # (B, W*Vd)
    chosen = mx.partition(key, kth=beam_width - 1, axis=-1)[:, :beam_width]
    chosen = mx.sort(chosen, axis=-1).astype(mx.int32)  # (B, W) in flat-index order
    chosen_scores = mx.take_along_axis(candidates, chosen, axis=-1)  # (B, W)
    # Rank by score, ties by flat index: rank_i = #better + #equal-and-earlier.
    other, this = chosen_scores[:, None, :], chosen_scores[:, :, None]  # (B, 1, W), (B, W, 1)
    earlier = mx.arange(beam_width)[None, :] < mx.arange(beam_width)[:, None]  # (W, W)
    rank = mx.sum((other > this) | ((other == this) & earlier), axis=-1)  # (B, W)
    order = mx.argsort(rank, axis=-1)  # ranks are distinct
    top = mx.take_along_axis(chosen, order, axis=-1)  # (B, W) best first
    return Expansion(
        scores=mx.take_along_axis(chosen_scores, order, axis=-1),
        parents=top // draft_vocab_size,
        draft_tokens=top % draft_vocab_size,
    )


def beam_search(
    drafter: Drafter,
    embed: Callable[[mx.array], mx.array],
    hidden: mx.array,
    root_tokens: mx.array,
    beam_width: int,
    beam_length: int,
    expand: Callable[[mx.array, mx.array], Expansion] = expand_beams,
    coupling: Coupling | None = None,
) -> mx.array:
    """Draft W candidate continuations of length L for every row: the beams (B, W, L)
    of `scored_beam_search`, without their scores."""
    return scored_beam_search(
        drafter, embed, hidden, root_tokens, beam_width, beam_length, expand, coupling
    ).beams


def scored_beam_search(
    drafter: Drafter,
    embed: Callable[[mx.array], mx.array],
    hidden: mx.array,
    root_tokens: mx.array,
    beam_width: int,
    beam_length: int,
    expand: Callable[[mx.array, mx.array], Expansion] = expand_beams,
    coupling: Coupling | None = None,
) -> ScoredBeams:
    """Draft W candidate continuations of length L for every row, with two scores of
    each of their prefixes (`ScoredBeams`).

    drafter: the recurrent drafter; embed: the target's token embedding (ids -> (..., D)).
    hidden: (B, D) target hidden state at the last committed position.
    root_tokens: (B,) the target's own next token; it opens every beam.
    expand: the expansion step (`expand_beams`, or a kernel with identical results).
    coupling: for sampled rows, the target's noise at the drafted positions: each
        step scores the candidates with logits * scale + noise (module docstring).
    Returns the beams, the draft log-probability of each beam's prefix of length
    k + 1 at the row's temperature (without the coupling's noise), and its
    perturbed contest score (`ScoredBeams`).

    Scores start at [0, -inf, ...] so the first expansion grows beam 0 only and
    the W picks are W distinct tokens. Each step advances the recurrence with
    every beam's last token, adds the draft log-probs to the beam scores, and
    keeps the top W of the W * Vd continuations.
    """
    batch_size, hidden_size = hidden.shape
    beams = mx.broadcast_to(root_tokens[:, None, None], (batch_size, beam_width, 1))  # (B, W, 1)
    prefix_scores = mx.zeros((batch_size, beam_width, 1), dtype=mx.float32)  # (B, W, 1)
    contest = prefix_scores  # (B, W, 1)
    if beam_length == 1:
        return ScoredBeams(beams.astype(mx.int32), prefix_scores, contest)
    scores = mx.where(mx.arange(beam_width) == 0, 0.0, -mx.inf)  # (W,)
    scores = mx.broadcast_to(scores[None], (batch_size, beam_width)).astype(mx.float32)
    state = mx.zeros((batch_size, beam_width, hidden_size), dtype=hidden.dtype)  # (B, W, D)
    beam_hidden = mx.broadcast_to(hidden[:, None, :], state.shape)  # (B, W, D)
    last_tokens = beams[:, :, 0]  # (B, W)
    for depth in range(beam_length - 1):
        state = drafter.recurrent_step(state, embed(last_tokens))  # (B, W, D)
        logits = drafter.draft_logits(beam_hidden, state)  # (B, W, Vd)
        perturbed = logits
        if coupling is not None:
            scale, noise = coupling.scale[:, None, None], coupling.noise[:, None, depth]
            logits = logits.astype(mx.float32) * scale  # (B, W, Vd) at the row's temperature
            perturbed = logits + noise
        scores, parents, draft_tokens = expand(scores, perturbed)  # (B, W) each
        contest = mx.take_along_axis(contest, parents[:, :, None], axis=1)  # (B, W, k)
        contest = mx.concatenate([contest, scores[:, :, None]], axis=-1)  # (B, W, k + 1)
        tokens = drafter.to_target_ids(draft_tokens).astype(mx.int32)  # (B, W)
        beams = mx.take_along_axis(beams, parents[:, :, None], axis=1)  # (B, W, k)
        beams = mx.concatenate([beams, tokens[:, :, None]], axis=-1)  # (B, W, k + 1)
        # The chosen tokens' draft log-probabilities at the row's temperature, without
        # the noise (which makes every winner look sure): the prefixes' scores.
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (B, W, Vd)
        chosen = parents * logits.shape[-1] + draft_tokens  # (B, W) flat (beam, token)
        flat_logprobs = logprobs.reshape(batch_size, -1)  # (B, W*Vd)
        step = mx.take_along_axis(flat_logprobs, chosen, axis=-1)  # (B, W)
        prefix_scores = mx.take_along_axis(prefix_scores, parents[:, :, None], axis=1)
        grown = prefix_scores[:, :, -1] + step  # (B, W)
        prefix_scores = mx.concatenate([prefix_scores, grown[:, :, None]], axis=-1)  # (B, W, k + 1)
        state = mx.take_along_axis(state, parents[:, :, None], axis=1)  # (B, W, D)
        last_tokens = tokens
    return ScoredBeams(beams.astype(mx.int32), prefix_scores, contest)

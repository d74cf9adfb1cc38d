"""How closely an exported drafter drafts like the original.

Shapes: S sampled states, D hidden size, V vocabulary, Vd draft vocabulary, W beam
width, L beam length.

A *state* is a pair (h, s): the target's hidden state h at a position t of a real
prompt, and the recurrence state s after the true next one or two tokens (depth 1
and 2 of a beam). Both drafters score every state; their top-W target token ids
must be the same, in the same order. Then both run the full beam search (W x L)
from sampled positions, rooted at the true next token; the beams must be equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_redrafter.beam_search import beam_search
from mlx_redrafter.drafter import Drafter

from .errors import ConversionError


@dataclass(frozen=True)
class States:
    """Sampled target positions.

    hidden: (S, D) the target's hidden state at position t.
    next_tokens: (S, 2) the tokens at t+1 and t+2.
    embed: the target's embedding (ids -> (..., D)).
    source: where the states came from, for the report.
    """

    hidden: mx.array
    next_tokens: mx.array
    embed: Callable[[mx.array], mx.array]
    source: str


@dataclass(frozen=True)
class Agreement:
    """The comparison's counts; `exact` when every draft and every beam agreed."""

    states: int  # (h, s) pairs scored by both heads
    width: int  # W
    top_agree: int  # pairs whose top-W token ids agree, in order
    beam_shape: tuple[int, int]  # (W, L) of the beam searches
    beams: int  # beam searches run with both drafters
    beams_agree: int  # of those, searches with identical beams
    max_logprob_diff: float  # max |log p_exported - log p_original| over the top-W drafts
    source: str

    @property
    def exact(self) -> bool:
        return self.top_agree == self.states and self.beams_agree == self.beams

    def summary(self) -> str:
        share = 100.0 * self.top_agree / max(self.states, 1)
        beams = 100.0 * self.beams_agree / max(self.beams, 1)
        w, length = self.beam_shape
        return (
            f"top-{self.width} drafts agree on {self.top_agree}/{self.states} states "
            f"({share:.2f} %); {w}x{length} beam searches identical in "
            f"{self.beams_agree}/{self.beams} ({beams:.2f} %); max |d log p| of the drafts "
            f"{self.max_logprob_diff:.2e}; states from {self.source}"
        )


def model_states(
    model: object, token_lists: list[list[int]], samples: int, seed: int, source: str
) -> States:
    """Sample `samples` positions (each with its two following tokens) from the prompts'
    tokens run through the target (an mlx-lm model). Prompts are taken in a seeded
    random order until there are twice as many positions as samples; a prompt of
    fewer than 3 tokens has no such position and is skipped."""
    rng = np.random.default_rng(seed)
    hidden_rows, next_rows, positions = [], [], 0
    for index in rng.permutation(len(token_lists)):
        tokens = token_lists[index]
        if len(tokens) < 3:
            continue
        hidden = model.model(mx.array([tokens]))[0]  # type: ignore[attr-defined]  # (T, D)
        ids = np.asarray(tokens)
        hidden_rows.append(hidden[: len(tokens) - 2].astype(mx.float32))  # (T - 2, D)
        mx.eval(hidden_rows[-1])
        next_rows.append(np.stack([ids[1:-1], ids[2:]], axis=1))  # (T - 2, 2)
        positions += len(tokens) - 2
        if positions >= 2 * samples:
            break
    if not hidden_rows:
        raise ConversionError(
            f"no prompt of {source} has 3 tokens or more, so the check has no target "
            "state followed by two tokens: give --prompts with longer prompts"
        )
    hidden = mx.concatenate(hidden_rows)  # (positions, D)
    following = np.concatenate(next_rows)  # (positions, 2)
    pick = rng.permutation(len(following))[:samples]
    embed = model.model.embed_tokens  # type: ignore[attr-defined]
    picked = hidden[mx.array(pick)]  # (S, D)
    return States(picked, mx.array(following[pick]), embed, source)  # next tokens (S, 2)


def random_states(hidden_size: int, vocab_size: int, samples: int, seed: int) -> States:
    """Gaussian states and a Gaussian embedding table (when no target model is given)."""
    keys = mx.random.split(mx.random.key(seed), 3)
    table = mx.random.normal((vocab_size, hidden_size), key=keys[0])  # (V, D)
    hidden = mx.random.normal((samples, hidden_size), key=keys[1])  # (S, D)
    tokens = mx.random.randint(0, vocab_size, (samples, 2), key=keys[2])  # (S, 2)
    return States(hidden, tokens, lambda ids: table[ids], "random Gaussian states")


def _ranked(logits: np.ndarray, ids: np.ndarray, width: int) -> np.ndarray:
    """Target ids of the `width` highest logits per row, ties by lower id. (R, X) -> (R, W)"""
    kth = -np.partition(-logits, width - 1, axis=-1)[:, width - 1 : width]  # (R, 1)
    out = np.empty((len(logits), width), dtype=np.int64)
    for row, (values, floor) in enumerate(zip(logits, kth[:, 0])):  # not a hot path
        near = np.flatnonzero(values >= floor)
        out[row] = ids[near[np.lexsort((ids[near], -values[near]))][:width]]
    return out


def _logsumexp(logits: np.ndarray) -> np.ndarray:
    """(R, X) -> (R, 1)"""
    top = logits.max(axis=-1, keepdims=True)
    return top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


def _score(
    original: Drafter, exported: Drafter, hidden: mx.array, state: mx.array, width: int
) -> tuple[int, float]:
    """(rows whose top-W ids agree, max |d log p| over the original's top W) for a chunk."""
    ours = np.array(original.draft_logits(hidden, state).astype(mx.float32))  # (R, Vd)
    theirs = np.array(exported.draft_logits(hidden, state).astype(mx.float32))  # (R, V)
    our_ids = np.array(original.to_target_ids(mx.arange(ours.shape[-1])))  # (Vd,)
    top_ours = _ranked(ours, our_ids, width)  # (R, W) target ids
    top_theirs = _ranked(theirs, np.arange(theirs.shape[-1]), width)  # (R, W)
    draft_index = np.full(theirs.shape[-1], -1)
    draft_index[our_ids] = np.arange(len(our_ids))
    rows = np.arange(len(ours))[:, None]
    ours_lp = ours[rows, draft_index[top_ours]] - _logsumexp(ours)  # (R, W)
    theirs_lp = theirs[rows, top_ours] - _logsumexp(theirs)  # (R, W)
    agree = int(np.all(top_ours == top_theirs, axis=-1).sum())
    return agree, float(np.abs(ours_lp - theirs_lp).max())


def compare(
    original: Drafter,
    exported: Drafter,
    states: States,
    width: int,
    beam_shape: tuple[int, int],
    beam_rows: int,
) -> Agreement:
    """Score every state with both drafters and run `beam_rows` beam searches with each."""
    hidden, embed = states.hidden, states.embed
    s1 = original.recurrent_step(mx.zeros_like(hidden), embed(states.next_tokens[:, 0]))  # (S, D)
    s2 = original.recurrent_step(s1, embed(states.next_tokens[:, 1]))  # (S, D)
    agree, worst = 0, 0.0
    for state in (s1, s2):
        for start in range(0, hidden.shape[0], 256):
            chunk = slice(start, start + 256)
            count, diff = _score(original, exported, hidden[chunk], state[chunk], width)
            agree, worst = agree + count, max(worst, diff)
    w, length = beam_shape
    roots, rows_h = states.next_tokens[:beam_rows, 0], hidden[:beam_rows]
    beams_agree = 0
    for start in range(0, min(beam_rows, int(hidden.shape[0])), 64):
        chunk = slice(start, start + 64)
        a = beam_search(original, embed, rows_h[chunk], roots[chunk], w, length)  # (R, W, L)
        b = beam_search(exported, embed, rows_h[chunk], roots[chunk], w, length)  # (R, W, L)
        beams_agree += int(np.all(np.array(a) == np.array(b), axis=(1, 2)).sum())
    return Agreement(
        states=2 * int(hidden.shape[0]),
        width=width,
        top_agree=agree,
        beam_shape=beam_shape,
        beams=min(beam_rows, int(hidden.shape[0])),
        beams_agree=beams_agree,
        max_logprob_diff=worst,
        source=states.source,
    )

"""Draft confidence: how often the target accepts a drafted token, by the token's depth
and its draft probability, measured as decoding runs.

Shapes: B batch, W beam width, L beam length, D depths (the drafted token's depth,
1 .. DEPTHS, deeper tokens sharing the last), K bins of draft probability.

A dynamic tree `WxL@n` keeps the n prefixes of its W beams most likely to be
accepted. How clearly the drafter chose each token, q (its probability; for a
sampled row, its probability in the contest perturbed by the target's noise,
`beam_search.ScoredBeams.contest`), is a guess at that likelihood, and not a
calibrated one: a small drafter is surer of its tokens than the target bears
out, and a perturbed contest's winner looks sure whatever the target samples.
So every step that verifies drafter beams counts, for each drafted token whose
parent the target accepted, whether the target accepted it too, by (greedy or
sampled row, depth, bin of q). The rate
of a cell is its counts mixed with `strength` reached tokens' worth of the rate
of its bin over all depths, and that with the bin's own q (a drafter that is right as
often as it is sure). A prefix's score is then the sum of the log rates of its
tokens: its estimated chance of being accepted whole. A rate is never above 1, so
a prefix never scores above its parent and the kept prefixes still form a tree;
a small share of the draft log-probability (without noise) orders prefixes of
equal rates.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .drafter import Drafter
from .per_model import PerModel
from .tree import prefix_owners, prefixes_of

DEPTHS = 8  # depths measured apart; deeper drafted tokens share the last
BINS = 10  # bins of draft probability, each 1 / BINS wide
TIE_SHARE = 1e-3  # of the draft log-probability, added to order equal rates
FLOOR = 1e-4  # the lowest rate (log 0 would make every deeper prefix equal)


def token_bins(contest: mx.array) -> mx.array:
    """The bin of each drafted token's q.

    contest: (B, W, L) the beams' prefixes' cumulative contest scores (0 at the
    root; `beam_search.ScoredBeams`) -> (B, W, L - 1) int32 in [0, BINS).
    """
    steps = contest[:, :, 1:] - contest[:, :, :-1]  # (B, W, L-1) each token's log q
    steps = mx.where(mx.isnan(steps), -mx.inf, steps)  # -inf - -inf: no such beam
    bins = mx.floor(mx.exp(steps) * BINS).astype(mx.int32)
    return mx.clip(bins, 0, BINS - 1)


def _depth_rows(beam_length: int) -> mx.array:
    """(L - 1,) the table row of each drafted token's depth."""
    return mx.minimum(mx.arange(beam_length - 1), DEPTHS - 1)


def confident_scores(scores: mx.array, contest: mx.array, log_rates: mx.array) -> mx.array:
    """Each prefix's estimated log chance of being accepted whole.

    scores, contest: (B, W, L) the prefixes' cumulative draft log-probabilities and
    contest scores (`beam_search.ScoredBeams`); log_rates: (B, DEPTHS, BINS) each
    row's log acceptance rate per (depth, bin), all <= 0 -> (B, W, L), never above
    the parent's (0 everywhere gives the draft log-probabilities' order).
    """
    batch_size, beam_width, beam_length = scores.shape
    if beam_length == 1:
        return scores
    rows = log_rates[:, _depth_rows(beam_length), :]  # (B, L-1, K)
    rows = mx.broadcast_to(rows[:, None], (batch_size, beam_width, beam_length - 1, BINS))
    bins = token_bins(contest)[..., None]  # (B, W, L-1, 1)
    token_rates = mx.take_along_axis(rows, bins, axis=-1)[..., 0]  # (B, W, L-1)
    root = mx.zeros((batch_size, beam_width, 1), dtype=mx.float32)
    cumulative = mx.concatenate([root, mx.cumsum(token_rates, axis=-1)], axis=-1)  # (B, W, L)
    # The tie share may reorder rates closer than it (a rate equal within a
    # thousandth of the draft log-probability); it never lifts a child over its parent.
    return cumulative + TIE_SHARE * scores


def neutral_rates(batch_size: int) -> mx.array:
    """(B, DEPTHS, BINS) log rates of 0: the draft probabilities alone rank a dynamic
    tree's prefixes (and a fixed tree ignores them)."""
    return mx.zeros((batch_size, DEPTHS, BINS))


def observed_counts(
    beams: mx.array, contest: mx.array, runs: mx.array, sampled: mx.array
) -> mx.array:
    """One step's counts (2, 2, DEPTHS, BINS): [reached, accepted] x [greedy,
    sampled] x depth x bin, of the drafted tokens whose parent the target accepted.

    beams: (B, W, L) the drafter's beams as verified (ABSENT past a dynamic tree's
    cut); contest: (B, W, L) their prefixes' contest scores; runs: (B, W)
    the drafted tokens each beam had accepted; sampled: (B,) bool.
    """
    batch_size, beam_width, beam_length = beams.shape
    depth = mx.arange(1, beam_length)  # (L-1,) drafted tokens' depths
    # A token shared by several beams counts once, at the beam that owns its prefix.
    owned = prefixes_of(beams, prefix_owners(beams)).is_new.reshape(beams.shape)  # (B, W, L)
    counted = owned[:, :, 1:]  # (B, W, L-1)
    reached = counted & (runs[:, :, None] >= depth - 1)  # (B, W, L-1)
    accepted = reached & (runs[:, :, None] >= depth)
    kind = sampled.astype(mx.int32)[:, None, None]  # (B, 1, 1)
    cell = (kind * DEPTHS + _depth_rows(beam_length)) * BINS + token_bins(contest)  # (B, W, L-1)
    cell = mx.broadcast_to(cell, reached.shape).reshape(-1)  # (B*W*(L-1),)
    cells = 2 * DEPTHS * BINS
    counts = mx.zeros((2, cells), dtype=mx.float32)
    counts = counts.at[0, cell].add(reached.reshape(-1).astype(mx.float32))
    counts = counts.at[1, cell].add(accepted.reshape(-1).astype(mx.float32))
    return counts.reshape(2, 2, DEPTHS, BINS)


class DraftConfidence:
    """Running counts of a drafter's acceptance by (greedy or sampled, depth, bin),
    kept per process for a model and drafter (`shared_confidence`).

    strength: reached tokens' worth of the broader rate mixed into each cell; decay:
    counts fade by this much at each step observed, so that the rates follow the
    text.
    """

    def __init__(self, strength: float = 8.0, decay: float = 0.998):
        self.strength, self.decay = strength, decay
        self.counts = np.zeros((2, 2, DEPTHS, BINS))  # [reached, accepted] x kind x D x K
        self._table: mx.array | None = None

    def agree(self, agreed: Callable[[list[float]], list[float]]) -> None:
        """Take the counts `agreed` returns for ours (rank 0's, `distributed.agreed_values`),
        so that sharded ranks, which may have decoded apart before, keep the same
        nodes: each step then adds the same counts on every rank."""
        values = agreed([float(x) for x in self.counts.ravel()])
        self.counts = np.array(values, dtype=np.float64).reshape(self.counts.shape)
        self._table = None

    def observe(self, counts: np.ndarray) -> None:
        """Add one step's `observed_counts`."""
        self.counts = self.counts * self.decay + counts
        self._table = None

    def rates(self) -> np.ndarray:
        """(2, DEPTHS, BINS) acceptance rates of greedy and sampled rows' drafted
        tokens: each cell's counts, then its bin's over all depths, then the bin's
        own draft probability."""
        reached, accepted = self.counts
        weight = self.strength
        centre = (np.arange(BINS) + 0.5) / BINS  # (K,)
        pooled = (accepted.sum(axis=1) + weight * centre) / (reached.sum(axis=1) + weight)
        rates = (accepted + weight * pooled[:, None, :]) / (reached + weight)  # (2, D, K)
        return np.clip(rates, FLOOR, 1.0)

    def log_rates(self) -> mx.array:
        """(2, DEPTHS, BINS) float32 log rates for `confident_scores`."""
        if self._table is None:
            self._table = mx.array(np.log(self.rates()), dtype=mx.float32)
        return self._table


_SHARED: PerModel[DraftConfidence] = PerModel()


def shared_confidence(model: nn.Module, drafter: Drafter) -> DraftConfidence:
    """The process's `DraftConfidence` of (model, drafter), kept as `per_model.PerModel`
    keeps values: a session per request goes on from what earlier ones measured."""
    return _SHARED.get(model, drafter, ("confidence",), DraftConfidence)

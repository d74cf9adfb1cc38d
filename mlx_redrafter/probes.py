"""Drafter probes: what a drafter tree would have accepted, learned without verifying it.

Shapes: B batch, W beam width, L beam length.

On a step that verifies no drafter beams (plain decoding, lookup branches alone),
the drafter may still draft W beams of L tokens from the step's root, at the cost
of a beam search and no target forward. The probe keeps them until each row has
decoded L - 1 more tokens, then counts how many of its first tokens each beam
guessed: exactly the run a verification would have accepted, since a target's
choice depends only on the tokens before it (and, sampling, on the noise keyed by
its position, `sampling.position_keys`). The auto tree learns the drafter's
acceptance from these runs as it does from verified steps, so a generation that
runs plainly still sees when drafting starts to pay, without spending a single
verification on finding out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .config import TreeConfig


def beam_runs(beams: np.ndarray, decoded: np.ndarray) -> np.ndarray:
    """The drafted tokens each beam guessed in a row before its first miss.

    beams: (B, W, L) drafted beams (column 0 is the root); decoded: (B, L - 1) the
    tokens decoded after the root -> (B, W) int64, 0..L-1.
    """
    match = beams[:, :, 1:] == decoded[:, None, :]  # (B, W, L-1)
    return np.cumprod(match, axis=-1).sum(axis=-1).astype(np.int64)  # as `accept.runs_of`


@dataclass
class DraftProbe:
    """Beams drafted on one step for its rows, and the tokens decoded since.

    tree: the drafter tree W x L drafted; row_ids: the requests of the batch rows;
    beams: (B, W, L), lazy until the step that drafted them is evaluated;
    decoded: each row's tokens decoded from that step on.
    """

    tree: TreeConfig
    row_ids: tuple[int, ...]
    beams: mx.array
    decoded: list[list[int]]

    @classmethod
    def start(cls, tree: TreeConfig, row_ids: Sequence[int], beams: mx.array) -> DraftProbe:
        return cls(tree, tuple(row_ids), beams, [[] for _ in row_ids])

    def add(self, row_ids: Sequence[int], tokens: Sequence[Sequence[int]]) -> bool:
        """Add one step's decoded tokens per row; False when the batch is no longer
        the probe's (a row left or joined): the probe is then void."""
        if tuple(row_ids) != self.row_ids:
            return False
        for decoded, new in zip(self.decoded, tokens):
            decoded.extend(new)
        return True

    def runs(self) -> np.ndarray | None:
        """(B, W) each beam's run of guessed tokens, once every row has decoded L - 1
        tokens since the probe; None before."""
        needed = self.tree.beam_length - 1
        if any(len(decoded) < needed for decoded in self.decoded):
            return None
        decoded = np.array([row[:needed] for row in self.decoded], dtype=np.int64)  # (B, L-1)
        return beam_runs(np.array(self.beams), decoded)

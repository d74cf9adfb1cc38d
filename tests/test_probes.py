"""Drafter probes: each beam's run of guessed tokens, and a probe's life over steps."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_redrafter.config import TreeConfig
from mlx_redrafter.probes import DraftProbe, beam_runs


def test_each_beam_counts_its_guesses_up_to_its_first_miss():
    beams = np.array([[[7, 1, 2, 3], [7, 1, 9, 3], [7, 5, 2, 3]]])  # (1, 3, 4), root 7
    decoded = np.array([[1, 2, 3]])  # (1, 3)
    assert beam_runs(beams, decoded).tolist() == [[3, 1, 0]]  # a later match does not count


def test_a_probe_reports_once_every_row_has_decoded_its_length():
    beams = mx.array([[[7, 1, 2], [7, 1, 4]], [[8, 5, 6], [8, 6, 5]]])  # (2, 2, 3)
    probe = DraftProbe.start(TreeConfig(2, 3), [10, 11], beams)
    assert probe.add([10, 11], [[1], [5, 6, 0]])
    assert probe.runs() is None  # row 10 has one of the two tokens it needs
    assert probe.add([10, 11], [[4], [1]])
    assert probe.runs().tolist() == [[1, 2], [2, 0]]


def test_a_change_of_rows_voids_a_probe():
    probe = DraftProbe.start(TreeConfig(1, 3), [3, 4], mx.zeros((2, 1, 3), dtype=mx.int32))
    assert not probe.add([3], [[1]])  # row 4 ended
    probe = DraftProbe.start(TreeConfig(1, 3), [3], mx.zeros((1, 1, 3), dtype=mx.int32))
    assert not probe.add([3, 5], [[1], [2]])  # row 5 joined

"""Random inputs for the kernel tests, shared by the emulated and the Metal runs."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np

from mlx_redrafter.config import TreeConfig
from mlx_redrafter.tree import ABSENT, pack_tree


def same(got, want) -> bool:
    """Bit-identical outputs: values (floats compared exactly, -inf == -inf) and dtypes."""
    return all(
        g.dtype == w.dtype and g.shape == w.shape and np.array_equal(np.array(g), np.array(w))
        for g, w in zip(got, want)
    )


# ---------------------------------------------------------------- expansion inputs

EXPAND_SHAPES = [  # (B, W, Vd)
    (1, 1, 1),
    (1, 1, 7),
    (4, 1, 5),
    (2, 3, 11),
    (2, 4, 3),  # W > Vd: dead candidates fill the beam
    (3, 4, 64),
    (1, 8, 33),
    (2, 5, 130),
    (1, 2, 1000),
]
CHUNKS = [None, 1, 3, 7, 64]  # None: the default chunk


def expand_inputs(kind: str, shape: tuple[int, int, int], rng: np.random.Generator):
    batch, width, vocab = shape
    if kind == "normal":
        scores = -np.sort(rng.exponential(size=(batch, width)), axis=-1)
        logits = rng.normal(scale=3.0, size=shape)
    elif kind == "ties":  # few distinct values: ties within and across beams
        scores = rng.integers(0, 3, size=(batch, width)).astype(float)
        logits = rng.integers(0, 4, size=shape).astype(float)
    elif kind == "shared":  # every beam has the same logits and score: ties across beams
        scores = np.zeros((batch, width))
        logits = rng.integers(0, 3, size=(batch, 1, vocab)).astype(float).repeat(width, 1)
    elif kind == "first":  # the first expansion: only beam 0 is alive
        scores = np.where(np.arange(width) == 0, 0.0, -np.inf)[None].repeat(batch, 0)
        logits = rng.integers(0, 3, size=shape).astype(float)
    elif kind == "masked":  # some tokens at -inf
        scores = rng.normal(size=(batch, width))
        logits = np.where(rng.random(size=shape) < 0.3, -np.inf, rng.normal(size=shape))
        logits[..., 0] = 0.0  # every beam keeps a finite token
    elif kind == "dead":  # every candidate is -inf: pure flat-index order
        scores = np.full((batch, width), -np.inf)
        logits = rng.normal(size=shape)
    else:
        raise ValueError(kind)
    return mx.array(scores, mx.float32), mx.array(logits, mx.float32)


EXPAND_KINDS = ["normal", "ties", "shared", "first", "masked", "dead"]


# ---------------------------------------------------------------- acceptance inputs

ACCEPT_SHAPES = [(1, 1, 1), (1, 1, 4), (2, 3, 3), (3, 4, 5), (1, 8, 2), (4, 2, 6), (2, 5, 4)]


def accept_inputs(shape, share_prefixes, budget_cut, rng: random.Random, ragged=False):
    """Beams over a 3-token vocabulary (so prefixes are shared), their tree, and target
    choices that often follow a beam all the way (full-length acceptances happen).
    ragged: beams of different lengths (tails ABSENT)."""
    batch, width, length = shape
    beam = TreeConfig(width, length, share_prefixes=share_prefixes)
    num_packed = beam.max_tree_size
    if budget_cut:
        num_packed = max(length, num_packed - rng.randint(1, max(1, width)))
    beams = [
        [[rng.randrange(3) for _ in range(length)] for _ in range(width)] for _ in range(batch)
    ]
    for row_beams in beams:  # every beam opens with its row's root token
        for one_beam in row_beams:
            one_beam[0] = row_beams[0][0]
            if ragged:
                end = rng.randint(1, length)
                one_beam[end:] = [ABSENT] * (length - end)
    beams_mx = mx.array(beams, mx.int32)
    tree = pack_tree(beams_mx, num_packed, share_prefixes)
    choices = [[rng.randrange(3) for _ in range(num_packed)] for _ in range(batch)]
    canonical = tree.canonical.tolist()
    for row in range(batch):
        if rng.random() < 0.7:  # follow one beam: write its tokens at its canonical nodes
            w = rng.randrange(width)
            for k in range(length - 1):
                node = canonical[row][w][k]
                if node < num_packed and beams[row][w][k + 1] != ABSENT:
                    choices[row][node] = beams[row][w][k + 1]
    return beams_mx, tree.unpack, tree.canonical, mx.array(choices, mx.int32)


def accept_cases():
    rng = random.Random(0)
    for shape in ACCEPT_SHAPES:
        for share_prefixes in (True, False):
            for budget_cut in (False, True):
                for case in range(6):
                    ragged = case >= 4
                    yield shape, accept_inputs(shape, share_prefixes, budget_cut, rng, ragged)


def pack_cases():
    """(beams, num_packed, share_prefixes): random, identical and distinct beams, full
    trees and trees cut by a budget."""
    rng = random.Random(1)
    for batch, width, length in ACCEPT_SHAPES:
        for share_prefixes in (True, False):
            full = TreeConfig(width, length, share_prefixes=share_prefixes).max_tree_size
            for budget in sorted({full, max(length, full - 1), length}):
                for kind in ("random", "identical", "distinct", "ragged"):
                    if kind in ("random", "ragged"):
                        beams = np.array(
                            [
                                [[rng.randrange(3) for _ in range(length)] for _ in range(width)]
                                for _ in range(batch)
                            ]
                        )
                    elif kind == "identical":
                        beams = np.tile(np.arange(length), (batch, width, 1))
                    else:
                        beams = np.arange(batch * width * length).reshape(batch, width, length)
                    beams[:, :, 0] = beams[:, :1, 0]  # one root per row
                    if kind == "ragged":  # beams of different lengths end in ABSENT
                        for row in beams:
                            for one_beam in row:
                                one_beam[rng.randint(1, length) :] = ABSENT
                    yield mx.array(beams, mx.int32), budget, share_prefixes

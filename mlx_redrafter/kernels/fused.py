"""The fused steps, on any launcher: `mx.fast.metal_kernel` on a Mac, an emulator in tests.

`expand_beams_fused`, `pack_tree_fused` and `accept_fused` have the contracts of
`beam_search.expand_beams`, `tree.pack_tree` and `accept.accept`. All they do besides launching the
kernels in `sources.py` is shape bookkeeping, so handing them the C++ emulator as
`launch` (tests/kernel_harness) tests everything but the Metal compiler itself.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ..accept import Acceptance, accept
from ..beam_search import Expansion, expand_beams
from ..tree import PackedTree, pack_tree
from .sources import ACCEPT, BEAM_CANDIDATES, BEAM_SELECT, PACK_TREE, KernelSpec

Grid = tuple[int, int, int]

# launch(spec, inputs, output_shapes, output_dtypes, grid, threadgroup) -> outputs
Launch = Callable[
    [KernelSpec, Sequence[mx.array], Sequence[tuple[int, ...]], Sequence[mx.Dtype], Grid, Grid],
    list[mx.array],
]

MAX_THREADGROUP = 256


@functools.cache
def _metal_kernel(spec: KernelSpec) -> Any:
    """The `mx.fast.metal_kernel` object of a spec, built once (MLX caches the library).

    The kernels compare against -inf, so they ask for IEEE ("safe") math explicitly;
    MLX versions without `compile_options` (before 0.32) use their default mode.
    """
    arguments: dict[str, Any] = {
        "name": spec.name,
        "input_names": list(spec.input_names),
        "output_names": list(spec.output_names),
        "source": spec.source,
        "header": spec.header,
    }
    try:
        return mx.fast.metal_kernel(**arguments, compile_options={"math_mode": "safe"})
    except TypeError:
        return mx.fast.metal_kernel(**arguments)


def threadgroup_for(grid: Grid) -> Grid:
    """A threadgroup of at most MAX_THREADGROUP threads for a grid (the kernels need none)."""
    x = max(1, min(grid[0], MAX_THREADGROUP))
    y = max(1, min(grid[1], MAX_THREADGROUP // x))
    return (x, y, 1)


def metal_launch(
    spec: KernelSpec,
    inputs: Sequence[mx.array],
    output_shapes: Sequence[tuple[int, ...]],
    output_dtypes: Sequence[mx.Dtype],
    grid: Grid,
    threadgroup: Grid,
) -> list[mx.array]:
    """Run a kernel with `mx.fast.metal_kernel` (raises without Metal)."""
    outputs = _metal_kernel(spec)(
        inputs=list(inputs),
        output_shapes=list(output_shapes),
        output_dtypes=list(output_dtypes),
        grid=grid,
        threadgroup=threadgroup,
    )
    return list(outputs)


def default_chunk(beam_width: int, vocab_size: int) -> int:
    """Tokens per stage-1 thread. Stage 1 costs ~chunk per thread, stage 2 ~W*W*Vd/chunk
    per row; chunk = W*sqrt(Vd) balances them (untuned: no Metal timing was taken)."""
    return max(32, math.ceil(beam_width * math.sqrt(vocab_size)))


def expand_beams_fused(
    scores: mx.array,
    logits: mx.array,
    *,
    launch: Launch = metal_launch,
    chunk: int | None = None,
) -> Expansion:
    """`expand_beams` as two kernels: per-chunk top W, then a per-row merge.

    scores: (B, W) float32; logits: (B, W, Vd). The log-normalizer is MLX's own
    `logsumexp`, the very op `expand_beams` uses, so every candidate score is the
    same float32 value in both and the selection (pure comparisons) is identical.
    """
    batch_size, beam_width, vocab_size = logits.shape
    if batch_size == 0:
        return expand_beams(scores, logits)
    logits = logits.astype(mx.float32)
    lse = mx.logsumexp(logits, axis=-1, keepdims=True)  # (B, W, 1) as in expand_beams
    chunk = chunk if chunk is not None else default_chunk(beam_width, vocab_size)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    num_chunks = -(-vocab_size // chunk)
    candidates = (batch_size, beam_width, num_chunks, beam_width)
    grid = (num_chunks, beam_width, batch_size)
    candidate_scores, candidate_flat = launch(
        BEAM_CANDIDATES,
        [scores.astype(mx.float32), logits, lse, mx.array([chunk], dtype=mx.int32)],
        [candidates, candidates],
        [mx.float32, mx.int32],
        grid,
        threadgroup_for(grid),
    )
    count = beam_width * num_chunks * beam_width
    grid = (batch_size, 1, 1)
    new_scores, parents, tokens = launch(
        BEAM_SELECT,
        [
            candidate_scores.reshape(batch_size, count),
            candidate_flat.reshape(batch_size, count),
            mx.array([beam_width, vocab_size], dtype=mx.int32),
        ],
        [(batch_size, beam_width)] * 3,
        [mx.float32, mx.int32, mx.int32],
        grid,
        threadgroup_for(grid),
    )
    return Expansion(scores=new_scores, parents=parents, draft_tokens=tokens)


def accept_fused(
    beams: mx.array,
    unpack: mx.array,
    canonical: mx.array,
    choices: mx.array,
    *,
    launch: Launch = metal_launch,
) -> Acceptance:
    """`accept` as one kernel, one thread per row (the same contract)."""
    batch_size, beam_width, beam_length = beams.shape
    if batch_size == 0:
        return accept(beams, unpack, canonical, choices)
    grid = (batch_size, 1, 1)
    num_accepted, tokens, path, last_node, bonus_tokens, runs = launch(
        ACCEPT,
        [x.astype(mx.int32) for x in (beams, unpack, canonical, choices)],
        [(batch_size,), (batch_size, beam_length), (batch_size, beam_length)]
        + [(batch_size,)] * 2
        + [(batch_size, beam_width)],
        [mx.int32] * 6,
        grid,
        threadgroup_for(grid),
    )
    return Acceptance(
        num_accepted=num_accepted,
        tokens=tokens,
        path=path.astype(unpack.dtype),
        last_node=last_node.astype(unpack.dtype),
        bonus_tokens=bonus_tokens.astype(choices.dtype),
        runs=runs,
    )


def pack_tree_fused(
    beams: mx.array,
    num_packed: int,
    share_prefixes: bool = True,
    *,
    launch: Launch = metal_launch,
) -> PackedTree:
    """`pack_tree` as one kernel, one thread per row (the same contract)."""
    batch_size, beam_width, beam_length = beams.shape
    if batch_size == 0:
        return pack_tree(beams, num_packed, share_prefixes)
    grid = (batch_size, 1, 1)
    per_beam = (batch_size, beam_width, beam_length)
    tokens, depths, unpack, canonical, ancestors, num_tokens = launch(
        PACK_TREE,
        [beams.astype(mx.int32), mx.array([num_packed, int(share_prefixes)], dtype=mx.int32)],
        [
            (batch_size, num_packed),
            (batch_size, num_packed),
            per_beam,
            per_beam,
            (batch_size, num_packed, num_packed),
            (batch_size,),
        ],
        [mx.int32] * 4 + [mx.bool_, mx.int32],
        grid,
        threadgroup_for(grid),
    )
    return PackedTree(tokens.astype(beams.dtype), depths, unpack, canonical, ancestors, num_tokens)

"""`mlx-redrafter kernels`: time the fused Metal kernels against the pure-MLX fallback.

Per decoding step it times the three fused steps (beam expansion, tree packing,
acceptance) and the whole draft they serve (a randomly initialized drafter's beam
search, as `decode.py` runs it) on random inputs of the given shapes, each call
evaluated on its own. Without Metal it says so and times the fallback only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..beam_search import beam_search
from ..config import TreeConfig
from ..drafter import Drafter, DrafterConfig
from ..kernels import METAL_KERNELS, MLX_KERNELS, Kernels
from ..tree import pack_tree

NO_METAL = (
    "Metal is not available on this machine (mx.metal.is_available() is False): "
    "timing the pure-MLX fallback only. No kernel timing was taken."
)


def register(commands: Any) -> None:
    """Add the `kernels` subcommand to the `mlx-redrafter` parser."""
    parser = commands.add_parser(
        "kernels",
        help="micro-benchmark the fused Metal kernels against the pure-MLX fallback",
        description="Time one beam expansion, tree packing and acceptance, and a whole draft "
        "(a random drafter's beam search), per call, fused Metal kernels against the pure-MLX "
        "fallback (eager and mx.compile'd), on random inputs. Without Metal only the "
        "fallback is timed.",
        epilog="example: mlx-redrafter kernels --beam-width 4 --beam-length 4 --vocab 49152",
    )
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--beam-length", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=49152, help="draft vocabulary size Vd")
    parser.add_argument(
        "--hidden", type=int, default=576, help="hidden size D of the drafter's target"
    )
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=run)


@dataclass(frozen=True)
class Timing:
    step: str  # "expand", "pack", "accept" or "draft"
    implementation: str  # e.g. "mlx", "mlx compiled", "metal"
    median_seconds: float
    identical: bool | None  # outputs equal to the eager fallback's (None: the fallback)


def step_inputs(
    batch_size: int, shape: TreeConfig, vocab_size: int, seed: int
) -> dict[str, tuple[Any, ...]]:
    """Random inputs of one step for each fused step: "expand" (scores, logits),
    "pack" (beams, N, share_prefixes), "accept" (beams, unpack, canonical, choices)."""
    rng = np.random.default_rng(seed)
    width, length = shape.beam_width, shape.beam_length
    scores = mx.array(-np.sort(rng.exponential(size=(batch_size, width)), axis=-1), mx.float32)
    logits = mx.array(rng.normal(scale=3.0, size=(batch_size, width, vocab_size)), mx.float32)
    # Few distinct tokens, so beams share prefixes; choices follow a random beam.
    beams_np = rng.integers(0, 3, size=(batch_size, width, length)).astype(np.int32)
    beams_np[:, :, 0] = 1
    beams = mx.array(beams_np)
    tree = pack_tree(beams, shape.num_packed, shape.share_prefixes)
    choices = mx.array(rng.integers(0, 3, size=(batch_size, shape.num_packed)).astype(np.int32))
    return {
        "expand": (scores, logits),
        "pack": (beams, shape.num_packed, shape.share_prefixes),
        "accept": (beams, tree.unpack, tree.canonical, choices),
    }


def draft_inputs(
    batch_size: int, shape: TreeConfig, vocab_size: int, hidden_size: int, seed: int
) -> tuple[Callable[[Kernels], Callable[..., Any]], tuple[mx.array, mx.array]]:
    """The whole draft of one step: a randomly initialized drafter (D = hidden_size,
    two layers, vocabulary Vd = vocab_size) beside a random token embedding, and its
    inputs, hidden (B, D) and roots (B,). Returns (kernels -> the draft function,
    its array inputs)."""
    mx.random.seed(seed)
    config = DrafterConfig(vocab_size, hidden_size, exit_dim=hidden_size * 2 // 3)
    drafter, embed = Drafter(config), nn.Embedding(vocab_size, hidden_size)
    hidden = mx.random.normal((batch_size, hidden_size))  # (B, D)
    roots = mx.random.randint(0, vocab_size, (batch_size,))  # (B,)
    width, length = shape.beam_width, shape.beam_length

    def draft(kernels: Kernels) -> Callable[..., Any]:
        def search(hidden: mx.array, roots: mx.array) -> mx.array:
            return beam_search(drafter, embed, hidden, roots, width, length, kernels.expand)

        return search

    return draft, (hidden, roots)


def median_seconds(call: Callable[[], Any], iterations: int, warmup: int) -> float:
    for _ in range(warmup):
        mx.eval(call())
    samples = []
    for _ in range(iterations):
        started = time.perf_counter()
        mx.eval(call())
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _arrays_only(
    function: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[Callable[..., Any], tuple[mx.array, ...]]:
    """Bind the static (non-array) arguments, so the function can be mx.compile'd."""
    static = {i: a for i, a in enumerate(args) if not isinstance(a, mx.array)}
    arrays = tuple(a for a in args if isinstance(a, mx.array))
    if not static:
        return function, arrays

    def bound(*given: mx.array) -> Any:
        supplied = iter(given)
        return function(*(static[i] if i in static else next(supplied) for i in range(len(args))))

    return bound, arrays


def _same(a: tuple[mx.array, ...], b: tuple[mx.array, ...]) -> bool:
    return all(np.array_equal(np.array(x), np.array(y)) for x, y in zip(a, b))


def benchmark(
    batch_size: int,
    shape: TreeConfig,
    vocab_size: int,
    iterations: int,
    warmup: int,
    seed: int = 0,
    metal: Kernels | None = None,
    hidden_size: int = 576,
) -> list[Timing]:
    """Median seconds per call of each implementation of each step."""
    inputs = step_inputs(batch_size, shape, vocab_size, seed)
    draft, draft_args = draft_inputs(batch_size, shape, vocab_size, hidden_size, seed)
    implementations: list[tuple[str, Kernels, bool]] = [
        ("mlx", MLX_KERNELS, False),
        ("mlx compiled", MLX_KERNELS, True),
    ]
    if metal is not None:
        implementations += [
            (metal.backend, metal, False),
            (f"{metal.backend} compiled", metal, True),
        ]
    reference = {
        "expand": tuple(MLX_KERNELS.expand(*inputs["expand"])),
        "pack": tuple(MLX_KERNELS.pack(*inputs["pack"])),
        "accept": tuple(MLX_KERNELS.accept(*inputs["accept"])),
        "draft": (draft(MLX_KERNELS)(*draft_args),),
    }
    timings = []
    for name, kernels, compiled in implementations:
        steps: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
            ("expand", kernels.expand, inputs["expand"]),
            ("pack", kernels.pack, inputs["pack"]),
            ("accept", kernels.accept, inputs["accept"]),
            ("draft", draft(kernels), draft_args),
        ]
        for step, function, args in steps:
            function, args = _arrays_only(function, args)
            function = mx.compile(function) if compiled else function
            identical = None
            if name != "mlx":
                result = function(*args)
                result = (result,) if isinstance(result, mx.array) else tuple(result)
                identical = _same(result, reference[step])

            def call(function: Callable[..., Any] = function, args: tuple = args) -> Any:
                return function(*args)

            timings.append(Timing(step, name, median_seconds(call, iterations, warmup), identical))
    return timings


def run(args: argparse.Namespace) -> int:
    shape = TreeConfig(args.beam_width, args.beam_length)
    available = mx.metal.is_available()
    print(
        f"B={args.batch_size} W={shape.beam_width} L={shape.beam_length} Vd={args.vocab} "
        f"N={shape.num_packed}; device {mx.default_device()}; "
        f"median of {args.iterations} calls, each evaluated on its own"
    )
    if not available:
        print(NO_METAL)
    timings = benchmark(
        args.batch_size,
        shape,
        args.vocab,
        args.iterations,
        args.warmup,
        args.seed,
        METAL_KERNELS if available else None,
        args.hidden,
    )
    for timing in timings:
        check = ""
        if timing.identical is not None:
            check = "  outputs identical" if timing.identical else "  OUTPUTS DIFFER"
        print(
            f"{timing.step:<7} {timing.implementation:<16} "
            f"{timing.median_seconds * 1e6:10.1f} us/call{check}"
        )
    return 0 if all(t.identical is not False for t in timings) else 1

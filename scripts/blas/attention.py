"""Time the pieces of MLX's attention for a tree of N query tokens, at SmolLM2-135M's shapes.

MLX's CPU backend runs `mx.fast.scaled_dot_product_attention` as separate operations;
this times the whole call and each piece, for N = 1 (plain decoding) and larger trees,
through whatever BLAS the process has (see scripts/env.sh):

    source scripts/env.sh && .venv/bin/python scripts/blas/attention.py

Prints a Markdown table of microseconds per call (median of `--repeats`, each call
evaluated on its own, so every figure includes one evaluation's overhead).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import mlx.core as mx

from mlx_redrafter.commands.kernels import median_seconds

QUERY_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
ROPE_BASE = 100000.0


def microseconds(function: Callable[[], mx.array], repeats: int) -> float:
    return median_seconds(function, repeats, warmup=10) * 1e6


def row(num_tokens: int, context: int, repeats: int) -> list[float]:
    """Whole attention, softmax, mask, q @ k^T, p @ v and rotary for N query tokens."""
    repeat = QUERY_HEADS // KV_HEADS
    queries = mx.random.normal((1, QUERY_HEADS, num_tokens, HEAD_DIM))  # (B, H, N, Dh)
    keys = mx.random.normal((1, KV_HEADS, context + num_tokens, HEAD_DIM))  # (B, Hkv, T+N, Dh)
    values = mx.random.normal((1, KV_HEADS, context + num_tokens, HEAD_DIM))
    grouped = queries.reshape(1, KV_HEADS, repeat, num_tokens, HEAD_DIM)  # (B, Hkv, r, N, Dh)
    scores = grouped @ keys[:, :, None].swapaxes(-1, -2)  # (B, Hkv, r, N, T+N)
    mask = mx.ones((1, 1, num_tokens, context + num_tokens), dtype=mx.bool_)
    mx.eval(queries, keys, values, grouped, scores, mask)
    return [
        microseconds(
            lambda: mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=HEAD_DIM**-0.5, mask=mask if num_tokens > 1 else None
            ),
            repeats,
        ),
        microseconds(lambda: mx.softmax(scores, axis=-1, precise=True), repeats),
        microseconds(lambda: mx.where(scores > 0, scores, -mx.inf), repeats),
        microseconds(lambda: grouped @ keys[:, :, None].swapaxes(-1, -2), repeats),
        microseconds(lambda: scores @ values[:, :, None], repeats),
        microseconds(
            lambda: mx.fast.rope(
                queries, HEAD_DIM, traditional=False, base=ROPE_BASE, scale=1.0, offset=context
            ),
            repeats,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--context", type=int, default=300, help="committed tokens T")
    parser.add_argument(
        "--tokens",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 4, 8],
        help="comma-separated query counts N (default 1,4,8)",
    )
    args = parser.parse_args()
    columns = ["attention", "softmax", "mask", "q @ k^T", "p @ v", "rope"]
    print(f"| N (T = {args.context}) | " + " | ".join(columns) + " |")
    print("| --- |" + " --- |" * len(columns))
    for num_tokens in args.tokens:
        cells = [f"{us:.0f}" for us in row(num_tokens, args.context, args.repeats)]
        print(f"| {num_tokens} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

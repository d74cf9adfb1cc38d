"""Time MLX's fp32 matmul at the shapes of decoding SmolLM2-135M, for a few rows M.

Runs through whatever BLAS the process has (see scripts/env.sh), so comparing
BLAS setups is two runs:

    source scripts/env.sh && .venv/bin/python scripts/blas/shapes.py             # router
    MLX_REDRAFTER_NO_ROUTER=1 bash -c 'source scripts/env.sh && \\
        .venv/bin/python scripts/blas/shapes.py'                                  # system OpenBLAS

`--rows 8,9,12,16` picks the row counts (default 1,2,3,4,8,16). Each shape cycles
through enough distinct weight matrices to exceed the L3 cache,
as a forward pass does. Prints a Markdown table of microseconds per product.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

# (output features, input features): attention k/v and q/o, MLP up/gate and down,
# the output head (vocabulary 49152).
SHAPES = [(192, 576), (576, 576), (1536, 576), (576, 1536), (49152, 576)]
ROWS = [1, 2, 3, 4, 8, 16]
WORKING_SET_BYTES = 128 * 2**20


def microseconds_per_product(rows: int, out_features: int, in_features: int, repeats: int) -> float:
    count = max(1, WORKING_SET_BYTES // (4 * out_features * in_features))
    weights = [mx.random.normal((out_features, in_features)) for _ in range(count)]
    x = mx.random.normal((1, rows, in_features))  # (B, M, D)
    mx.eval(weights, x)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval([x @ w.T for w in weights])  # (B, M, out) each
        samples.append((time.perf_counter() - started) / count)
    samples.sort()
    return samples[len(samples) // 2] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--rows",
        type=lambda text: [int(m) for m in text.split(",")],
        default=ROWS,
        help="comma-separated row counts M (default 1,2,3,4,8,16)",
    )
    args = parser.parse_args()
    print("| shape (out × in) | " + " | ".join(f"M={m}" for m in args.rows) + " |")
    print("| --- |" + " --- |" * len(args.rows))
    for out_features, in_features in SHAPES:
        cells = [
            f"{microseconds_per_product(m, out_features, in_features, args.repeats):.0f}"
            for m in args.rows
        ]
        print(f"| {out_features} × {in_features} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

"""`mlx-redrafter calibrate`: measure (or show the cached) step cost curve of a model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..calibrate import cached_calibration, calibration_folder, format_calibration
from ..distributed import SHARD_MODES, is_main_process
from .common import load_from_args


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "calibrate",
        help="measure this machine's step cost for a model (the auto tree's cost curve)",
        description="Measure how long the target takes to verify N packed tokens (N = 1..64, "
        "at two context lengths) and the drafter to draft, on this device, dtype and "
        "quantization; the auto tree reads it. The result is cached per model, drafter, "
        "device, dtype, quantization and MLX version; --remeasure measures again.",
        epilog="example: mlx-redrafter calibrate mlx-community/Qwen2.5-0.5B-Instruct-4bit",
    )
    parser.add_argument(
        "model_name",
        nargs="?",
        metavar="MODEL",
        help="MLX model folder or Hub id (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--drafter", help="drafter folder (default: the model's shipped one)")
    parser.add_argument("--no-drafter", action="store_true", help="calibrate without a drafter")
    parser.add_argument("--remeasure", action="store_true", help="ignore the cached curve")
    parser.add_argument("--plot", type=Path, help="also write the curve as a PNG here")
    parser.add_argument(
        "--shard",
        choices=SHARD_MODES,
        help="under mlx.launch: measure the model split across the ranks (the network's "
        "cost included); rank 0 prints",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    args.model = args.model_name or args.model
    model, drafter, _ = load_from_args(args)
    calibration, measured = cached_calibration(model, drafter, remeasure=args.remeasure)
    if not is_main_process():
        return 0
    how = f"measured in {calibration.seconds:.1f} s" if measured else "cached"
    key = calibration.key
    print(
        f"step cost on {key.device} ({key.dtype}, quantization {key.quantization}, "
        f"MLX {key.mlx}; {how}, {calibration_folder() / (key.digest + '.json')})",
        file=sys.stderr,
    )
    print(format_calibration(calibration))
    if args.plot is not None:
        from ..bench_plots import cost_curve

        print(f"plot: {cost_curve(calibration.to_dict(), args.plot)}", file=sys.stderr)
    return 0

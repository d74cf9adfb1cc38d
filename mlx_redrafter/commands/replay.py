"""`mlx-redrafter replay`: trees and the auto tree compared on recorded greedy replies,
with step costs from this machine's calibration instead of a clock."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..bench import environment
from ..calibrate import cached_calibration
from ..files import write_json
from ..prompts import encode_prompt, read_prompts, select_prompts
from ..replay import RecordShape, StepCost, record_replies, replay_trees
from .common import add_benchmark_inputs, load_from_args, parse_trees


def register(commands: Any) -> None:
    """Add the `replay` subcommand to the `mlx-redrafter` parser."""
    replay = commands.add_parser(
        "replay",
        help="compare trees and the auto tree on recorded greedy replies, without timing noise",
        description="Decodes each prompt's greedy reply once, records what every drafter "
        "beam and lookup branch would have had accepted at each of its positions, and "
        "replays each tree (and the auto tree's choice) over the recording, with step "
        "times from this machine's calibration. Prints tau, the replayed speed-up "
        "over replayed plain decoding, and the trees the auto tree used.",
        epilog="example: mlx-redrafter replay --per-category 2 --max-tokens 128 "
        "--tree auto,1x2+1x7,1x2+1x4",
    )
    add_benchmark_inputs(replay, "no drafter: plain decoding and lookup trees")
    replay.add_argument("--max-tokens", type=int, default=128)
    replay.add_argument(
        "--tree",
        type=parse_trees,
        default=("auto",),
        help="trees to replay (WxL, WxL+GxLl, auto), comma-separated (default auto)",
    )
    replay.add_argument(
        "--tree-overhead-ms",
        type=float,
        default=0.0,
        help="milliseconds a tree step costs beyond the calibrated curve (default 0)",
    )
    replay.add_argument("--out", default=None, help="also write replay.json in this folder")
    replay.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    if args.tree_overhead_ms < 0:
        raise ValueError("--tree-overhead-ms must be >= 0")
    records = select_prompts(read_prompts(args.prompts), args.per_category, args.limit)
    shape = RecordShape()
    for tree in args.tree:
        if not isinstance(tree, str):
            shape.check(tree)
    model, drafter, tokenizer = load_from_args(args)
    prompts = [encode_prompt(tokenizer, record.messages) for record in records]
    calibration, _ = cached_calibration(model, drafter, announce=True)

    def progress(done: int, total: int) -> None:
        print(f"\r[replay] recorded {done}/{total}", end="", file=sys.stderr, flush=True)

    recordings = record_replies(
        model, drafter, tokenizer, prompts, args.max_tokens, shape, progress
    )
    print(file=sys.stderr)
    cost = StepCost(calibration, args.tree_overhead_ms / 1000.0)
    results = replay_trees(recordings, args.tree, cost, drafter)
    plain = results["1x1"].tokens_per_second
    print(
        f"{len(prompts)} prompts x {args.max_tokens} tokens, {calibration.key.device}, "
        f"tree overhead {args.tree_overhead_ms:g} ms"
    )
    print(f"{'tree':<14} {'tau':>6} {'speed-up':>9} {'steps':>7}  most used")
    rows = {}
    for label, result in results.items():
        used = ", ".join(f"{t} {n}" for t, n in result.trees.most_common(4))
        speedup = result.tokens_per_second / plain if plain else 0.0
        print(f"{label:<14} {result.tau:>6.2f} {speedup:>8.2f}x {result.steps:>7}  {used}")
        rows[label] = {
            "tau": result.tau,
            "speedup": speedup,
            "steps": result.steps,
            "tokens": result.tokens,
            "trees_used": dict(result.trees),
        }
    if args.out:
        summary = {
            "environment": environment(),
            "calibration": calibration.to_dict(),
            "prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "tree_overhead_ms": args.tree_overhead_ms,
            "results": rows,
        }
        path = Path(args.out) / "replay.json"
        write_json(path, summary)
        print(f"wrote {path}")
    return 0

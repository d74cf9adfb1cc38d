"""`mlx-redrafter distill`: the target generates the drafter's training data."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any

from ..config import DEFAULT_TREE
from ..distill import DistillConfig, balanced_order, distill
from ..loading import NoShippedDrafterWarning, load
from ..prompts import read_prompts
from .common import parse_tree


def _weights(text: str | None) -> dict[str, float]:
    weights: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            weights[name.strip()] = float(value)
        except ValueError:
            raise ValueError(
                f"--source-weights: {item!r} is not source=weight "
                "(e.g. gpteacher-roleplay=3,gsm8k-train=1)"
            ) from None
    return weights


def register(commands: Any) -> None:
    """Add the `distill` subcommand to the `mlx-redrafter` parser."""
    parser = commands.add_parser(
        "distill",
        help="generate drafter training data with the target (self-distillation)",
        description="Decode prompts with the target and store prompt + reply token ids as "
        "shards in a folder. Resumable: run the same command again to continue.",
        epilog="example: mlx-redrafter distill --prompts prompts.jsonl --output data/distilled",
    )
    parser.add_argument("--prompts", required=True, help="JSONL: {'prompt': ...} or ShareGPT")
    parser.add_argument("--output", required=True, help="folder for the shards (resumed)")
    parser.add_argument("--model", help="MLX model folder or Hub id (default: embedded SmolLM2)")
    parser.add_argument(
        "--drafter",
        help="decode with this drafter (speculative; same output in greedy mode, faster)",
    )
    parser.add_argument(
        "--tree",
        default=DEFAULT_TREE,
        help="the tree with --drafter, as in `bench --tree` (WxL, WxL+GxLl, ...; "
        f"default {DEFAULT_TREE}, the default of generation)",
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--length-window",
        type=int,
        default=8,
        help="sort each run of this many batches by prompt length, so that a batch's "
        "rows share a similar prefill (1: keep the order)",
    )
    parser.add_argument("--limit", type=int, default=None, help="records wanted in total")
    parser.add_argument(
        "--worker",
        default="0/1",
        help="i/n: this process decodes every n-th prompt (run n of them on one folder)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="order shuffle and sampling seed")
    parser.add_argument(
        "--source-weights",
        help="interleave the prompts' 'source' tags with these weights, e.g. "
        "gpteacher-roleplay=3,gsm8k-train=1 (unlisted sources: 1; 0 drops one)",
    )
    parser.add_argument("--no-chat-template", action="store_true")
    parser.add_argument("--strict", action="store_true", help="fail on a bad JSONL line")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def _worker(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    if not sep or not index.isdigit() or not count.isdigit() or int(index) >= int(count):
        raise ValueError(f"--worker: {text!r} is not i/n with 0 <= i < n (e.g. 0/2)")
    return int(index), int(count)


def run(args: argparse.Namespace) -> int:
    worker = _worker(args.worker)
    tree = parse_tree(args.tree)
    records = read_prompts(args.prompts, strict=args.strict)
    order = balanced_order(records, _weights(args.source_weights), seed=args.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoShippedDrafterWarning)
        model, drafter, tokenizer = load(args.model, args.drafter)
    if args.drafter is None:
        drafter = None
    config = DistillConfig(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        chat_template=not args.no_chat_template,
        model=args.model or "default",
    )
    started = time.perf_counter()
    shards = 0
    for _ in distill(
        model,
        tokenizer,
        order,
        args.output,
        config,
        batch_size=args.batch_size,
        length_window=args.length_window,
        limit=args.limit,
        worker=worker,
        drafter=drafter,
        tree=tree,
        progress=not args.quiet,
    ):
        shards += 1
    print(
        f"distill: wrote {shards} shard(s) to {args.output} in "
        f"{time.perf_counter() - started:.0f} s",
        file=sys.stderr,
    )
    return 0

"""`mlx-redrafter make-drafter`: distill, train, evaluate and card a drafter in one command."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..prompts import TRAIN_PROMPTS, read_prompts
from ..training.budget import parse_duration
from ..training.recipe import Recipe, Run, Target, make_drafter
from .common import load_from_args


def register(commands: Any) -> None:
    """Add the `make-drafter` subcommand to the `mlx-redrafter` parser."""
    parser = commands.add_parser(
        "make-drafter",
        help="make a drafter for a model in one command (distill, train, evaluate, card)",
        description="The model answers prompts (the built-in set unless --prompts), a "
        "drafter learns from its hidden states, an n-gram table and an acceptance table "
        "are built, the drafter is evaluated on held-out prompts against mlx-lm, and "
        "DIR/README.md describes it. Resumable: run the same command again after a stop.",
        epilog="example: mlx-redrafter make-drafter gemma-3-270m --output drafters/gemma "
        "--time-budget 2h",
    )
    parser.add_argument(
        "model",
        nargs="?",
        help="MLX model folder, Hub id or embedded name (default: the embedded SmolLM2)",
    )
    parser.add_argument("--output", required=True, help="folder for the drafter (resumed)")
    parser.add_argument(
        "--prompts",
        action="append",
        help="JSONL prompts or ShareGPT conversations instead of the built-in set "
        "(repeat to combine; add 'builtin' to keep the built-in set too)",
    )
    parser.add_argument(
        "--time-budget",
        help="fit the whole run in this time (e.g. 30m, 4h), sized by measuring this "
        "machine first; default: a fixed recipe of 2000 replies and 3 epochs",
    )
    parser.add_argument("--records", type=int, help="replies to distil (overrides the budget)")
    parser.add_argument("--max-tokens", type=int, default=256, help="reply length cap")
    parser.add_argument("--draft-vocab", type=int, default=0, help="0: chosen by coverage")
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts")
    parser.add_argument("--eval-max-tokens", type=int, default=128)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(run=run, drafter=None, no_drafter=True)


def _prompts(paths: list[str] | None) -> tuple[list[Any], str]:
    if not paths:
        return read_prompts(TRAIN_PROMPTS), "built-in prompts"
    records: list[Any] = []
    for path in paths:
        records += read_prompts(TRAIN_PROMPTS if path == "builtin" else path)
    return records, ",".join(paths)


def _recipe(args: argparse.Namespace) -> Recipe:
    if min(args.max_tokens, args.eval_prompts, args.eval_max_tokens) < 1 or args.epochs <= 0:
        raise ValueError("--max-tokens, --eval-prompts, --eval-max-tokens and --epochs must be > 0")
    if args.draft_vocab < 0:
        raise ValueError("--draft-vocab must be >= 0 (0: chosen by coverage)")
    recipe = Recipe(
        max_tokens=args.max_tokens,
        draft_vocab=args.draft_vocab,
        seed=args.seed,
        eval_prompts=args.eval_prompts,
        eval_max_tokens=args.eval_max_tokens,
    )
    recipe = replace(recipe, train=replace(recipe.train, epochs=args.epochs, seed=args.seed))
    if args.records is not None:
        if args.records < 1:
            raise ValueError("--records must be >= 1")
        recipe = replace(recipe, records=args.records)
    return recipe


def run(args: argparse.Namespace) -> int:
    budget = parse_duration(args.time_budget) if args.time_budget else None
    if budget is not None and budget < 60:
        raise ValueError("--time-budget must be at least 1m: the machine probe alone takes ~1 min")
    if budget is not None and args.records is not None:
        raise ValueError("give --records or --time-budget, not both")
    recipe = _recipe(args)
    records, label = _prompts(args.prompts)
    model, _, tokenizer = load_from_args(args)
    name = args.model or "SmolLM2-135M-Instruct"
    output = make_drafter(
        Target(model, tokenizer, name),
        records,
        Run(Path(args.output), progress=not args.quiet),
        recipe,
        label,
        budget_seconds=budget,
    )
    print(f"make-drafter: the drafter and its card are in {output}", file=sys.stderr)
    return 0

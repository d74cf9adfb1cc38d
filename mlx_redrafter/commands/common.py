"""Pieces shared by the subcommands."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

import mlx.nn as nn

from ..config import TreeConfig
from ..decode import plan_step
from ..distributed import is_main_process
from ..drafter import Drafter
from ..loading import NoShippedDrafterWarning, load
from ..prompts import MT_BENCH


def load_from_args(args: argparse.Namespace) -> tuple[nn.Module, Drafter | None, Any]:
    """`load(--model, --drafter)`, honouring --no-drafter; loading notes go to stderr."""
    no_drafter = getattr(args, "no_drafter", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NoShippedDrafterWarning)
        model, drafter, tokenizer = load(
            args.model, None if no_drafter else args.drafter, getattr(args, "shard", None)
        )
    for note in caught if is_main_process() else []:
        print(f"note: {note.message}", file=sys.stderr)
    return model, None if no_drafter else drafter, tokenizer


def add_benchmark_inputs(parser: argparse.ArgumentParser, no_drafter_help: str) -> None:
    """--model, --drafter, --no-drafter and the prompt selection (--prompts, --limit,
    --per-category: `prompts.select_prompts`) of `bench` and `replay`."""
    parser.add_argument("--model", help="MLX model folder or Hub id (default: embedded)")
    parser.add_argument("--drafter", help="drafter folder or Hub id (default: shipped)")
    parser.add_argument("--no-drafter", action="store_true", help=no_drafter_help)
    parser.add_argument(
        "--prompts",
        default=str(MT_BENCH),
        help="JSONL of MT-Bench questions or {'prompt': ...} rows (default: MT-Bench first turns)",
    )
    parser.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    parser.add_argument(
        "--per-category",
        type=int,
        default=None,
        help="use the first N prompts of each category (MT-Bench: 8 categories of 10 prompts)",
    )


def parse_trees(text: str, option: str = "--tree") -> tuple[TreeConfig | str, ...]:
    """'auto,4x4,1x3+1' -> ("auto", TreeConfig(4, 4), TreeConfig(1, 3, lookup_branches=1));
    see TreeConfig.parse. A bad shape is a ValueError that names the option."""
    try:
        return tuple(
            "auto" if item.strip().lower() == "auto" else TreeConfig.parse(item)
            for item in text.split(",")
        )
    except ValueError as error:
        raise ValueError(f"{option}: {error} (or 'auto', the default)") from None


def parse_tree(text: str, option: str = "--tree") -> TreeConfig | str:
    """One tree, e.g. '1x2+1x7' (`parse_trees` of a single shape)."""
    trees = parse_trees(text, option)
    if len(trees) != 1:
        raise ValueError(f"{option} takes one tree here, e.g. 1x2+1x7; got {text!r}")
    return trees[0]


def describe_tree(drafter: Drafter | None, tree: TreeConfig | str) -> str:
    """How a session with this drafter and tree decodes, for the user (see `plan_step`)."""
    if isinstance(tree, str):
        source = "drafter and lookup" if drafter is not None else "lookup"
        return f"ReDrafter auto tree ({source} trees or plain, chosen per step)"
    plan = plan_step(tree, drafter is not None)
    if plan.plain:
        return "plain decoding"
    return f"ReDrafter {plan.tree.label} (W drafter beams x L, + lookup branches)"

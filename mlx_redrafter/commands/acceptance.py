"""`mlx-redrafter measure-acceptance`: a drafter's acceptance per depth, for the auto tree."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..drafter import acceptance_file
from ..files import write_json
from ..prompts import encode_prompt, read_prompts
from ..training.evaluate import ACCEPTANCE_LENGTHS, ACCEPTANCE_TREE, measure_acceptance
from .common import load_from_args, parse_tree
from .generate import add_model_arguments


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "measure-acceptance",
        help="measure how deep a drafter's beams and lookup branches are accepted",
        description="Decode prompts with a wide tree and print, per depth, the fraction of "
        "steps where the best of the first k drafter beams (and of the first k lookup "
        "branches) had that many drafted tokens accepted. --write stores it beside the "
        "drafter (acceptance.json; acceptance-sampled.json with --temperature above 0), "
        "where the auto tree starts from it.",
    )
    add_model_arguments(parser)
    parser.add_argument("--prompts", required=True, help="JSONL prompts (held out from training)")
    parser.add_argument("--count", type=int, default=24, help="prompts, evenly spaced (0: all)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--tree", default=ACCEPTANCE_TREE.label, help="the measuring tree")
    parser.add_argument(
        "--lengths",
        default=",".join(str(n) for n in ACCEPTANCE_LENGTHS),
        help="shorter beam lengths to measure the drafter's beams at too, comma-separated "
        "(each decodes the prompts again; '' for none)",
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help="write acceptance.json (acceptance-sampled.json when sampling) into --drafter",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    tree = parse_tree(args.tree)
    if isinstance(tree, str):
        raise ValueError("--tree: give a fixed tree to measure with, e.g. 8x7+4x10")
    if args.write and not args.drafter:
        raise ValueError("--write needs --drafter FOLDER (the table is written beside it)")
    lengths = parse_lengths(args.lengths)
    model, drafter, tokenizer = load_from_args(args)
    records = read_prompts(args.prompts)
    if args.count and args.count < len(records):
        records = [records[i * len(records) // args.count] for i in range(args.count)]
    prompts = [encode_prompt(tokenizer, record.messages) for record in records]
    source = f"{len(prompts)} prompts of {Path(args.prompts).name} x {args.max_tokens} tokens"
    table = measure_acceptance(
        model,
        drafter,
        prompts,
        tree=tree,
        lengths=lengths,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        source=source,
    )
    print(json.dumps(table.to_dict(), indent=1))
    if args.write:
        path = Path(args.drafter) / acceptance_file(args.temperature)
        write_json(path, table.to_dict())
        print(f"wrote {path}", file=sys.stderr)
    return 0


def parse_lengths(text: str) -> tuple[int, ...]:
    """'2,3,4' -> (2, 3, 4): beam lengths of at least 2 tokens."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not all(item.isdecimal() and int(item) >= 2 for item in items):
        raise ValueError(f"--lengths: beam lengths of at least 2 tokens, e.g. 2,3,4; got {text!r}")
    return tuple(int(item) for item in items)

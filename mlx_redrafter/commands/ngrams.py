"""`mlx-redrafter ngrams`: add an n-gram table of the distilled replies to a drafter."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..distill import load_distilled
from ..drafter import Drafter
from ..ngrams import NGRAMS_FILE, build_ngram_table, save_ngram_table
from ..training import TrainConfig, training_replies


def register(commands: Any) -> None:
    """Add the `ngrams` subcommand to the `mlx-redrafter` parser."""
    parser = commands.add_parser(
        "ngrams",
        help="store an n-gram table of distilled replies beside a drafter (lookup branches)",
        description="Count the n-grams of the replies in distilled shards (the training "
        "split: the same held-out ids as `train`) and write, for each, the continuation "
        f"the target wrote most often into DRAFTER/{NGRAMS_FILE}. Lookup branches with no "
        "match in the row's own text then copy it.",
        epilog="example: mlx-redrafter ngrams --data data/distilled --drafter runs/x/drafter",
    )
    parser.add_argument("--data", action="append", required=True, help="distilled folder(s)")
    parser.add_argument("--drafter", required=True, help="drafter folder to add the table to")
    parser.add_argument("--order", type=int, default=2, help="longest n-gram (default 2)")
    parser.add_argument(
        "--length", type=int, default=6, help="tokens kept per continuation (default 6)"
    )
    parser.add_argument(
        "--min-count",
        type=int,
        default=2,
        help="leave out n-grams (n >= 2) seen fewer times (default 2; single tokens stay)",
    )
    defaults = TrainConfig()
    parser.add_argument(
        "--validation-fraction",
        type=float,
        default=defaults.validation_fraction,
        help="held-out share left out of the table, as in `train` (default %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="as in `train`")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    folder = Path(args.drafter)
    drafter = Drafter.load(folder)  # a clear error when it is not a drafter folder
    replies = training_replies(load_distilled(args.data), args.validation_fraction, args.seed)
    vocab_size = drafter.config.vocab_size
    if max((max(reply, default=0) for reply in replies), default=0) >= vocab_size:
        raise ValueError(
            f"the distilled replies hold token ids >= {vocab_size}, the drafter's target "
            "vocabulary: they were written by another model"
        )
    started = time.perf_counter()
    table = build_ngram_table(replies, args.order, args.length, args.min_count)
    path = save_ngram_table(table, folder)
    print(
        f"{path}: {table.size} n-grams (n <= {table.order}) of {len(replies)} replies, "
        f"{table.length} tokens each, {path.stat().st_size / 1e6:.2f} MB, "
        f"{time.perf_counter() - started:.0f} s",
        file=sys.stderr,
    )
    return 0

"""Pieces shared by the subcommands."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

import mlx.nn as nn

from ..drafter import Drafter
from ..loading import NoShippedDrafterWarning, load


def load_from_args(args: argparse.Namespace) -> tuple[nn.Module, Drafter | None, Any]:
    """`load(--model, --drafter)`, honouring --no-drafter; loading notes go to stderr."""
    no_drafter = getattr(args, "no_drafter", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NoShippedDrafterWarning)
        model, drafter, tokenizer = load(args.model, None if no_drafter else args.drafter)
    for note in caught:
        print(f"note: {note.message}", file=sys.stderr)
    return model, None if no_drafter else drafter, tokenizer

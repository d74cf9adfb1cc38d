"""Pieces shared by the subcommands."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

import mlx.nn as nn

from ..config import PLAIN_DECODING, BeamConfig
from ..decode import decoding_beam
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


def parse_beams(text: str, option: str = "--beams") -> tuple[BeamConfig, ...]:
    """'4x4,1x3+1' -> (BeamConfig(4, 4), BeamConfig(1, 3, lookup_beams=1)); see
    BeamConfig.parse. A bad shape is a ValueError that names the option."""
    try:
        return tuple(BeamConfig.parse(item) for item in text.split(","))
    except ValueError as error:
        raise ValueError(f"{option}: {error}") from None


def parse_beam(text: str, option: str = "--beams") -> BeamConfig:
    """One tree, e.g. '1x2+1x7' (`parse_beams` of a single shape)."""
    beams = parse_beams(text, option)
    if len(beams) != 1:
        raise ValueError(f"{option} takes one tree here, e.g. 1x2+1x7; got {text!r}")
    return beams[0]


def describe_tree(drafter: Drafter | None, beam: BeamConfig) -> str:
    """How a session with this drafter and tree decodes, for the user (see `decoding_beam`)."""
    if decoding_beam(drafter, beam) == PLAIN_DECODING:
        return "plain decoding"
    return f"ReDrafter {beam.label} (W drafter beams x L, + lookup beams)"

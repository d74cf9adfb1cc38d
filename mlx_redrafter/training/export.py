"""Writing what a run made: the drafter (and a copy in a smaller dtype), the n-gram
table of its training replies for lookup branches, and JSON reports."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from .. import files
from ..drafter import Drafter
from ..ngrams import NgramTable, build_ngram_table, save_ngram_table
from .data import training_replies

if TYPE_CHECKING:
    from ..distill import DistilledSequence

EXPORT_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def export_drafter(drafter: Drafter, path: str | os.PathLike[str], dtype_name: str) -> None:
    """Save `drafter` to `path` with weights in `dtype_name` (one of EXPORT_DTYPES;
    cast back to float32 at load); the drafter itself stays float32."""
    dtype = EXPORT_DTYPES[dtype_name]
    if dtype == mx.float32:
        drafter.save(path, overwrite=True)
        return
    drafter.set_dtype(dtype)
    try:
        drafter.save(path, overwrite=True)
    finally:
        drafter.set_dtype(mx.float32)


def save_ngrams(
    records: Sequence[DistilledSequence],
    validation_fraction: float,
    seed: int,
    order: int,
    folders: Sequence[str | os.PathLike[str]],
) -> NgramTable:
    """Build the n-gram table (n <= order) of the replies `train` learns from (as
    `mlx-redrafter ngrams`) and store it in each drafter folder."""
    replies = training_replies(records, validation_fraction, seed)
    table = build_ngram_table(replies, order=order)
    for folder in folders:
        save_ngram_table(table, folder)
    return table


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Write `data` as indented JSON, atomically, creating the folder."""
    files.write_json(path, data, indent=2)

"""Which target a drafter was made for: a fingerprint of its weights and tokenizer.

A drafter folder may hold `target.json`, written by `make-drafter`: the target's
architecture (family, hidden size D, vocabulary V, layers), a SHA-256 of its
tokenizer's vocabulary, and a probe of its token embeddings (a few rows). `load()`
uses it to find the drafter that fits a model without being told, and to refuse one
made for another model. Names play no part: a model converted to another dtype or
quantized to 4 or 8 bits keeps its architecture and tokenizer, and its embedding rows
stay within quantization error of the original's (cosine similarity near 1), so it
finds the same drafter; a different model with the same architecture does not.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .drafter import target_dimensions
from .files import write_json

TARGET_FILE = "target.json"
# Embedding rows the probe keeps, spread over the vocabulary, and their first dims.
PROBE_ROWS = 8
PROBE_DIMS = 128
# Cosine similarity of the probe rows above which the weights are the same model's
# (4-bit group-64 quantization keeps it above 0.99 on the default model).
SAME_WEIGHTS = 0.97


@dataclass(frozen=True)
class TargetFingerprint:
    """A target model's identity, as a drafter records it.

    probe: (PROBE_ROWS, <= PROBE_DIMS) embedding values of rows spread over V.
    """

    model_type: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    tokenizer: str
    probe: tuple[tuple[float, ...], ...]

    def describe(self) -> str:
        return (
            f"{self.model_type} (D={self.hidden_size}, V={self.vocab_size}, "
            f"{self.num_layers} layers, tokenizer {self.tokenizer[:12]})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "probe": [list(row) for row in self.probe]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetFingerprint:
        return cls(
            model_type=str(data["model_type"]),
            hidden_size=int(data["hidden_size"]),
            vocab_size=int(data["vocab_size"]),
            num_layers=int(data["num_layers"]),
            tokenizer=str(data["tokenizer"]),
            probe=tuple(tuple(float(v) for v in row) for row in data["probe"]),
        )


def tokenizer_digest(tokenizer: Any) -> str:
    """SHA-256 of the tokenizer's vocabulary (token -> id, sorted by id)."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    vocab = inner.get_vocab() if hasattr(inner, "get_vocab") else {}
    pairs = sorted(((int(i), str(t)) for t, i in vocab.items()))
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()


def _probe_ids(vocab_size: int) -> list[int]:
    return [(i * vocab_size) // PROBE_ROWS + 1 for i in range(PROBE_ROWS)]


def target_fingerprint(model: nn.Module, tokenizer: Any) -> TargetFingerprint:
    """The fingerprint of an mlx-lm model and its tokenizer."""
    hidden_size, vocab_size = target_dimensions(model)
    embed = model.model.embed_tokens  # checked by target_dimensions
    ids = mx.array([min(i, vocab_size - 1) for i in _probe_ids(vocab_size)])
    rows = embed(ids).astype(mx.float32)[:, :PROBE_DIMS]  # (PROBE_ROWS, <= PROBE_DIMS)
    values = np.array(rows).round(5)
    # The whole model's depth: a pipeline stage's `layers` are only its own.
    args = getattr(model, "args", None)
    layers = getattr(model, "layers", None) or getattr(model.model, "layers", [])
    depth = int(getattr(args, "num_hidden_layers", None) or len(layers))
    return TargetFingerprint(
        model_type=str(getattr(getattr(model, "args", None), "model_type", type(model).__module__)),
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        num_layers=depth,
        tokenizer=tokenizer_digest(tokenizer),
        probe=tuple(tuple(float(v) for v in row) for row in values),
    )


def similarity(a: TargetFingerprint, b: TargetFingerprint) -> float:
    """Cosine similarity of the two probes (0 when their shapes differ)."""
    x, y = np.array(a.probe, dtype=np.float64), np.array(b.probe, dtype=np.float64)
    if x.shape != y.shape or x.size == 0:
        return 0.0
    return float((x * y).sum() / max(np.linalg.norm(x) * np.linalg.norm(y), 1e-12))


def mismatch(made_for: TargetFingerprint, model: TargetFingerprint) -> str | None:
    """Why a drafter made for `made_for` does not fit `model` (None: it fits)."""
    for field in ("model_type", "hidden_size", "vocab_size", "num_layers"):
        if getattr(made_for, field) != getattr(model, field):
            return f"{field} {getattr(made_for, field)} against {getattr(model, field)}"
    if made_for.tokenizer != model.tokenizer:
        return "the tokenizers' vocabularies differ"
    score = similarity(made_for, model)
    if score < SAME_WEIGHTS:
        return f"the embedding weights differ (cosine similarity {score:.3f})"
    return None


def read_fingerprint(folder: str | os.PathLike[str]) -> TargetFingerprint | None:
    """The drafter folder's `target.json`, if it has one (a malformed one is a ValueError)."""
    path = Path(folder) / TARGET_FILE
    if not path.is_file():
        return None
    try:
        return TargetFingerprint.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"{path} is not a valid target fingerprint ({error}): delete it, or write it "
            "again with `mlx-redrafter make-drafter` on the drafter's model"
        ) from None


def write_fingerprint(folder: str | os.PathLike[str], fingerprint: TargetFingerprint) -> Path:
    path = Path(folder) / TARGET_FILE
    write_json(path, fingerprint.to_dict())
    return path

"""The recurrent drafter: a small head on the target's last hidden state.

Shapes: B batch, W beam width, L beam length, D target hidden size,
E exit dimension, V target vocabulary, Vd draft vocabulary (Vd = V unless a
reduced draft vocabulary is used).

The recurrence over drafted tokens (`recurrent_step`) and the head
(`draft_logits`) are defined once here; training (`teacher_forced_logits`) and
beam search (`mlx_redrafter.beam_search`) both call them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .files import match_umask
from .metrics import AcceptanceTable
from .ngrams import NGRAMS_FILE, NgramTable, NgramTableError, load_ngram_table, save_ngram_table

MODEL_TYPE = "recurrent_drafting_drafter"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ACCEPTANCE_FILE = "acceptance.json"  # measured acceptance per depth (`metrics.AcceptanceTable`)
SAMPLED_ACCEPTANCE_FILE = "acceptance-sampled.json"  # the same, measured sampling
DRAFT_VOCAB_KEY = "draft_vocab_ids"


def acceptance_file(temperature: float) -> str:
    """Where a drafter keeps the acceptance table measured at `temperature`."""
    return SAMPLED_ACCEPTANCE_FILE if temperature > 0 else ACCEPTANCE_FILE


class DrafterError(ValueError):
    """A drafter folder or configuration is invalid."""


@dataclass(frozen=True)
class DrafterConfig:
    """Architecture of a drafter (the reference's config fields, plus a draft vocabulary).

    vocab_size: the target's vocabulary size V.
    hidden_size: the target's hidden size D.
    exit_dim: width E of the residual blocks; 2*D means no input projection.
    num_draft_layers: number of residual blocks.
    rnn: the recurrence is SiLU(U s + W e(x) + b) when on, a running sum when off.
    draft_vocab_size: Vd when the drafter predicts only a subset of target ids.
    """

    vocab_size: int
    hidden_size: int
    exit_dim: int
    num_draft_layers: int = 2
    rnn: bool = True
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "exit_dim"):
            if getattr(self, name) < 1:
                raise DrafterError(
                    f"drafter config: {name} must be >= 1, got {getattr(self, name)}"
                )
        if self.num_draft_layers < 0:
            raise DrafterError(
                f"drafter config: num_draft_layers must be >= 0, got {self.num_draft_layers}"
            )
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise DrafterError(
                f"drafter config: draft_vocab_size must be in [1, vocab_size={self.vocab_size}], "
                f"got {self.draft_vocab_size}"
            )

    @property
    def output_size(self) -> int:
        """Vd: the number of tokens the drafter scores."""
        return self.draft_vocab_size or self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        config: dict[str, Any] = {"model_type": MODEL_TYPE, **asdict(self)}
        if self.draft_vocab_size is None:
            del config["draft_vocab_size"]
        return config

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> DrafterConfig:
        model_type = config.get("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise DrafterError(
                f"not a drafter config: model_type is {model_type!r}, expected {MODEL_TYPE!r}"
            )
        missing = [k for k in ("vocab_size", "hidden_size") if k not in config]
        if missing:
            raise DrafterError(f"drafter config is missing {', '.join(missing)}")
        hidden_size = int(config["hidden_size"])
        exit_dim = config.get("exit_dim")
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            exit_dim=int(exit_dim) if exit_dim is not None else 2 * hidden_size,
            num_draft_layers=int(config.get("num_draft_layers", 2)),
            rnn=bool(config.get("rnn", True)),
            draft_vocab_size=(
                int(config["draft_vocab_size"]) if config.get("draft_vocab_size") else None
            ),
        )


@dataclass(frozen=True)
class Quantization:
    """How a drafter's Linear layers are quantized."""

    group_size: int
    bits: int


class ResidualBlock(nn.Module):
    """z + SiLU(Linear(z)), the reference's `lm_head.{i}` block."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def __call__(self, z: mx.array) -> mx.array:
        return z + nn.silu(self.linear(z))


class Drafter(nn.Module):
    """ReDrafter's draft head.

    Parameter names follow the reference checkpoint format (`rnn_u`, `rnn_w`,
    `input_proj`, `lm_head.{i}.linear`, `lm_head.{n}`), all stored out x in.
    `ngrams` is the n-gram table of the target's replies that may ship beside the
    weights (`ngrams.py`): fixed data, read by lookup branches, never trained.
    """

    def __init__(
        self,
        config: DrafterConfig,
        draft_vocab_ids: Sequence[int] | None = None,
        ngrams: NgramTable | None = None,
    ):
        super().__init__()
        self.config = config
        self.quantization: Quantization | None = None
        self.ngrams = ngrams
        self.acceptance: AcceptanceTable | None = None  # measured greedily
        self.sampled_acceptance: AcceptanceTable | None = None  # measured sampling
        d, e = config.hidden_size, config.exit_dim
        if config.rnn:
            self.rnn_u = nn.Linear(d, d, bias=True)
            self.rnn_w = nn.Linear(d, d, bias=False)
        if e != 2 * d:
            self.input_proj = nn.Linear(2 * d, e)
        self.lm_head: list[nn.Module] = [ResidualBlock(e) for _ in range(config.num_draft_layers)]
        self.lm_head.append(nn.Linear(e, config.output_size, bias=False))
        if config.draft_vocab_size is not None:
            ids = (
                list(range(config.draft_vocab_size)) if draft_vocab_ids is None else draft_vocab_ids
            )
            self.draft_vocab_ids = mx.array(list(ids), dtype=mx.int32)  # (Vd,)
            self._check_draft_vocab()
            self.freeze(keys=[DRAFT_VOCAB_KEY], recurse=False)
        elif draft_vocab_ids is not None:
            raise DrafterError("draft_vocab_ids given but config.draft_vocab_size is None")

    # -- the recurrence and the head: the only definitions of the drafter's math --

    def recurrent_step(self, state: mx.array, token_embedding: mx.array) -> mx.array:
        """Advance the recurrence by one drafted token.

        state: (..., D) s_{t-1};  token_embedding: (..., D) e(x_t)  ->  (..., D) s_t
        """
        if self.config.rnn:
            return nn.silu(self.rnn_u(state) + self.rnn_w(token_embedding))
        return state + token_embedding

    def draft_logits(self, hidden: mx.array, state: mx.array) -> mx.array:
        """Score the next token from the target's hidden state and the recurrence state.

        hidden: (..., D), state: (..., D)  ->  logits (..., Vd) over the draft vocabulary
        """
        z = mx.concatenate([hidden, state], axis=-1)  # (..., 2D)
        if "input_proj" in self:
            z = self.input_proj(z)  # (..., E)
        for block in self.lm_head:
            z = block(z)
        return z

    def teacher_forced_logits(self, hidden: mx.array, token_embeddings: mx.array) -> mx.array:
        """Unroll the recurrence over known tokens (training).

        hidden: (B, T, D) target hidden state at each position t.
        token_embeddings: (B, T, K, D) e(x_{t+1}), ..., e(x_{t+K}) for each t.
        Returns logits (B, T, K, Vd): step k predicts x_{t+k+2} from h_t and x_{t+1..t+k+1}.
        """
        state = mx.zeros_like(hidden)  # (B, T, D) s_0
        logits = []
        for k in range(token_embeddings.shape[2]):
            state = self.recurrent_step(state, token_embeddings[:, :, k])  # (B, T, D)
            logits.append(self.draft_logits(hidden, state))  # (B, T, Vd)
        return mx.stack(logits, axis=2)  # (B, T, K, Vd)

    def to_target_ids(self, draft_ids: mx.array) -> mx.array:
        """Map draft-vocabulary indices (any shape) to target token ids."""
        if self.config.draft_vocab_size is None:
            return draft_ids
        return self.draft_vocab_ids[draft_ids]

    # -- construction, checks, persistence --

    @classmethod
    def create(
        cls,
        model: nn.Module,
        num_draft_layers: int = 2,
        rnn: bool = True,
        exit_dim: int | None = None,
        draft_vocab_size: int | None = None,
        draft_vocab_ids: Sequence[int] | None = None,
    ) -> Drafter:
        """An untrained drafter sized for `model` (an mlx-lm model).

        Without `draft_vocab_ids`, a reduced vocabulary is the first
        `draft_vocab_size` ids (training picks them by frequency instead).
        """
        hidden_size, vocab_size = target_dimensions(model)
        if draft_vocab_ids is not None:
            if draft_vocab_size is not None and draft_vocab_size != len(draft_vocab_ids):
                raise DrafterError(
                    f"draft_vocab_size={draft_vocab_size} but {len(draft_vocab_ids)} "
                    "draft_vocab_ids were given"
                )
            draft_vocab_size = len(draft_vocab_ids)
        config = DrafterConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            exit_dim=exit_dim if exit_dim is not None else 2 * hidden_size,
            num_draft_layers=num_draft_layers,
            rnn=rnn,
            draft_vocab_size=draft_vocab_size,
        )
        return cls(config, draft_vocab_ids)

    def check_fits(self, model: nn.Module) -> None:
        """Raise ValueError unless this drafter was made for `model`'s sizes."""
        hidden_size, vocab_size = target_dimensions(model)
        if self.config.hidden_size != hidden_size:
            raise ValueError(
                f"drafter hidden_size {self.config.hidden_size} does not match the model's "
                f"hidden size {hidden_size}: use a drafter trained for this model "
                "(or make one with Drafter.create(model))"
            )
        if self.config.vocab_size != vocab_size:
            raise ValueError(
                f"drafter vocab_size {self.config.vocab_size} does not match the model's "
                f"vocabulary of {vocab_size} tokens: use a drafter trained for this model"
            )

    def _check_draft_vocab(self) -> None:
        ids = self.draft_vocab_ids
        if ids.ndim != 1 or ids.shape[0] != self.config.draft_vocab_size:
            raise DrafterError(
                f"draft_vocab_ids must have shape ({self.config.draft_vocab_size},), "
                f"got {tuple(ids.shape)}"
            )
        if bool(mx.any((ids < 0) | (ids >= self.config.vocab_size)).item()):
            raise DrafterError(
                f"draft_vocab_ids must be target token ids in [0, {self.config.vocab_size})"
            )
        if len(set(cast(list[int], ids.tolist()))) != ids.shape[0]:
            raise DrafterError("draft_vocab_ids must not repeat a token id")

    def save(self, path: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """Write `config.json` + `model.safetensors` (+ `ngrams.safetensors` when the
        drafter has a table) into folder `path`, atomically."""
        target = Path(path)
        if target.exists() and not overwrite:
            raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
        config = self.config.to_dict()
        if self.quantization is not None:
            config["quantization"] = asdict(self.quantization)
        greedy, sampled = self.acceptance, self.sampled_acceptance
        if (greedy is not None and greedy.temperature > 0) or (
            sampled is not None and sampled.temperature == 0
        ):
            raise ValueError("drafter.acceptance must be measured greedily, sampled_acceptance not")
        weights = dict(tree_flatten(self.parameters()))
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            match_umask(staging)
            mx.save_safetensors(str(staging / WEIGHTS_FILE), weights, {"format": "mlx"})
            (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
            if self.ngrams is not None:
                save_ngram_table(self.ngrams, staging)
            for table in (self.acceptance, self.sampled_acceptance):
                if table is not None:
                    text = json.dumps(table.to_dict(), indent=1) + "\n"
                    (staging / acceptance_file(table.temperature)).write_text(text)
            if target.exists():
                backup = target.with_name(f".{target.name}.old")
                shutil.rmtree(backup, ignore_errors=True)
                target.rename(backup)
                staging.rename(target)
                shutil.rmtree(backup, ignore_errors=True)
            else:
                staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Drafter:
        """Read a drafter folder written by `save` (or by the reference's trainer)."""
        folder = Path(path)
        config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
        if not config_path.is_file():
            raise DrafterError(f"no drafter at {folder}: {CONFIG_FILE} is missing")
        if not weights_path.is_file():
            raise DrafterError(f"no drafter weights at {folder}: {WEIGHTS_FILE} is missing")
        try:
            raw_config = json.loads(config_path.read_text())
        except json.JSONDecodeError as error:
            raise DrafterError(f"{config_path} is not valid JSON: {error}") from None
        config = DrafterConfig.from_dict(raw_config)
        try:
            loaded = mx.load(str(weights_path))
        except Exception as error:  # MLX raises RuntimeError/ValueError for corrupt files
            raise DrafterError(f"cannot read {weights_path}: {error}") from None
        if not isinstance(loaded, dict):
            raise DrafterError(f"{weights_path} does not hold named tensors")
        weights = cast(dict[str, mx.array], loaded)
        ids = weights.pop(DRAFT_VOCAB_KEY, None)
        if config.draft_vocab_size is not None and ids is None:
            raise DrafterError(
                f"{weights_path} has no {DRAFT_VOCAB_KEY} but the config "
                f"declares draft_vocab_size={config.draft_vocab_size}"
            )
        ngrams = None
        if (folder / NGRAMS_FILE).is_file():
            try:
                ngrams = load_ngram_table(folder / NGRAMS_FILE, config.vocab_size)
            except NgramTableError as error:
                raise DrafterError(str(error)) from None
        drafter = cls(config, cast(list[int], ids.tolist()) if ids is not None else None, ngrams)
        drafter.acceptance, drafter.sampled_acceptance = read_acceptance_tables(folder)
        quantization = raw_config.get("quantization")
        if quantization:
            drafter.quantize(group_size=quantization["group_size"], bits=quantization["bits"])
        parameters = cast(list[tuple[str, mx.array]], tree_flatten(drafter.parameters()))
        expected = {name: tuple(value.shape) for name, value in parameters}
        expected.pop(DRAFT_VOCAB_KEY, None)
        missing = sorted(set(expected) - set(weights))
        unexpected = sorted(set(weights) - set(expected))
        if missing or unexpected:
            raise DrafterError(
                f"{weights_path} does not match its config: missing {missing or 'nothing'}, "
                f"unexpected {unexpected or 'nothing'}"
            )
        for name, shape in expected.items():
            if tuple(weights[name].shape) != tuple(shape):
                raise DrafterError(
                    f"{weights_path}: {name} has shape {tuple(weights[name].shape)}, "
                    f"the config implies {tuple(shape)}"
                )
        drafter.load_weights(list(weights.items()), strict=False)
        if mx.default_device() == mx.cpu and quantization is None:
            drafter.set_dtype(mx.float32)  # half-precision matmuls are slow on the CPU backend
        mx.eval(drafter.parameters())
        return drafter

    def quantize(self, group_size: int = 64, bits: int = 4) -> None:
        """Quantize the drafter's Linear layers in place (those whose width allows it)."""
        nn.quantize(
            self,
            group_size=group_size,
            bits=bits,
            class_predicate=lambda _, m: (
                isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0
            ),
        )
        self.quantization = Quantization(group_size=group_size, bits=bits)


def target_dimensions(model: nn.Module) -> tuple[int, int]:
    """(hidden size D, vocabulary size V) of an mlx-lm model, read off its embedding."""
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if embed is None:
        raise ValueError(
            f"{type(model).__module__} has no model.embed_tokens: not an mlx-lm "
            "decoder-only language model that mlx-redrafter supports"
        )
    args = getattr(model, "args", None)
    hidden_size = getattr(args, "hidden_size", None)
    vocab_size = getattr(args, "vocab_size", None)
    if hidden_size is None or vocab_size is None:
        # (V, D) for float embeddings; quantized ones pack D, so ask the module.
        vocab_size = embed.weight.shape[0]
        hidden_size = embed(mx.array([0])).shape[-1]
    return int(hidden_size), int(vocab_size)


def read_acceptance_tables(
    folder: Path,
) -> tuple[AcceptanceTable | None, AcceptanceTable | None]:
    """The drafter's measured acceptance tables (greedy, sampled), each None where it
    has none. Each table is taken by the temperature it records, whichever file holds
    it (a folder whose only table was measured sampling, as `acceptance.json`,
    still loads); where both files say the same, the file named for it wins."""
    found = [read_acceptance(folder, name) for name in (ACCEPTANCE_FILE, SAMPLED_ACCEPTANCE_FILE)]
    greedy = [t for t in found if t is not None and t.temperature == 0]
    sampled = [t for t in reversed(found) if t is not None and t.temperature > 0]
    return (greedy[0] if greedy else None), (sampled[0] if sampled else None)


def read_acceptance(folder: Path, name: str = ACCEPTANCE_FILE) -> AcceptanceTable | None:
    """One measured acceptance table of the drafter (`name`), if it has it."""
    path = folder / name
    if not path.is_file():
        return None
    try:
        return AcceptanceTable.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, ValueError, AttributeError) as error:
        raise DrafterError(
            f"{path} is not a valid acceptance table ({error}): delete it or measure it "
            "again with `mlx-redrafter measure-acceptance`"
        ) from None

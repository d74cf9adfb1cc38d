"""Drafter checkpoint layouts: this project's folder, the reference's, TensorRT-LLM's.

All three store the same Linear layers out x in (docs/convert.md has the tables):

* **reference** (Apple's ``recurrent_drafting``): ``config.json`` with
  ``model_type: recurrent_drafting_drafter``, ``vocab_size`` (V), ``hidden_size``
  (D), ``exit_dim`` (E), ``num_draft_layers`` (n), ``rnn``; ``model.safetensors``
  with ``input_proj.{weight,bias}`` (only when E != 2D), ``lm_head.{i}.linear.
  {weight,bias}`` for i < n, ``lm_head.{n}.weight`` (V, E), ``rnn_u.{weight,bias}``,
  ``rnn_w.weight``.
* **mlx-redrafter**: the reference layout plus an optional reduced draft vocabulary
  (``draft_vocab_size`` Vd in the config, ``draft_vocab_ids`` (Vd,) beside the
  weights, a (Vd, E) head), an n-gram table and an acceptance table.
* **tensorrt-llm**: the drafter tensors of a TensorRT-LLM ReDrafter checkpoint:
  ``drafter.input_proj``, ``drafter.layers.{i}.linear``, ``drafter.lm_head``,
  ``drafter.rnn_u``, ``drafter.rnn_w`` in ``rank{r}.safetensors``, every tensor
  split along its first axis over the tensor-parallel ranks, and ``redrafter_*``
  keys in ``config.json``.

The reference and TensorRT-LLM heads score the full vocabulary with no bias. A
reduced vocabulary is expanded exactly (`expand_vocabulary`): the exit width grows
by one **constant feature** (input_proj bias 1, blocks pass it through unchanged:
zero weights in and out, gate bias -1024 so SiLU gives exactly 0) plus zero padding,
the Vd draft rows keep their weights (0 on the new features), and every other row
is NEVER_LOGIT times the constant feature, so its logit is -30000: below every draft
token's logit, so such a token never enters a beam, and exp(-30000 - max) is 0, so
the log-softmax of the draft tokens is unchanged. `reduce_vocabulary` undoes it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .errors import ConversionError

FORMATS = ("mlx-redrafter", "reference", "tensorrt-llm")
MODEL_TYPE = "recurrent_drafting_drafter"
TRT_ARCHITECTURE = "ReDrafterForCausalLM"
EXPORT_KEY = "mlx_redrafter_export"  # config.json record of an expanded vocabulary
SIDE_FOLDER = "mlx_redrafter"  # ngrams, acceptance, draft vocabulary order beside an export
SIDE_FILES = ("ngrams.safetensors", "acceptance.json")
VOCAB_ORDER_FILE = "draft_vocab_ids.json"
NEVER_LOGIT = -30000.0  # logit of a token outside the draft vocabulary (fits float16)
GATE_BIAS = -1024.0  # SiLU(-1024) is exactly 0 in float16/bfloat16/float32
CONFIG_KEYS = ("vocab_size", "hidden_size", "exit_dim", "num_draft_layers", "rnn")
_PREFIXES = ("drafter.", "model.drafter.")


@dataclass(frozen=True)
class Checkpoint:
    """A drafter in the reference naming (float weights, out x in).

    config: model_type plus CONFIG_KEYS (and draft_vocab_size for a reduced head).
    weights: reference names -> arrays; a reduced head adds `draft_vocab_ids` (Vd,).
    side: the folder holding ngrams.safetensors / acceptance.json, if any.
    export: the EXPORT_KEY record of a folder this converter expanded, if any.
    """

    config: dict[str, Any]
    weights: dict[str, mx.array]
    side: Path | None = None
    export: dict[str, Any] | None = None

    @property
    def num_layers(self) -> int:
        return int(self.config["num_draft_layers"])


# -- reading ------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ConversionError(f"{path} does not hold a JSON object")
    return config


def _load_tensors(path: Path) -> dict[str, mx.array]:
    try:
        loaded = mx.load(str(path))
    except Exception as exc:
        raise ConversionError(f"cannot read {path} (corrupt?): {exc}") from exc
    if not isinstance(loaded, dict):
        raise ConversionError(f"{path} does not hold named tensors")
    return loaded


def read_checkpoint(folder: Path) -> Checkpoint:
    """Read a drafter folder in any of FORMATS (detected from config.json)."""
    path = folder / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder} has no config.json; not a drafter folder")
    config = _read_json(path)
    if config.get("architecture") == TRT_ARCHITECTURE or "redrafter_exit_dim" in config:
        checkpoint = _read_tensorrt(folder, config)
    else:
        checkpoint = _read_reference(folder, config)
    side = folder / SIDE_FOLDER if (folder / SIDE_FOLDER).is_dir() else folder
    found = any((side / name).is_file() for name in (*SIDE_FILES, VOCAB_ORDER_FILE))
    return replace(checkpoint, side=side if found else None)


def _read_reference(folder: Path, config: dict[str, Any]) -> Checkpoint:
    model_type = config.get("model_type")
    if model_type != MODEL_TYPE:
        raise ConversionError(
            f"{folder / 'config.json'} has model_type {model_type!r}, expected {MODEL_TYPE!r}"
        )
    if (folder / "model.safetensors").is_file():
        weights = _load_tensors(folder / "model.safetensors")
    elif (folder / "pytorch_model.bin").is_file():
        weights = _read_torch_pickle(folder / "pytorch_model.bin")
    else:
        raise ConversionError(f"{folder} has no model.safetensors or pytorch_model.bin")
    for prefix in _PREFIXES:
        if weights and all(name.startswith(prefix) for name in weights):
            weights = {name[len(prefix) :]: value for name, value in weights.items()}
    keys = (*CONFIG_KEYS, "draft_vocab_size")
    clean = {"model_type": MODEL_TYPE, **{k: config[k] for k in keys if config.get(k) is not None}}
    export = config.get(EXPORT_KEY) if isinstance(config.get(EXPORT_KEY), dict) else None
    return Checkpoint(clean, weights, export=export)


def _read_torch_pickle(path: Path) -> dict[str, mx.array]:
    try:
        import torch
    except ImportError as exc:
        raise ConversionError(
            f"{path} is a PyTorch pickle and reading it needs torch (pip install torch), "
            "or re-save the drafter as safetensors"
        ) from exc
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConversionError(f"cannot read {path} (corrupt?): {exc}") from exc
    out = {}
    for name, tensor in state.items():
        if tensor.dtype == torch.bfloat16:
            out[name] = mx.array(tensor.float().numpy()).astype(mx.bfloat16)
        else:
            out[name] = mx.array(tensor.numpy())
    return out


def _read_tensorrt(folder: Path, config: dict[str, Any]) -> Checkpoint:
    """The drafter tensors of a TensorRT-LLM checkpoint, ranks joined along axis 0."""
    keys = ("vocab_size", "redrafter_num_layers", "redrafter_hidden_size", "redrafter_exit_dim")
    missing = [key for key in (*keys, "redrafter_is_rnn") if key not in config]
    if missing:
        raise ConversionError(f"{folder / 'config.json'} lacks {', '.join(missing)}")
    try:
        vocab_size, layers, hidden_size, exit_dim = (int(config[key]) for key in keys)
        tp = int(config.get("mapping", {}).get("tp_size", 1))
    except (TypeError, ValueError, AttributeError) as exc:
        raise ConversionError(
            f"{folder / 'config.json'}: a size is not an integer ({exc})"
        ) from exc
    ranks = []
    for rank in range(tp):
        path = folder / f"rank{rank}.safetensors"
        if not path.is_file():
            raise ConversionError(f"{folder} has tp_size {tp} but no {path.name}")
        tensors = _load_tensors(path)
        prefix = "drafter."
        ranks.append({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})
    if not ranks[0] or any(set(r) != set(ranks[0]) for r in ranks):
        raise ConversionError(f"{folder}: the rank files do not hold the same drafter.* tensors")
    weights = {}
    for name in ranks[0]:
        try:
            joined = mx.concatenate([r[name] for r in ranks], axis=0)  # split along axis 0
        except ValueError as exc:
            raise ConversionError(f"{folder}: drafter.{name} does not join across ranks") from exc
        if name == "lm_head.weight":
            weights[f"lm_head.{layers}.weight"] = joined[:vocab_size]  # drop TP vocab padding
        elif name.startswith("layers."):
            weights["lm_head." + name[len("layers.") :]] = joined
        else:
            weights[name] = joined
    ours = {
        "model_type": MODEL_TYPE,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "exit_dim": exit_dim,
        "num_draft_layers": layers,
        "rnn": bool(config["redrafter_is_rnn"]),
    }
    export = config.get(EXPORT_KEY) if isinstance(config.get(EXPORT_KEY), dict) else None
    return Checkpoint(ours, weights, export=export)


# -- the constant feature ------------------------------------------------------------


def _padded_width(exit_dim: int, hidden_size: int, multiple: int) -> int:
    """E + 1 rounded up to `multiple`, never 2D (that would mean 'no input_proj')."""
    width = -(-(exit_dim + 1) // multiple) * multiple
    return width + multiple if width == 2 * hidden_size else width


def expand_vocabulary(checkpoint: Checkpoint, multiple: int = 8) -> Checkpoint:
    """A full-vocabulary head for a reduced-vocabulary checkpoint (see module doc).

    multiple: the new exit width E' is a multiple of it (tensor-parallel splits).
    """
    config, weights = checkpoint.config, dict(checkpoint.weights)
    if "draft_vocab_size" not in config:
        return checkpoint
    d, e, n = int(config["hidden_size"]), int(config["exit_dim"]), checkpoint.num_layers
    width = _padded_width(e, d, multiple)
    dtype = weights[f"lm_head.{n}.weight"].dtype
    ids = np.asarray(weights.pop("draft_vocab_ids").tolist(), dtype=np.int64)
    if "input_proj.weight" in weights:
        proj_w, proj_b = weights["input_proj.weight"], weights["input_proj.bias"]
    else:  # E == 2D: an identity projection, exact in floating point
        proj_w, proj_b = mx.eye(e, dtype=dtype), mx.zeros((e,), dtype=dtype)
    extra_bias = mx.zeros((width - e,), dtype=dtype).at[0].add(1.0)  # the constant feature
    weights["input_proj.weight"] = _grow(proj_w, rows=width)
    weights["input_proj.bias"] = mx.concatenate([proj_b, extra_bias])
    gate = mx.zeros((width - e,), dtype=dtype).at[0].add(GATE_BIAS)
    for i in range(n):
        block = f"lm_head.{i}.linear"
        weights[f"{block}.weight"] = _grow(weights[f"{block}.weight"], width, width)
        weights[f"{block}.bias"] = mx.concatenate([weights[f"{block}.bias"], gate])
    head = np.zeros((int(config["vocab_size"]), width), dtype=np.float32)  # (V, E')
    head[:, e] = NEVER_LOGIT
    head[ids, e] = 0.0
    head[ids, :e] = np.array(weights[f"lm_head.{n}.weight"].astype(mx.float32))  # (Vd, E)
    weights[f"lm_head.{n}.weight"] = mx.array(head).astype(dtype)
    full = {k: v for k, v in config.items() if k != "draft_vocab_size"} | {"exit_dim": width}
    export = {
        "version": 1,
        "exit_dim": e,
        "draft_vocab_size": len(ids),
        "identity_input_proj": "input_proj.weight" not in checkpoint.weights,
        "never_logit": NEVER_LOGIT,
    }
    order = ids.tolist()
    return Checkpoint(full, weights, checkpoint.side, export | {"order": order})


def _grow(matrix: mx.array, rows: int, cols: int | None = None) -> mx.array:
    """`matrix` (r, c) zero-padded to (rows, cols or c)."""
    r, c = matrix.shape
    return mx.pad(matrix, [(0, rows - r), (0, (cols or c) - c)])


def reduce_vocabulary(checkpoint: Checkpoint) -> Checkpoint:
    """Undo `expand_vocabulary`; raise ConversionError (saying what differs) when the
    folder is not exactly what it wrote, e.g. after fine-tuning elsewhere."""
    export, config, weights = checkpoint.export or {}, checkpoint.config, checkpoint.weights
    e, n = int(export["exit_dim"]), checkpoint.num_layers
    head = np.array(weights[f"lm_head.{n}.weight"].astype(mx.float32))  # (V, E')
    draft = np.flatnonzero(head[:, e] == 0)
    never = np.flatnonzero(head[:, e] != 0)

    def check(ok: bool, what: str) -> None:
        if not ok:
            raise ConversionError(f"{what}: the folder changed after export")

    check(len(draft) == int(export["draft_vocab_size"]), "draft row count")
    check(not head[never][:, :e].any() and not head[draft][:, e:].any(), "head rows")
    check(bool(np.all(head[never, e] == head[never[0], e])) if len(never) else True, "never rows")
    proj_w = np.array(weights["input_proj.weight"].astype(mx.float32))
    proj_b = np.array(weights["input_proj.bias"].astype(mx.float32))
    check(not proj_w[e:].any() and proj_b[e] != 0 and not proj_b[e + 1 :].any(), "input_proj")
    out = {k: v for k, v in weights.items() if not k.startswith(("input_proj", "lm_head"))}
    for i in range(n):
        w = np.array(weights[f"lm_head.{i}.linear.weight"].astype(mx.float32))
        b = np.array(weights[f"lm_head.{i}.linear.bias"].astype(mx.float32))
        check(not w[e:].any() and not w[:, e:].any() and b[e] <= GATE_BIAS / 2, f"block {i}")
        check(not b[e + 1 :].any(), f"block {i} padding")
        out[f"lm_head.{i}.linear.weight"] = weights[f"lm_head.{i}.linear.weight"][:e, :e]
        out[f"lm_head.{i}.linear.bias"] = weights[f"lm_head.{i}.linear.bias"][:e]
    if export.get("identity_input_proj"):
        check(np.array_equal(proj_w[:e], np.eye(e)) and not proj_b[:e].any(), "identity input_proj")
    else:
        out["input_proj.weight"] = weights["input_proj.weight"][:e]
        out["input_proj.bias"] = weights["input_proj.bias"][:e]
    order = _vocab_order(checkpoint.side, draft)
    out[f"lm_head.{n}.weight"] = weights[f"lm_head.{n}.weight"][mx.array(order)][:, :e]
    out["draft_vocab_ids"] = mx.array(order, dtype=mx.int32)
    reduced = config | {"exit_dim": e, "draft_vocab_size": len(order)}
    return Checkpoint(reduced, out, checkpoint.side, None)


def _vocab_order(side: Path | None, draft: np.ndarray) -> list[int]:
    """The draft vocabulary's original order (from the side folder), else ascending ids."""
    path = side / VOCAB_ORDER_FILE if side is not None else None
    if path is not None and path.is_file():
        order = json.loads(path.read_text())
        if isinstance(order, list) and sorted(order) == draft.tolist():
            return [int(i) for i in order]
    return draft.tolist()


# -- writing --------------------------------------------------------------------------


def write_reference(checkpoint: Checkpoint, folder: Path) -> None:
    """config.json + model.safetensors (+ SIDE_FOLDER) into the new folder `folder`."""
    folder.mkdir()
    config = dict(checkpoint.config)
    if checkpoint.export:
        config[EXPORT_KEY] = {k: v for k, v in checkpoint.export.items() if k != "order"}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(str(folder / "model.safetensors"), checkpoint.weights, {"format": "pt"})
    _write_side(checkpoint, folder)


def _write_side(checkpoint: Checkpoint, folder: Path) -> None:
    side = folder / SIDE_FOLDER
    if checkpoint.export and checkpoint.export.get("order"):
        side.mkdir(exist_ok=True)
        (side / VOCAB_ORDER_FILE).write_text(json.dumps(checkpoint.export["order"]) + "\n")
    for name in SIDE_FILES:
        if checkpoint.side is not None and (checkpoint.side / name).is_file():
            side.mkdir(exist_ok=True)
            shutil.copyfile(checkpoint.side / name, side / name)


def tensorrt_tensors(checkpoint: Checkpoint, tp_size: int) -> list[dict[str, mx.array]]:
    """The `drafter.*` tensors of each tensor-parallel rank (split along axis 0)."""
    n = checkpoint.num_layers
    named = {}
    for name, value in checkpoint.weights.items():
        if name == f"lm_head.{n}.weight":
            named["drafter.lm_head.weight"] = value
        elif name.startswith("lm_head."):
            named["drafter.layers." + name[len("lm_head.") :]] = value
        else:
            named["drafter." + name] = value
    for name, value in named.items():
        if value.shape[0] % tp_size:
            raise ConversionError(
                f"{name} has {value.shape[0]} rows, not divisible by --tp-size {tp_size}"
            )
    return [
        {name: mx.split(value, tp_size, axis=0)[rank] for name, value in named.items()}
        for rank in range(tp_size)
    ]


def write_tensorrt(
    checkpoint: Checkpoint, folder: Path, tp_size: int, beams: tuple[int, int]
) -> None:
    """config.json (redrafter_* keys) + rank{r}.safetensors (+ SIDE_FOLDER)."""
    folder.mkdir()
    config = checkpoint.config
    dtype = str(next(iter(checkpoint.weights.values())).dtype).removeprefix("mlx.core.")
    record: dict[str, Any] = {
        "architecture": TRT_ARCHITECTURE,
        "dtype": dtype,
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "redrafter_num_layers": config["num_draft_layers"],
        "redrafter_hidden_size": config["hidden_size"],
        "redrafter_exit_dim": config["exit_dim"],
        "redrafter_is_rnn": config["rnn"],
        "redrafter_num_beams": beams[0],
        "redrafter_draft_len_per_beam": beams[1] - 1,
        "redrafter_greedy_search": True,
        "mapping": {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1},
    }
    if checkpoint.export:
        record[EXPORT_KEY] = {k: v for k, v in checkpoint.export.items() if k != "order"}
    for rank, tensors in enumerate(tensorrt_tensors(checkpoint, tp_size)):
        mx.save_safetensors(str(folder / f"rank{rank}.safetensors"), tensors, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(record, indent=2) + "\n")
    _write_side(checkpoint, folder)

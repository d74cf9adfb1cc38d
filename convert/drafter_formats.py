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
  weights, a (Vd, E) head), an optional ``quantization`` record (MLX affine
  ``scales``/``biases`` beside the packed weights), an n-gram table and an
  acceptance table.
* **tensorrt-llm**: the drafter tensors of a TensorRT-LLM ReDrafter checkpoint:
  ``drafter.input_proj``, ``drafter.layers.{i}.linear``, ``drafter.lm_head``,
  ``drafter.rnn_u``, ``drafter.rnn_w`` in ``rank{r}.safetensors``, every tensor
  split along its first axis over the tensor-parallel ranks (the head padded to a
  multiple of them; rows past ``vocab_size`` are padding), and ``redrafter_*`` keys
  in ``config.json``.

The reference and TensorRT-LLM heads score the full vocabulary with no bias. A
reduced vocabulary is expanded exactly (`expand_vocabulary`): the exit width grows
by one **constant feature** (input_proj bias 1, blocks pass it through unchanged:
zero weights in and out, gate bias -1024 so SiLU gives exactly 0) plus zero padding,
the Vd draft rows keep their weights (0 on the new features), and every other row
(and every TensorRT-LLM padding row) is NEVER_LOGIT times the constant feature, so
its logit is -30000 (-29952 in bfloat16): below every draft token's logit, so such
a token never enters a beam, and exp(-30000 - max) is 0, so the log-softmax of the
draft tokens is unchanged. `reduce_vocabulary` undoes it, after checking that every
added weight is still exactly what `expand_vocabulary` wrote.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
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
EXPORT_VERSION = 1  # the layout of that record and of the constant feature
SIDE_FOLDER = "mlx_redrafter"  # ngrams, acceptance, draft vocabulary order beside an export
SIDE_FILES = ("ngrams.safetensors", "acceptance.json")
VOCAB_ORDER_FILE = "draft_vocab_ids.json"
NEVER_LOGIT = -30000.0  # logit of a token outside the draft vocabulary (bfloat16: -29952)
GATE_BIAS = -1024.0  # SiLU(-1024) is exactly 0 in float16/bfloat16/float32
CONFIG_KEYS = ("vocab_size", "hidden_size", "exit_dim", "num_draft_layers", "rnn")
_PREFIXES = ("drafter.", "model.drafter.")
_CHUNK = 8192  # head rows checked at a time


class ExportChanged(ConversionError):
    """An exported folder's weights are no longer exactly what the export wrote."""


@dataclass(frozen=True)
class Checkpoint:
    """A drafter in the reference naming (out x in).

    config: model_type plus CONFIG_KEYS (and draft_vocab_size for a reduced head,
        quantization for MLX-quantized weights).
    weights: reference names -> arrays; a reduced head adds `draft_vocab_ids` (Vd,).
    side: the folder holding ngrams.safetensors / acceptance.json, if any.
    export: the EXPORT_KEY record of a folder this converter expanded, if any
        (checked by `_export_record`), plus `order`: the draft vocabulary's order.
    """

    config: dict[str, Any]
    weights: dict[str, mx.array]
    side: Path | None = None
    export: dict[str, Any] | None = None

    @property
    def num_layers(self) -> int:
        return int(self.config["num_draft_layers"])


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- reading ------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{path} is not valid JSON: {exc}") from exc


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
    if not isinstance(config, dict):
        raise ConversionError(f"{path} does not hold a JSON object")
    if config.get("architecture") == TRT_ARCHITECTURE or "redrafter_exit_dim" in config:
        checkpoint = _read_tensorrt(folder, config)
    else:
        checkpoint = _read_reference(folder, config)
    side = folder / SIDE_FOLDER if (folder / SIDE_FOLDER).is_dir() else folder
    found = any((side / name).is_file() for name in (*SIDE_FILES, VOCAB_ORDER_FILE))
    export = checkpoint.export
    if export is not None and export["draft_vocab_size"] is not None:
        order = _read_order(side / VOCAB_ORDER_FILE, export, int(checkpoint.config["vocab_size"]))
        export = export | ({"order": order} if order is not None else {})
    return replace(checkpoint, side=side if found else None, export=export)


def _read_reference(folder: Path, config: dict[str, Any]) -> Checkpoint:
    path = folder / "config.json"
    model_type = config.get("model_type")
    if model_type != MODEL_TYPE:
        raise ConversionError(f"{path} has model_type {model_type!r}, expected {MODEL_TYPE!r}")
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
    if "rnn" in clean:
        clean["rnn"] = _strict_bool(clean["rnn"], f"{path}: rnn")
    if config.get("quantization") is not None:
        clean["quantization"] = _quantization(config["quantization"], path)
    export = None
    if EXPORT_KEY in config:
        try:
            vocab, hidden = int(clean["vocab_size"]), int(clean["hidden_size"])
            exit_dim = int(clean.get("exit_dim", 2 * hidden))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConversionError(
                f"{path} lacks an integer vocab_size, hidden_size or exit_dim ({exc!r}): "
                "not a drafter config"
            ) from exc
        export = _export_record(config, path, vocab, hidden, exit_dim)
    return Checkpoint(clean, weights, export=export)


def _strict_bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise ConversionError(
            f"{what} must be true or false (a JSON boolean), not {value!r}: fix config.json"
        )
    return value


def _quantization(record: object, path: Path) -> dict[str, int]:
    """The MLX quantization record {group_size, bits} of a quantized project folder."""
    ok = (
        isinstance(record, dict)
        and record.get("group_size") in (32, 64, 128)
        and record.get("bits") in (2, 3, 4, 5, 6, 8)
        and all(_is_int(record[k]) for k in ("group_size", "bits"))
    )
    if not ok:
        raise ConversionError(
            f"{path}: quantization must be {{'group_size': 32|64|128, 'bits': 2-8}}, not "
            f"{record!r}; it describes how the weights were quantized, so fix it to match "
            "them or convert the drafter's float checkpoint instead"
        )
    assert isinstance(record, dict)
    return {"group_size": int(record["group_size"]), "bits": int(record["bits"])}


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


def _tensorrt_sizes(path: Path, config: dict[str, Any]) -> tuple[int, ...]:
    """(V, n, D, E, tp) of a TensorRT-LLM config."""
    keys = ("vocab_size", "redrafter_num_layers", "redrafter_hidden_size", "redrafter_exit_dim")
    missing = [key for key in (*keys, "redrafter_is_rnn") if key not in config]
    if missing:
        raise ConversionError(f"{path} lacks {', '.join(missing)}")
    mapping = config.get("mapping", {})
    try:
        sizes = tuple(int(config[key]) for key in keys)
        tp = int(mapping.get("tp_size", 1))
    except (TypeError, ValueError, AttributeError) as exc:
        raise ConversionError(f"{path}: a size is not an integer ({exc})") from exc
    if tp < 1:
        raise ConversionError(
            f"{path}: mapping.tp_size is {tp}; it must be the number of rank*.safetensors "
            "files (1 or more): fix it in config.json"
        )
    return (*sizes, tp)


def _read_tensorrt(folder: Path, config: dict[str, Any]) -> Checkpoint:
    """The drafter tensors of a TensorRT-LLM checkpoint, ranks joined along axis 0."""
    path = folder / "config.json"
    vocab_size, layers, hidden_size, exit_dim, tp = _tensorrt_sizes(path, config)
    rnn = _strict_bool(config["redrafter_is_rnn"], f"{path}: redrafter_is_rnn")
    export = _export_record(config, path, vocab_size, hidden_size, exit_dim)
    weights = {}
    for name, joined in _join_ranks(folder, tp).items():
        if name == "lm_head.weight":
            rows = joined.shape[0]
            if rows < vocab_size:
                raise ConversionError(
                    f"{folder}: drafter.lm_head.weight has {rows} rows over the ranks, fewer "
                    f"than vocab_size {vocab_size}: the folder is incomplete; export it again"
                )
            if export is not None and rows != vocab_size + export["vocab_padding"]:
                raise ConversionError(
                    f"{folder}: drafter.lm_head.weight has {rows} rows over the ranks, not "
                    f"vocab_size {vocab_size} plus the {export['vocab_padding']} padding rows "
                    f"{EXPORT_KEY} records: the folder changed; export it again"
                )
            weights[f"lm_head.{layers}.weight"] = joined[:vocab_size]  # (V, E): no padding
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
        "rnn": rnn,
    }
    return Checkpoint(ours, weights, export=export)


def _join_ranks(folder: Path, tp: int) -> dict[str, mx.array]:
    """The `drafter.*` tensors (prefix dropped) of rank0..rank{tp-1}, joined on axis 0."""
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
    joined = {}
    for name in ranks[0]:
        try:
            joined[name] = mx.concatenate([r[name] for r in ranks], axis=0)  # (sum of rows, ...)
        except ValueError as exc:
            raise ConversionError(f"{folder}: drafter.{name} does not join across ranks") from exc
    return joined


def _export_record(
    config: dict[str, Any], path: Path, vocab_size: int, hidden_size: int, exit_dim: int
) -> dict[str, Any] | None:
    """config[EXPORT_KEY], checked field by field; None when the folder has none."""
    if EXPORT_KEY not in config:
        return None
    record = config[EXPORT_KEY]
    fix = (
        f"restore config.json from the export, or delete its {EXPORT_KEY} key to import "
        "the full-vocabulary drafter as it is"
    )
    if not isinstance(record, dict):
        raise ConversionError(f"{path}: {EXPORT_KEY} is not a JSON object; {fix}")
    version = record.get("version")
    if not _is_int(version) or version != EXPORT_VERSION:
        raise ConversionError(
            f"{path}: {EXPORT_KEY} has version {version!r}, but this converter reads version "
            f"{EXPORT_VERSION}: convert it with the mlx-redrafter that exported it, or delete "
            f"the {EXPORT_KEY} key to import the full-vocabulary drafter as it is"
        )
    fields: dict[str, tuple[Callable[[Any], bool], str]] = {
        "exit_dim": (lambda v: _is_int(v) and 1 <= v < exit_dim, f"an integer in [1, {exit_dim})"),
        "draft_vocab_size": (
            lambda v: v is None or (_is_int(v) and 1 <= v <= vocab_size),
            f"null or an integer in [1, {vocab_size}]",
        ),
        "identity_input_proj": (lambda v: isinstance(v, bool), "true or false"),
        "never_logit": (
            lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and -1e30 < v < 0,
            "a negative number",
        ),
        "vocab_padding": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    }
    for key, (ok, expected) in fields.items():
        if key not in record:
            raise ConversionError(f"{path}: {EXPORT_KEY} lacks {key}; {fix}")
        if not ok(record[key]):
            raise ConversionError(
                f"{path}: {EXPORT_KEY}.{key} must be {expected}, not {record[key]!r}; {fix}"
            )
    if record["identity_input_proj"] and record["exit_dim"] != 2 * hidden_size:
        raise ConversionError(
            f"{path}: {EXPORT_KEY}.identity_input_proj is true but exit_dim "
            f"{record['exit_dim']} is not 2 x hidden_size {hidden_size}; {fix}"
        )
    return {key: record[key] for key in ("version", *fields)}


def _read_order(path: Path, export: dict[str, Any], vocab_size: int) -> list[int] | None:
    """The draft vocabulary's order (VOCAB_ORDER_FILE), checked; None when absent."""
    if not path.is_file():
        return None
    try:
        order = json.loads(path.read_text())
        problem = _order_problem(order, int(export["draft_vocab_size"]), vocab_size)
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError
        problem = f"it is not valid JSON ({exc})"
    if problem is not None:
        raise ConversionError(
            f"{path} is not the draft vocabulary's order: {problem}. Restore it from the "
            "export, or delete it to import the draft vocabulary in ascending id order"
        )
    return [int(i) for i in order]


def _order_problem(order: object, size: int, vocab_size: int) -> str | None:
    """What is wrong with a draft-vocabulary order: Vd distinct ids in [0, V)."""
    if not isinstance(order, list) or not all(_is_int(i) for i in order):
        return "it is not a JSON list of integers"
    if len(order) != size:
        return f"it has {len(order)} ids, the export records {size}"
    if not all(0 <= i < vocab_size for i in order):
        return f"an id is outside [0, {vocab_size})"
    if len(set(order)) != len(order):
        return "an id repeats"
    return None


# -- the constant feature ------------------------------------------------------------


def _padded_width(exit_dim: int, hidden_size: int, multiple: int) -> int:
    """E + 1 rounded up to `multiple`, never 2D (that would mean 'no input_proj')."""
    width = -(-(exit_dim + 1) // multiple) * multiple
    return width + multiple if width == 2 * hidden_size else width


def expand_vocabulary(checkpoint: Checkpoint, tp_size: int = 1) -> Checkpoint:
    """A full-vocabulary head for a reduced-vocabulary checkpoint (see module doc).

    tp_size: tensor-parallel ranks the result is split over: the new exit width E'
        is a multiple of 8 x tp_size, and when V is not a multiple of tp_size the
        export records the NEVER rows `tensorrt_tensors` pads the head with (a
        full-vocabulary checkpoint then gains the constant feature too).
    """
    config, weights = checkpoint.config, dict(checkpoint.weights)
    vocab, padding = int(config["vocab_size"]), -int(config["vocab_size"]) % tp_size
    if "draft_vocab_size" not in config and not padding:
        return checkpoint
    d, e, n = int(config["hidden_size"]), int(config["exit_dim"]), checkpoint.num_layers
    width = _padded_width(e, d, 8 * tp_size)
    dtype = weights[f"lm_head.{n}.weight"].dtype
    if "draft_vocab_ids" in weights:
        ids = np.asarray(weights.pop("draft_vocab_ids"), dtype=np.int64).tolist()  # (Vd,)
    else:
        ids = list(range(vocab))  # a full vocabulary: every row is a draft row
    if "input_proj.weight" in weights:
        proj_w, proj_b = weights["input_proj.weight"], weights["input_proj.bias"]
    else:  # E == 2D: an identity projection, exact in floating point
        proj_w, proj_b = mx.eye(e, dtype=dtype), mx.zeros((e,), dtype=dtype)  # (E, E), (E,)
    extra_bias = mx.zeros((width - e,), dtype=dtype).at[0].add(1.0)  # the constant feature
    weights["input_proj.weight"] = _grow(proj_w, rows=width)  # (E', 2D)
    weights["input_proj.bias"] = mx.concatenate([proj_b, extra_bias])  # (E',)
    gate = mx.zeros((width - e,), dtype=dtype).at[0].add(GATE_BIAS)  # (E' - E,)
    for i in range(n):
        block = f"lm_head.{i}.linear"
        weights[f"{block}.weight"] = _grow(weights[f"{block}.weight"], width, width)  # (E', E')
        weights[f"{block}.bias"] = mx.concatenate([weights[f"{block}.bias"], gate])  # (E',)
    weights[f"lm_head.{n}.weight"] = _full_head(weights[f"lm_head.{n}.weight"], ids, vocab, width)
    full = {k: v for k, v in config.items() if k != "draft_vocab_size"} | {"exit_dim": width}
    export = {
        "version": EXPORT_VERSION,
        "exit_dim": e,
        "draft_vocab_size": len(ids) if "draft_vocab_size" in config else None,
        "identity_input_proj": "input_proj.weight" not in checkpoint.weights,
        "never_logit": NEVER_LOGIT,
        "vocab_padding": padding,
    }
    order = ids if "draft_vocab_size" in config else []
    return Checkpoint(full, weights, checkpoint.side, export | {"order": order})


def _full_head(head: mx.array, ids: list[int], vocab: int, width: int) -> mx.array:
    """The (V, E') head, built in the head's dtype: row ids[j] is [head[j], 0, ...],
    every other row [0, ..., NEVER_LOGIT at E, 0, ...]."""
    e, dtype, rows = head.shape[1], head.dtype, mx.array(ids)
    draft = mx.zeros((vocab, e), dtype=dtype)
    draft[rows] = head  # (V, E): the Vd draft rows at their target ids
    feature = mx.full((vocab, 1), NEVER_LOGIT, dtype=dtype)
    feature[rows] = 0  # (V, 1)
    padding = mx.zeros((vocab, width - e - 1), dtype=dtype)
    return mx.concatenate([draft, feature, padding], axis=1)  # (V, E')


def _never_rows(count: int, e: int, width: int, never: float, dtype: mx.Dtype) -> mx.array:
    """(count, E') rows scoring `never` through the constant feature E."""
    before = mx.zeros((count, e), dtype=dtype)  # (count, E)
    feature = mx.full((count, 1), never, dtype=dtype)  # (count, 1)
    after = mx.zeros((count, width - e - 1), dtype=dtype)  # (count, E' - E - 1)
    return mx.concatenate([before, feature, after], axis=1)  # (count, E')


def _grow(matrix: mx.array, rows: int, cols: int | None = None) -> mx.array:
    """`matrix` (r, c) zero-padded to (rows, cols or c)."""
    r, c = matrix.shape
    return mx.pad(matrix, [(0, rows - r), (0, (cols or c) - c)])


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ExportChanged(f"{what}: the folder changed after export")


def _draft_rows(head: mx.array, e: int, never: float) -> np.ndarray:
    """The ids of the draft rows of an expanded (V, E') head, after checking that every
    row is a draft row ([w, 0, ...]) or a NEVER row ([0, ..., never, 0, ...]); the
    comparison runs in the head's dtype, chunk by chunk (no float32 copy)."""
    expected = mx.array(never, dtype=head.dtype)  # as the export stored it (bf16: -29952)
    found = []
    for start in range(0, head.shape[0], _CHUNK):
        rows = head[start : start + _CHUNK]  # (C, E')
        feature = rows[:, e]  # (C,)
        draft = (feature == 0) & mx.all(rows[:, e + 1 :] == 0, axis=1)  # (C,)
        zero_w = mx.all(rows[:, :e] == 0, axis=1) & mx.all(rows[:, e + 1 :] == 0, axis=1)
        never_row = (feature == expected) & zero_w  # (C,)
        _check(bool(mx.all(draft | never_row).item()), "head rows")
        found.append(np.flatnonzero(np.array(draft)) + start)
    return np.concatenate(found)  # (Vd,)


def _check_blocks(weights: dict[str, mx.array], e: int, width: int, n: int) -> None:
    """The added input_proj rows and residual-block rows/columns are as exported."""
    proj_w, proj_b = weights.get("input_proj.weight"), weights.get("input_proj.bias")
    _check(proj_w is not None and proj_b is not None, "input_proj")
    assert proj_w is not None and proj_b is not None
    _check(proj_w.shape[0] == width and tuple(proj_b.shape) == (width,), "input_proj shape")
    added_w = np.array(proj_w[e:].astype(mx.float32))  # (E' - E, 2D)
    added_b = np.array(proj_b[e:].astype(mx.float32))  # (E' - E,)
    _check(not added_w.any(), "input_proj rows")
    _check(added_b[0] == 1.0 and not added_b[1:].any(), "input_proj constant feature")
    for i in range(n):
        w = weights.get(f"lm_head.{i}.linear.weight")
        b = weights.get(f"lm_head.{i}.linear.bias")
        _check(w is not None and b is not None, f"block {i}")
        assert w is not None and b is not None
        _check(tuple(w.shape) == (width, width) and tuple(b.shape) == (width,), f"block {i}")
        w_np, b_np = np.array(w.astype(mx.float32)), np.array(b.astype(mx.float32))
        _check(not w_np[e:].any() and not w_np[:, e:].any(), f"block {i}")
        _check(b_np[e] == GATE_BIAS and not b_np[e + 1 :].any(), f"block {i} gate")


def reduce_vocabulary(checkpoint: Checkpoint) -> Checkpoint:
    """Undo `expand_vocabulary`. Raise ExportChanged (saying what differs) when the
    folder is not exactly what it wrote, e.g. after fine-tuning elsewhere; the
    export record itself is checked by the readers (`_export_record`)."""
    export, config, weights = checkpoint.export or {}, checkpoint.config, checkpoint.weights
    if export.get("version") != EXPORT_VERSION:
        raise ConversionError(f"unknown {EXPORT_KEY} version {export.get('version')!r}")
    e, n, width = int(export["exit_dim"]), checkpoint.num_layers, int(config["exit_dim"])
    vocab = int(config["vocab_size"])
    head = weights.get(f"lm_head.{n}.weight")
    _check(head is not None and tuple(head.shape) == (vocab, width), "head shape")
    assert head is not None
    _check_blocks(weights, e, width, n)
    draft = _draft_rows(head, e, float(export["never_logit"]))
    size = export["draft_vocab_size"]
    _check(len(draft) == (vocab if size is None else size), "draft row count")
    out = {k: v for k, v in weights.items() if not k.startswith(("input_proj", "lm_head"))}
    for i in range(n):
        out[f"lm_head.{i}.linear.weight"] = weights[f"lm_head.{i}.linear.weight"][:e, :e]
        out[f"lm_head.{i}.linear.bias"] = weights[f"lm_head.{i}.linear.bias"][:e]
    if export["identity_input_proj"]:
        proj_w = np.array(weights["input_proj.weight"][:e].astype(mx.float32))  # (E, E)
        proj_b = np.array(weights["input_proj.bias"][:e].astype(mx.float32))  # (E,)
        _check(np.array_equal(proj_w, np.eye(e)) and not proj_b.any(), "identity input_proj")
    else:
        out["input_proj.weight"] = weights["input_proj.weight"][:e]  # (E, 2D)
        out["input_proj.bias"] = weights["input_proj.bias"][:e]  # (E,)
    reduced = config | {"exit_dim": e}
    if size is None:  # a full vocabulary that only gained the constant feature
        out[f"lm_head.{n}.weight"] = head[:, :e]  # (V, E)
        return Checkpoint(reduced, out, checkpoint.side, None)
    order = export.get("order") or draft.tolist()
    _check(sorted(order) == draft.tolist(), f"draft rows (not the ids of {VOCAB_ORDER_FILE})")
    out[f"lm_head.{n}.weight"] = head[mx.array(order)][:, :e]  # (Vd, E)
    out["draft_vocab_ids"] = mx.array(order, dtype=mx.int32)  # (Vd,)
    return Checkpoint(reduced | {"draft_vocab_size": len(order)}, out, checkpoint.side, None)


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


def _tensorrt_named(checkpoint: Checkpoint, tp_size: int) -> dict[str, mx.array]:
    """The `drafter.*` tensors, the head padded with NEVER rows to a multiple of tp."""
    n, export = checkpoint.num_layers, checkpoint.export or {}
    named = {}
    for name, value in checkpoint.weights.items():
        if name == f"lm_head.{n}.weight":
            padding = -value.shape[0] % tp_size
            if padding:
                if export.get("vocab_padding") != padding:
                    raise ConversionError(
                        f"the head's {value.shape[0]} rows need {padding} padding rows for "
                        f"--tp-size {tp_size}: expand_vocabulary(tp_size={tp_size}) first"
                    )
                pad = _never_rows(
                    padding, int(export["exit_dim"]), value.shape[1], NEVER_LOGIT, value.dtype
                )
                value = mx.concatenate([value, pad])  # (V + padding, E')
            named["drafter.lm_head.weight"] = value
        elif name.startswith("lm_head."):
            named["drafter.layers." + name[len("lm_head.") :]] = value
        else:
            named["drafter." + name] = value
    for name, value in named.items():
        if value.shape[0] % tp_size:
            raise ConversionError(
                f"{name} has {value.shape[0]} rows, not divisible by --tp-size {tp_size}: "
                "every tensor is split along its first axis, so pick a --tp-size that "
                "divides the hidden size"
            )
    return named


def tensorrt_tensors(checkpoint: Checkpoint, tp_size: int) -> list[dict[str, mx.array]]:
    """The `drafter.*` tensors of each tensor-parallel rank (split along axis 0)."""
    named = _tensorrt_named(checkpoint, tp_size)
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

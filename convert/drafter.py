"""Drafters in and out: this project's folder, the reference's, TensorRT-LLM's.

Any of the three layouts (`drafter_formats`) converts into any other:

* into **mlx-redrafter** (the default): a drafter folder that `Drafter.load` opens,
  optionally quantized or in another dtype (a quantized source stays quantized).
  A folder this converter exported comes back exactly (`reduce_vocabulary`).
* into **reference** or **tensorrt-llm**: float weights in that layout (a quantized
  drafter dequantized); a reduced vocabulary becomes a full-vocabulary head
  (`expand_vocabulary`). The n-gram table, acceptance table and draft-vocabulary
  order ride along in the export's `mlx_redrafter/` side folder (no loader of
  those formats reads it). The converter then compares the exported drafter with
  the original on sampled target states (`agreement`), prints the agreement, and
  refuses to publish an export whose drafts differ.

Every read is checked by loading the result through `Drafter.load`, and every
output is written to a work folder first and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_redrafter.drafter import Drafter, DrafterConfig, DrafterError

from .agreement import Agreement, States, compare, model_states, random_states
from .drafter_formats import (
    FORMATS,
    SIDE_FILES,
    Checkpoint,
    ExportChanged,
    expand_vocabulary,
    read_checkpoint,
    reduce_vocabulary,
    tensorrt_tensors,
    write_reference,
    write_tensorrt,
)
from .errors import ConversionError
from .output import check_destination, publish, work_directory
from .progress import note

DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class ExportCheck:
    """How an export into the reference or TensorRT-LLM layout is checked and shaped.

    model: the target whose hidden states are sampled (a folder or Hub id); None uses
        the embedded default model for the drafter shipped with it, else random states.
    prompts: a prompt file (JSONL); None is the packaged MT-Bench.
    samples: target positions sampled (each gives 2 states: depth 1 and 2).
    beams: (W, L) of the beam searches compared, and of the TensorRT-LLM config.
    beam_rows: how many sampled positions also run the full beam search.
    tp_size: tensor-parallel ranks of a TensorRT-LLM export.
    """

    model: str | None = None
    prompts: str | None = None
    samples: int = 1000
    beams: tuple[int, int] = (8, 5)
    beam_rows: int = 64
    tp_size: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        def whole(value: object, low: int) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= low

        if not whole(self.tp_size, 1):
            raise ConversionError(
                f"--tp-size must be a positive number of tensor-parallel ranks, not "
                f"{self.tp_size!r}: use 1 for a single GPU"
            )
        if not whole(self.samples, 1):
            raise ConversionError(f"--samples must be a positive integer, not {self.samples!r}")
        if not whole(self.beam_rows, 0):
            raise ConversionError(f"beam_rows must be an integer >= 0, not {self.beam_rows!r}")
        shape = tuple(self.beams) if isinstance(self.beams, (tuple, list)) else ()
        if len(shape) != 2 or not whole(shape[0], 1) or not whole(shape[1], 2):
            raise ConversionError(
                f"--beams must be WxL with a width W >= 1 and a length L >= 2 (such as 8x5), "
                f"not {self.beams!r}"
            )


def _check_options(to: str, quantize: bool, bits: int, group_size: int, dtype: str | None) -> None:
    if to not in FORMATS:
        raise ConversionError(f"unknown drafter format {to!r}; supported: {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"dtype must be float16, bfloat16 or float32, not {dtype!r}")
    if quantize and to != "mlx-redrafter":
        raise ConversionError(
            f"the {to} format holds float weights: drop --quantize (quantize after importing)"
        )
    if quantize and bits not in (4, 8):
        raise ConversionError(f"--bits must be 4 or 8, not {bits}")
    if quantize and group_size not in (32, 64, 128):
        raise ConversionError(f"--group-size must be 32, 64 or 128, not {group_size}")


def _source_folder(src: str | os.PathLike[str]) -> Path:
    source = Path(src).expanduser()
    if not source.exists():
        raise ConversionError(f"no such file or directory: {source}")
    if not source.is_dir():
        raise ConversionError(f"{source} is not a drafter folder")
    return source


def _import(source: Path, dtype: str | None, progress: bool) -> Checkpoint:
    """Read `source` in any format; undo an expanded vocabulary; cast to `dtype`."""
    checkpoint = read_checkpoint(source)
    if checkpoint.export is not None:
        try:
            reduced = checkpoint.export["draft_vocab_size"] is not None
            checkpoint = reduce_vocabulary(checkpoint)
            what = "the reduced draft vocabulary" if reduced else "the exit width"
            note(f"[drafter] restored {what} of an export", enabled=progress)
        except ExportChanged as exc:
            note(f"[drafter] kept the full vocabulary: {exc}", enabled=progress)
    if dtype is not None:
        target = getattr(mx, dtype)
        weights = {
            k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in checkpoint.weights.items()
        }
        checkpoint = Checkpoint(checkpoint.config, weights, checkpoint.side, checkpoint.export)
    return checkpoint


def _stage(checkpoint: Checkpoint, folder: Path, source: Path) -> Drafter:
    """Write `checkpoint` as a project folder and load it: every name and shape checked."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(checkpoint.config, indent=2))
    mx.save_safetensors(str(folder / "model.safetensors"), checkpoint.weights, {"format": "mlx"})
    for name in SIDE_FILES:
        if checkpoint.side is not None and (checkpoint.side / name).is_file():
            shutil.copyfile(checkpoint.side / name, folder / name)
    try:
        return Drafter.load(folder)
    except (DrafterError, ValueError, KeyError) as exc:
        message = str(exc).replace(str(folder / "model.safetensors"), "the weights")
        raise ConversionError(f"{source}: {message.replace(str(folder), str(source))}") from exc


def float_checkpoint(drafter: Drafter, dtype: Any, side: Path | None) -> Checkpoint:
    """The drafter's weights in the reference naming, dequantized, as `dtype`."""
    weights = dict(tree_flatten(drafter.parameters()))
    for name, module in drafter.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            for part in ("weight", "scales", "biases"):
                weights.pop(f"{name}.{part}", None)
            weights[f"{name}.weight"] = mx.dequantize(
                module.weight, module.scales, module.biases, module.group_size, module.bits
            )
    out = {k: (v if k == "draft_vocab_ids" else v.astype(dtype)) for k, v in weights.items()}
    return Checkpoint(drafter.config.to_dict(), out, side)


def exported_drafter(checkpoint: Checkpoint) -> Drafter:
    """A full-vocabulary `Drafter` on an exported checkpoint's weights (float32)."""
    config = DrafterConfig.from_dict(checkpoint.config)
    drafter = Drafter(config)
    drafter.load_weights(
        [
            (k, v if k == "draft_vocab_ids" else v.astype(mx.float32))
            for k, v in checkpoint.weights.items()
        ]
    )
    mx.eval(drafter.parameters())
    return drafter


def _load_model(name: str) -> tuple[Any, Any]:
    """mlx-lm's (model, tokenizer) for --model, or a one-line ConversionError."""
    from mlx_lm.utils import load as load_mlx_lm

    try:
        model, tokenizer = load_mlx_lm(name)[:2]
    except Exception as exc:  # mlx-lm and huggingface_hub raise many kinds
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise ConversionError(
            f"cannot load --model {name} ({detail}); it must be an mlx-lm model folder "
            "(config.json, *.safetensors and the tokenizer files, as `mlx-redrafter-convert "
            "model` writes) or a Hugging Face Hub id of one"
        ) from exc
    return model, tokenizer


def sample_states(check: ExportCheck, drafter: Drafter, source: Path) -> States:
    """Target states for the agreement check: from a model when one is known."""
    from mlx_redrafter.loading import DEFAULT_DRAFTER

    model_name = check.model
    if model_name is None and source.resolve() == DEFAULT_DRAFTER.resolve():
        from mlx_redrafter.defaults import default_model_path

        model_name = str(default_model_path(progress=False))
    if model_name is None:
        config = drafter.config
        return random_states(config.hidden_size, config.vocab_size, check.samples, check.seed)
    from mlx_redrafter.prompts import MT_BENCH, encode_prompt, read_prompts

    model, tokenizer = _load_model(model_name)
    try:
        drafter.check_fits(model)
    except ValueError as exc:
        raise ConversionError(f"{source} was not made for {model_name}: {exc}") from exc
    prompt_file = check.prompts or MT_BENCH
    try:
        records = read_prompts(prompt_file, warn=lambda _: None)
    except (OSError, ValueError) as exc:
        raise ConversionError(f"cannot read prompts: {exc}") from exc
    tokens = [encode_prompt(tokenizer, record.messages) for record in records]
    name = Path(prompt_file).name
    return model_states(model, tokens, check.samples, check.seed, f"{name} through {model_name}")


def export_to(
    to: str,
    drafter: Drafter,
    dtype: Any,
    staged: Path,
    result: Path,
    check: ExportCheck,
    source: Path,
) -> Agreement:
    """Write `drafter` in the reference or TensorRT-LLM layout to `result`, after
    checking that the exported weights draft exactly as the drafter does."""
    width, draft_tokens = check.beams[0], drafter.config.output_size
    if width > draft_tokens:
        raise ConversionError(
            f"--beams {width}x{check.beams[1]}: the width {width} is more than the "
            f"drafter's {draft_tokens} draft tokens; use a width of at most {draft_tokens}"
        )
    tp_size = check.tp_size if to == "tensorrt-llm" else 1
    original = float_checkpoint(drafter, dtype, staged)
    expanded = expand_vocabulary(original, tp_size=tp_size)
    tensorrt_tensors(expanded, tp_size)  # a split that cannot be done fails before the check
    before = exported_drafter(original)  # the same float weights, before the expansion
    states = sample_states(check, before, source)
    agreement = compare(
        before,
        exported_drafter(expanded),
        states,
        check.beams[0],
        check.beams,
        min(check.beam_rows, check.samples),
    )
    if not agreement.exact:
        raise ConversionError(
            f"the exported head does not draft like the original ({agreement.summary()}); "
            "nothing was written. Train the drafter with its full vocabulary to export it"
        )
    if to == "reference":
        write_reference(expanded, result)
    else:
        write_tensorrt(expanded, result, tp_size, check.beams)
    return agreement


def convert_drafter(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    to: str = "mlx-redrafter",
    quantize: bool = False,
    bits: int = 4,
    group_size: int = 64,
    dtype: str | None = None,
    force: bool = False,
    progress: bool = True,
    check: ExportCheck | None = None,
) -> Path:
    """Convert the drafter folder `src` (any of FORMATS) into `out` in format `to`.

    check: how an export is checked and shaped; only for `to` reference/tensorrt-llm.
    """
    _check_options(to, quantize, bits, group_size, dtype)
    if check is not None and to == "mlx-redrafter":
        raise ConversionError(
            "the export check (model, prompts, samples, beams, tp_size) applies only to "
            "to='reference' or 'tensorrt-llm'; drop it for to='mlx-redrafter'"
        )
    if check is not None and to == "reference" and check.tp_size != 1:
        raise ConversionError(
            "--tp-size applies only to --to tensorrt-llm (the reference layout is one "
            "file): drop it, or export --to tensorrt-llm"
        )
    source = _source_folder(src)
    out = Path(out).expanduser()
    check_destination(out, force=force)
    checkpoint = _import(source, dtype, progress)
    quantized = checkpoint.config.get("quantization")
    if quantize and quantized:
        raise ConversionError(
            f"{source} is already quantized ({quantized['bits']} bits, groups of "
            f"{quantized['group_size']}): drop --quantize to copy it as it is, or quantize "
            "the drafter's float checkpoint"
        )
    floats = [v.dtype for v in checkpoint.weights.values() if mx.issubdtype(v.dtype, mx.floating)]
    with work_directory(out) as work:
        drafter = _stage(checkpoint, work / "source", source)
        result = work / "result"
        if to == "mlx-redrafter":
            if quantize:
                note(f"[drafter] quantizing: {bits} bits, groups of {group_size}", enabled=progress)
                drafter.quantize(group_size=group_size, bits=bits)
            drafter.save(result)
        else:
            export_dtype = getattr(mx, dtype) if dtype else floats[0]
            agreement = export_to(
                to, drafter, export_dtype, work / "source", result, check or ExportCheck(), source
            )
            note(f"[agreement] {agreement.summary()}", enabled=progress)
        publish(result, out, force=force, trash=work / "previous")
    note(f"[done] wrote {out}", enabled=progress)
    return out

"""``mlx-redrafter-convert``: convert models (and drafters) to MLX folders."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .errors import ConversionError

if TYPE_CHECKING:
    from .drafter import ExportCheck

EXIT_ERROR = 2
EXIT_INTERNAL = 1
EXIT_INTERRUPTED = 130

_MAIN_EPILOG = textwrap.dedent(
    """\
    examples:
      # a GGUF file (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3), float32 output
      mlx-redrafter-convert model SmolLM2-135M-Instruct.Q4_1.gguf -o models/smollm2

      # a local Hugging Face folder, 4-bit quantized
      mlx-redrafter-convert model ./Llama-3.2-1B-Instruct -o models/llama-4bit --quantize

      # a Hub id (downloaded by huggingface_hub), bfloat16, replacing an old output
      mlx-redrafter-convert model HuggingFaceTB/SmolLM2-360M-Instruct -o models/smol360 \\
          --dtype bfloat16 --force

      # a ReDrafter drafter checkpoint, 4-bit quantized
      mlx-redrafter-convert drafter ./drafter-ckpt -o drafters/mine --quantize

      # the shipped drafter, exported for Apple's reference code
      mlx-redrafter-convert drafter mlx_redrafter/drafters/smollm2-135m-instruct \
          -o exported/reference --to reference

    run 'mlx-redrafter-convert model --help' (or 'drafter --help') for the options.
    """
)

_MODEL_EPILOG = textwrap.dedent(
    """\
    SRC is one of:
      - a .gguf file: config, tokenizer and weights are rebuilt from the file
        (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3 architectures);
        weights are dequantized exactly to float32 and saved as float32
        unless --dtype says otherwise;
      - a Hugging Face model folder (config.json + safetensors + tokenizer);
      - a Hugging Face Hub id such as org/name (needs network access).

    The output folder is what mlx_lm.load() opens: config.json,
    model*.safetensors and the tokenizer files.  It is written next to OUT in
    a hidden folder and renamed into place when complete; an existing OUT is
    only replaced with --force, and only after the new folder is complete.

    examples:
      mlx-redrafter-convert model model.Q4_K_M.gguf -o out/model
      mlx-redrafter-convert model ./hf-folder -o out/model-q8 --quantize --bits 8
      mlx-redrafter-convert model org/name -o out/model --dtype float16 --force
    """
)

_DRAFTER_EPILOG = textwrap.dedent(
    """\
    SRC is a drafter folder in any of the three layouts (detected from its
    config.json): mlx-redrafter's own, the reference's (Apple's
    recurrent_drafting: model_type "recurrent_drafting_drafter" with
    model.safetensors or pytorch_model.bin), or TensorRT-LLM's (architecture
    "ReDrafterForCausalLM", drafter.* tensors in rank*.safetensors).  Only the
    weights file is read as weights: ngrams.safetensors and other files beside it
    are not.

    --to mlx-redrafter (default) writes the project's drafter folder, checked by
    loading it.  --to reference / tensorrt-llm write float weights in that layout;
    a reduced draft vocabulary becomes an exact full-vocabulary head, and the
    converter prints how the exported drafter agrees with the original (top-W
    drafts on sampled target states, and whole W x L beam searches); it refuses
    when they differ.  The states come from --model (default: the embedded model
    for the drafter shipped with it; otherwise random states) run on --prompts
    (default: the packaged MT-Bench).  --model, --prompts, --samples and --beams
    apply only to these two layouts, --tp-size only to tensorrt-llm.  A quantized
    SRC stays quantized with --to mlx-redrafter and is dequantized for the other
    two.  docs/convert.md documents the layouts.

    examples:
      mlx-redrafter-convert drafter ./drafter-ckpt -o drafters/smollm2
      mlx-redrafter-convert drafter ./drafter-ckpt -o drafters/smollm2-q4 --quantize
      mlx-redrafter-convert drafter drafters/mine -o out/ref --to reference --model models/mine
      mlx-redrafter-convert drafter drafters/mine -o out/trt --to tensorrt-llm --tp-size 2 \\
          --dtype float16
      mlx-redrafter-convert drafter out/ref -o drafters/back   # and back
    """
)


def _beam_shape(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected WxL such as 8x5, not {text!r}")
    width, length = int(parts[0]), int(parts[1])
    if length < 2:
        raise argparse.ArgumentTypeError(f"a beam needs length >= 2, not {length}")
    return width, length


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {value}")
    return value


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o",
        "--output",
        "--out",
        dest="out",
        required=True,
        metavar="OUT",
        help="output folder (must not exist unless --force)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace OUT if it exists (only after the new folder is complete)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.add_argument(
        "--debug", action="store_true", help="show a traceback for unexpected internal errors"
    )


def _add_weight_options(
    parser: argparse.ArgumentParser, quantize_help: str, dtype_default: str
) -> None:
    """--quantize/--bits/--group-size/--dtype, shared by both subcommands."""
    parser.add_argument("--quantize", action="store_true", help=quantize_help)
    parser.add_argument(
        "--bits",
        type=int,
        choices=(4, 8),
        default=4,
        help="bits per weight with --quantize (default: 4)",
    )
    parser.add_argument(
        "--group-size",
        type=_positive_int,
        default=64,
        metavar="N",
        help="quantization group size: 32, 64 or 128 (default: 64)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32"),
        default=None,
        help=f"dtype of the unquantized weights (default: {dtype_default})",
    )


EXPORT_OPTIONS = ("model", "prompts", "samples", "beams", "tp_size")  # None unless given


def _add_export_options(parser: argparse.ArgumentParser) -> None:
    """The agreement check and TensorRT-LLM shape of --to reference / tensorrt-llm
    (defaults None, so that `_export_check` can tell which were given)."""
    parser.add_argument(
        "--model", metavar="MODEL", help="target model whose hidden states the check samples"
    )
    parser.add_argument(
        "--prompts", metavar="FILE", help="prompt file for the check (default: MT-Bench)"
    )
    parser.add_argument(
        "--samples",
        type=_positive_int,
        metavar="N",
        help="target positions sampled by the check, 2 states each (default: 1000)",
    )
    parser.add_argument(
        "--beams",
        type=_beam_shape,
        metavar="WxL",
        help="beam search compared by the check, and TensorRT-LLM's beam shape (default: 8x5)",
    )
    parser.add_argument(
        "--tp-size",
        type=_positive_int,
        metavar="N",
        help="tensor-parallel ranks of a TensorRT-LLM export (default: 1)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-redrafter-convert",
        description="Convert language models (Hugging Face or GGUF) and ReDrafter drafters "
        "into folders that mlx-lm / mlx-redrafter load.",
        epilog=_MAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="{model,drafter}")
    sub.required = True

    model = sub.add_parser(
        "model",
        help="convert a base model (HF folder, Hub id or .gguf) to an MLX folder",
        description="Convert a base model to an MLX model folder that mlx_lm.load() opens.",
        epilog=_MODEL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model.add_argument("src", metavar="SRC", help="HF folder, Hub id (org/name) or .gguf file")
    _add_common(model)
    _add_weight_options(
        model,
        quantize_help="quantize the weights with MLX affine quantization",
        dtype_default="the checkpoint's own for HF sources, float32 for GGUF",
    )

    drafter = sub.add_parser(
        "drafter",
        help="convert a ReDrafter drafter between mlx-redrafter, reference and TensorRT-LLM",
        description="Convert a ReDrafter drafter between the mlx-redrafter, reference and "
        "TensorRT-LLM layouts.",
        epilog=_DRAFTER_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    drafter.add_argument(
        "src", metavar="SRC", help="drafter folder (mlx-redrafter, reference or tensorrt-llm)"
    )
    _add_common(drafter)
    drafter.add_argument(
        "--to",
        choices=("mlx-redrafter", "reference", "tensorrt-llm"),
        default="mlx-redrafter",
        help="output layout (default: mlx-redrafter)",
    )
    _add_export_options(drafter)
    _add_weight_options(
        drafter, quantize_help="quantize the drafter's linear layers", dtype_default="as stored"
    )
    return parser


def _export_check(args: argparse.Namespace) -> ExportCheck | None:
    """The ExportCheck of --to reference / tensorrt-llm; None for --to mlx-redrafter,
    where giving an export option is an error rather than silently ignored."""
    from .drafter import ExportCheck

    given = {name: getattr(args, name) for name in EXPORT_OPTIONS}
    given = {name: value for name, value in given.items() if value is not None}
    if args.to == "mlx-redrafter":
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ConversionError(
                f"{flags} apply only to --to reference|tensorrt-llm (the export check and "
                "layout): drop them, or pick one of those layouts"
            )
        return None
    return ExportCheck(**given)


def _run(args: argparse.Namespace) -> None:
    if args.command == "model":
        from .api import convert_model

        convert_model(
            args.src,
            args.out,
            quantize=args.quantize,
            bits=args.bits,
            group_size=args.group_size,
            dtype=args.dtype,
            force=args.force,
            progress=not args.quiet,
        )
    elif args.command == "drafter":
        from .drafter import convert_drafter

        convert_drafter(
            args.src,
            args.out,
            to=args.to,
            check=_export_check(args),
            quantize=args.quantize,
            bits=args.bits,
            group_size=args.group_size,
            dtype=args.dtype,
            force=args.force,
            progress=not args.quiet,
        )
    else:  # pragma: no cover - argparse enforces the choices
        raise ConversionError(f"unknown command {args.command!r}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _run(args)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if getattr(args, "debug", False):
            raise
        detail = " ".join(str(exc).split())[:300]
        print(
            f"error: internal error: {type(exc).__name__}: {detail} (rerun with --debug "
            "for the traceback)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

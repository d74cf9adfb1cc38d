"""The `mlx-redrafter` command: a dispatcher over `mlx_redrafter.commands`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .commands import COMMANDS
from .drafter import DrafterError
from .target import UnsupportedModelError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-redrafter",
        description="ReDrafter speculative decoding for mlx-lm models.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (
        ValueError,
        FileNotFoundError,
        FileExistsError,
        DrafterError,
        UnsupportedModelError,
    ) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

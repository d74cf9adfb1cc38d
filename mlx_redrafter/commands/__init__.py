"""Subcommands of `mlx-redrafter`, one module each.

Each module has `register(commands)`, which adds its subparser and sets
`run=<function(args) -> exit code>` as the parser default.
"""

from . import (
    acceptance,
    bench,
    calibrate,
    chat,
    distill,
    generate,
    kernels,
    make_drafter,
    ngrams,
    replay,
    serve,
    train,
)

COMMANDS = [
    generate,
    make_drafter,
    distill,
    train,
    ngrams,
    acceptance,
    calibrate,
    bench,
    replay,
    kernels,
    chat,
    serve,
]

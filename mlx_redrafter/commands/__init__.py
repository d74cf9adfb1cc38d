"""Subcommands of `mlx-redrafter`, one module each.

Each module has `register(commands)`, which adds its subparser and sets
`run=<function(args) -> exit code>` as the parser default.
"""

from . import bench, chat, distill, generate, kernels, ngrams, serve, train

COMMANDS = [generate, distill, train, ngrams, bench, kernels, chat, serve]

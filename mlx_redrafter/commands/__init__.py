"""Subcommands of `mlx-redrafter`, one module each.

Each module has `register(commands)`, which adds its subparser and sets
`run=<function(args) -> exit code>` as the parser default.
"""

from . import bench, chat, distill, generate, kernels, serve, train

COMMANDS = [generate, distill, train, bench, kernels, chat, serve]

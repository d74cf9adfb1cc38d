"""Subcommands of `mlx-redrafter`, one module each.

Each module has `register(commands)`, which adds its subparser and sets
`run=<function(args) -> exit code>` as the parser default.
"""

from . import bench, chat, generate, kernels, serve

COMMANDS = [generate, bench, kernels, chat, serve]

"""Subcommands of `mlx-redrafter`, one module each.

Each module has `register(commands)`, which adds its subparser and sets
`run=<function(args) -> exit code>` as the parser default.
"""

from . import bench, generate, kernels

COMMANDS = [generate, bench, kernels]

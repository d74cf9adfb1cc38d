"""Errors raised by the converters.

Every failure that a user can cause or fix (a missing file, an unsupported
architecture, a damaged GGUF, weights that do not fit their config, an output
that already exists) is raised as :class:`ConversionError`.  The command line
prints its message as a single ``error: ...`` line and exits with status 2.
"""

from __future__ import annotations


class ConversionError(Exception):
    """A conversion could not be done; the message says why, in one line."""


class UnsupportedArchitectureError(ConversionError):
    """The source model's architecture has no converter."""


class MissingModelPackageError(ConversionError):
    """A bundled model's Python package is not installed."""

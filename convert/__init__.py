"""Model and drafter converters for mlx-redrafter (``mlx-redrafter-convert``).

>>> from mlx_redrafter.convert import convert_model
>>> convert_model("model.gguf", "out/model")            # doctest: +SKIP
"""

from .api import convert_model
from .errors import ConversionError, MissingModelPackageError, UnsupportedArchitectureError
from .gguf import SUPPORTED_ARCHITECTURES

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ConversionError",
    "MissingModelPackageError",
    "UnsupportedArchitectureError",
    "convert_model",
]

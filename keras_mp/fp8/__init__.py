"""FP8 training: recipes, quantization and FP8 GEMMs on every backend.

`adopt`, which turns Keras's float8 layers into keras_mp's FP8 layers
(floor 4, `keras_mp/fp8_adopt.py`), is put here by `keras_mp/__init__.py`.
"""

from keras_mp.fp8.availability import is_available
from keras_mp.fp8.dot import dot
from keras_mp.fp8.einsum import einsum
from keras_mp.fp8.quantize import dequantize
from keras_mp.fp8.quantize import quantize
from keras_mp.fp8.recipe import DEFAULT_RECIPE
from keras_mp.fp8.recipe import Recipe
from keras_mp.fp8.report import Report
from keras_mp.fp8.report import ReportRow
from keras_mp.fp8.report import report
from keras_mp.fp8.rules import DEFAULT_RULES
from keras_mp.fp8.rules import Rules

__all__ = [
    "DEFAULT_RECIPE",
    "DEFAULT_RULES",
    "Recipe",
    "Report",
    "ReportRow",
    "Rules",
    "dequantize",
    "dot",
    "einsum",
    "is_available",
    "quantize",
    "report",
]

"""FP8 training: recipes, quantization and FP8 GEMMs on every backend.

The public face of keras_mp's FP8: what Keras users call, gathered from
the private numeric core (`keras_mp/_fp8/`, which imports no layer) and
from the two functions that work on Keras layers, `adopt` (Keras's float8
layers taken over, `keras_mp/fp8_adopt.py`) and `freeze` (an inference
model, `keras_mp/fp8_freeze.py`). Nothing inside keras_mp imports it.
"""

# From the modules that define them (not `keras_mp._fp8`, whose `dot`,
# `einsum`, `quantize` and `report` are also submodules' names, which the
# API reference's static reader would take instead).
from keras_mp._fp8.availability import is_available
from keras_mp._fp8.dot import dot
from keras_mp._fp8.einsum import einsum
from keras_mp._fp8.quantize import dequantize
from keras_mp._fp8.quantize import quantize
from keras_mp._fp8.recipe import DEFAULT_RECIPE
from keras_mp._fp8.recipe import Recipe
from keras_mp._fp8.report import Report
from keras_mp._fp8.report import ReportRow
from keras_mp._fp8.report import report
from keras_mp._fp8.rules import DEFAULT_RULES
from keras_mp._fp8.rules import Rules
from keras_mp.fp8_adopt import adopt
from keras_mp.fp8_freeze import freeze

__all__ = [
    "DEFAULT_RECIPE",
    "DEFAULT_RULES",
    "Recipe",
    "Report",
    "ReportRow",
    "Rules",
    "adopt",
    "dequantize",
    "dot",
    "einsum",
    "freeze",
    "is_available",
    "quantize",
    "report",
]

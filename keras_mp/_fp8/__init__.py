"""FP8's numeric core (private): recipes, formats, quantizers and the FP8
GEMMs on every backend, below the layers. Users reach it through
`keras_mp.fp8` (`keras_mp/fp8.py`), which adds `adopt` and `freeze`; the
rest of keras_mp imports it here.
"""

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

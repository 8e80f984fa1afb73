"""The quantizers `dot` asks per GEMM role: one object per format and
scale granularity, one file each (`base.py` says what a quantizer is).

Imports only `keras_mp.backend` and its `keras_mp.fp8` siblings.
"""

from keras_mp.fp8.quantizers.base import Call
from keras_mp.fp8.quantizers.base import Dtypes
from keras_mp.fp8.quantizers.base import Quantizer
from keras_mp.fp8.quantizers.base import Rows
from keras_mp.fp8.quantizers.block import Block
from keras_mp.fp8.quantizers.rowwise import Rowwise
from keras_mp.fp8.quantizers.tensorwise import Tensorwise

# Power-of-two E4M3 / E5M2 scales, by granularity.
BY_GRANULARITY = {q.name: q for q in (Tensorwise(), Rowwise(), Block())}


def get(recipe):
    """The quantizer of a recipe's GEMMs."""
    return BY_GRANULARITY[recipe.granularity]


__all__ = ["BY_GRANULARITY", "Call", "Dtypes", "Quantizer", "Rows", "get"]

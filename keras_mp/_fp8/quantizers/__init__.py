"""The quantizers `dot` asks per GEMM role: one object per format and
scale granularity, one file each (`base.py` says what a quantizer is);
`register` plugs in one defined outside keras_mp.
"""

from keras_mp._fp8 import recipe_fields
from keras_mp._fp8.quantizers.base import Call
from keras_mp._fp8.quantizers.base import Dtypes
from keras_mp._fp8.quantizers.base import Quantizer
from keras_mp._fp8.quantizers.base import Rows
from keras_mp._fp8.quantizers.block import Block
from keras_mp._fp8.quantizers.high_precision import HighPrecision
from keras_mp._fp8.quantizers.mxfp8 import Mxfp8
from keras_mp._fp8.quantizers.nvfp4 import FrozenNvfp4
from keras_mp._fp8.quantizers.nvfp4 import Nvfp4
from keras_mp._fp8.quantizers.rowwise import Rowwise
from keras_mp._fp8.quantizers.tensorwise import Tensorwise

# Power-of-two E4M3 / E5M2 scales, by granularity.
BY_GRANULARITY = {q.name: q for q in (Tensorwise(), Rowwise(), Block())}
# MXFP8, by the rounding of its E8M0 scales.
_MX = {rounding: Mxfp8(rounding) for rounding in ("rceil", "floor")}
# NVFP4, by its stochastic rounding and Hadamard transform.
_NV = {
    (rounding, hadamard): Nvfp4(rounding, hadamard)
    for rounding in (True, False)
    for hadamard in (True, False)
}


def mx(scale_rounding):
    """The MXFP8 quantizer whose scales round by `scale_rounding`."""
    return _MX[scale_rounding]


def nv(stochastic_rounding=True, hadamard=True):
    """The NVFP4 quantizer with these backward options."""
    return _NV[(stochastic_rounding, hadamard)]


# The quantizers plugged in by `register`, by name.
_PLUGGED = {}


def register(quantizer):
    """Plugs in a format: `quantizer` runs the GEMMs of every
    `keras_mp.fp8.Recipe(granularity=quantizer.name)` (current scaling;
    `keras_mp.fp8.freeze` stores a kernel in its own frozen form where it
    has one, `Quantizer.frozen_variables`). `dot`, `einsum`, the layers,
    `keras_mp.fp8.report` (through `Call.observe`) and saving need
    nothing more. Registering a name again replaces its quantizer.

    Args:
        quantizer: A `Quantizer` instance whose `name` is a string other
            than a built-in granularity's.

    Returns:
        `quantizer`.
    """
    if not isinstance(quantizer, Quantizer):
        raise TypeError(
            "`register` takes a `keras_mp._fp8.quantizers.Quantizer` "
            f"instance. Received: quantizer={quantizer!r}. Subclass "
            "`Quantizer` and pass an instance of it."
        )
    name = quantizer.name
    builtin = recipe_fields.GRANULARITIES + ("microblock", "nvfp4")
    if not isinstance(name, str) or not name or name in builtin:
        raise ValueError(
            "A plugged-in quantizer's `name` is the granularity a Recipe "
            f"names it by: a string other than {list(builtin)}. Received: "
            f"name={name!r}. Give the Quantizer subclass a new `name`."
        )
    _PLUGGED[name] = quantizer
    recipe_fields.PLUGGED_GRANULARITIES.add(name)
    return quantizer


def get(recipe):
    """The quantizer of a recipe's GEMMs (its high-precision role, where
    it has one, unquantized)."""
    if recipe.granularity == "nvfp4" and recipe.scaling == "static":
        quantizer = FrozenNvfp4(recipe.stochastic_rounding, recipe.hadamard)
    elif recipe.granularity == "nvfp4":
        quantizer = nv(recipe.stochastic_rounding, recipe.hadamard)
    elif recipe.granularity == "microblock":
        quantizer = mx(recipe.scale_rounding)
    elif recipe.granularity in _PLUGGED:
        quantizer = _PLUGGED[recipe.granularity]
    else:
        quantizer = BY_GRANULARITY[recipe.granularity]
    if recipe.high_precision is not None:
        return HighPrecision(quantizer, recipe.high_precision)
    return quantizer


__all__ = [
    "BY_GRANULARITY",
    "Call",
    "Dtypes",
    "FrozenNvfp4",
    "HighPrecision",
    "Mxfp8",
    "Nvfp4",
    "Quantizer",
    "Rows",
    "get",
    "mx",
    "nv",
    "register",
]

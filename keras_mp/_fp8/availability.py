"""Whether this process's devices run a recipe's GEMMs on FP8 tensor cores.

Transformer Engine asks per format (`is_fp8_available`,
`is_mxfp8_available`, `is_nvfp4_available`): E4M3/E5M2 GEMMs with a scale
per tensor, row or tile need FP8 tensor cores (NVIDIA compute capability
8.9: Ada, Hopper, Blackwell); MXFP8's and NVFP4's block scales need
Blackwell's (10.0). keras_mp computes every recipe everywhere, bit for bit
the same: where the tensor cores are missing its GEMMs are emulated, on
16- or 32-bit units (MXFP8 and NVFP4 on Ada and Hopper too: their
operands dequantized, then multiplied), exact and slower than bfloat16.
"""

from __future__ import annotations

from keras_mp._fp8 import recipe as recipe_module
from keras_mp.backend import devices

# The formats whose block scales the tensor cores take, by their names in
# messages.
BLOCK_SCALED = {"mxfp8": "MXFP8", "mxfp8_hybrid": "MXFP8", "nvfp4": "NVFP4"}


def unavailable_reason(recipe, details):
    """Why `recipe`'s GEMMs run emulated on `details`'s devices, or None."""
    name = BLOCK_SCALED.get(recipe.formats)
    if name is not None:
        return devices.block_scaled_unsupported_reason(details, name)
    return devices.fp8_unsupported_reason(details)


def is_available(recipe=True, return_reason=False):
    """Whether `recipe`'s GEMMs run on this process's FP8 tensor cores.

    Asked per format, as Transformer Engine's `is_mxfp8_available` and
    `is_nvfp4_available` are: E4M3/E5M2 recipes (`formats="hybrid"` or
    `"e4m3"`, any granularity) need NVIDIA GPUs of compute capability 8.9
    or higher (Ada, Hopper, Blackwell); MXFP8 and NVFP4 need 10.0 or
    higher (Blackwell). Where this answers False, the recipe still trains,
    bit for bit the same, with its GEMMs emulated and slower than
    bfloat16. Asking looks the devices up, which initializes the backend's
    runtime.

    Args:
        recipe: A `keras_mp.fp8.Recipe`, `True` (the default recipe) or a
            recipe config dict. Defaults to `True`.
        return_reason: Whether to return `(available, reason)`, where
            `reason` says which devices lack what (`""` when available).
            Defaults to `False`.

    Returns:
        A bool, or `(bool, str)` with `return_reason=True`.

    Example:

    >>> available, reason = keras_mp.fp8.is_available(
    ...     keras_mp.fp8.Recipe(formats="nvfp4"), return_reason=True
    ... )
    >>> isinstance(available, bool), isinstance(reason, str)
    (True, True)
    """
    checked = recipe_module.get(recipe)
    if checked is None:
        raise ValueError(
            "`recipe` must be a keras_mp.fp8.Recipe, True (the default "
            f"recipe) or a Recipe config dict. Received: recipe={recipe!r}. "
            "Pass e.g. keras_mp.fp8.Recipe(formats='mxfp8')."
        )
    if not isinstance(return_reason, bool):
        raise TypeError(
            "`return_reason` must be True or False. Received: "
            f"return_reason={return_reason!r}"
        )
    reason = unavailable_reason(checked, devices.device_details())
    if return_reason:
        return reason is None, reason or ""
    return reason is None

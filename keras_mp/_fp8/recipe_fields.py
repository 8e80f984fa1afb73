"""The fields of a `Recipe`: the values each takes, and the checks of each
against the others.

`recipe.py`'s `Recipe` checks its arguments here: the choices of each field
(`SCALINGS`, `GRANULARITIES`, `FORMATS`, ... and `check_choice`, which the
formats' functions use too), the options that go only with MXFP8 or NVFP4
(`check_mx`, `check_nv`), the GEMM role left unquantized
(`check_high_precision`), what a GEMM saves for its kernel gradient
(`check_save_activations`), and an unknown field named with the field it
is here (Transformer Engine's and torchao's names included).
"""

import difflib
import numbers

SCALINGS = ("current", "delayed", "static")
GRANULARITIES = ("tensorwise", "rowwise", "block")
# Granularities a format plugs in (`keras_mp._fp8.quantizers.register`):
# the name of a quantizer that runs a recipe's GEMMs, with current scaling
# (or static: a layer `keras_mp.fp8.freeze` froze with that quantizer's
# own frozen form).
PLUGGED_GRANULARITIES = set()
FORMATS = ("hybrid", "e4m3", "mxfp8", "mxfp8_hybrid", "nvfp4")
# The formats whose blocks and scales are their own (OCP MX: 32 values
# along each GEMM's contracted axis share an E8M0 scale), by granularity.
MX_FORMATS = {"mxfp8": "microblock", "mxfp8_hybrid": "microblock"}
# How an MX block's E8M0 scale is rounded: "rceil" (the power of two at or
# above amax / 448: Transformer Engine, JAX, torchao's training recipes)
# or "floor" (the OCP specification's rule, which may clip the block's
# largest values to 448).
SCALE_ROUNDINGS = ("rceil", "floor")
# NVFP4's blocks and scales are its own too: E2M1 values in blocks of 16
# along each GEMM's contracted axis (the kernel in 16x16 tiles), each block
# with an E4M3 scale, and a float32 scale per tensor
# (`keras_mp/_fp8/formats/nvfp4.py`).
NV_FORMATS = {"nvfp4": "nvfp4"}
AMAX_ALGOS = ("max", "most_recent")

# DeepSeek-V3's tiles: 1x128 for activations and gradients, 128x128 for
# weights. A GEMM in "block" granularity needs its dimensions to be multiples.
BLOCK_SIZE = 128


FIELDS = (
    "scaling",
    "granularity",
    "formats",
    "margin",
    "amax_history",
    "amax_algo",
    "stats",
    "scale_rounding",
    "high_precision",
    "stochastic_rounding",
    "hadamard",
    "save_activations",
)

# Names other FP8 libraries give these fields (Transformer Engine's
# `DelayedScaling`, torchao's configs), and the field each one is here.
_OTHER_NAMES = {
    "amax_history_len": "amax_history",
    "amax_compute_algo": "amax_algo",
    "fp8_format": "formats",
    "format": "formats",
    "fmt": "formats",
}


def unknown_fields_message(kwargs):
    unknown = sorted(kwargs)
    hints = []
    for name in unknown:
        match = _OTHER_NAMES.get(name) or next(
            iter(difflib.get_close_matches(name, FIELDS, n=1)), None
        )
        if match:
            hints.append(f"`{name}` is `{match}` here")
    hint = f" ({'; '.join(hints)})" if hints else ""
    return (
        f"A Recipe takes the fields {list(FIELDS)}. Received unknown "
        f"fields {unknown}{hint}. Pass only those fields, e.g. "
        '`keras_mp.fp8.Recipe(granularity="rowwise", margin=1)`.'
    )


def check_choice(name, value, choices):
    """Raises ValueError unless `value` is one of `choices` (by name)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"`{name}` is one of {list(choices)}. Received: {name}={value!r}"
        )


def check_int(name, value, minimum):
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < minimum
    ):
        raise ValueError(
            f"`{name}` is an integer >= {minimum}. Received: {name}={value!r}"
        )
    return int(value)


def check_mx(formats, granularity, scale_rounding, scaling, margin):
    """The granularity and scale rounding a recipe of `formats` takes,
    or a ValueError naming the fix."""
    own = MX_FORMATS.get(formats)
    if own is None:
        if granularity is None:
            granularity = "tensorwise"
        check_choice(
            "granularity",
            granularity,
            GRANULARITIES + tuple(sorted(PLUGGED_GRANULARITIES)),
        )
        if scale_rounding is not None:
            raise ValueError(
                "`scale_rounding` is how an MX block's E8M0 scale is "
                f"rounded, so it goes with formats in {list(MX_FORMATS)}. "
                f"Received: formats={formats!r}, scale_rounding="
                f"{scale_rounding!r}. Leave `scale_rounding` as None, or "
                'use formats="mxfp8".'
            )
        return granularity, None
    if granularity not in (None, own):
        raise ValueError(
            f"formats={formats!r} scales blocks of 32 values along each "
            f"GEMM's contracted axis (granularity={own!r}). Received: "
            f"granularity={granularity!r}. Leave `granularity` as None, or "
            'use formats="hybrid" or "e4m3" for other granularities.'
        )
    if scaling == "delayed":
        raise ValueError(
            f"formats={formats!r} takes each block's scale from this "
            "step's values (current scaling): its scales are one per 32 "
            f"values, with no history. Received: scaling={scaling!r}. Use "
            f'scaling="current" with formats={formats!r}, or formats='
            f'"hybrid" for {scaling} scaling.'
        )
    if margin != 0:
        raise ValueError(
            f"formats={formats!r} rounds its E8M0 scales by "
            "`scale_rounding`, with no margin. Received: "
            f"margin={margin!r}. Leave `margin` as 0."
        )
    if scale_rounding is None:
        scale_rounding = "rceil"
    check_choice("scale_rounding", scale_rounding, SCALE_ROUNDINGS)
    return own, scale_rounding


def check_nv(formats, granularity, scaling, margin, options):
    """The granularity, stochastic rounding and Hadamard transform a
    recipe of `formats` takes, or a ValueError naming the fix."""
    if formats not in NV_FORMATS:
        for name, value in options.items():
            if value is not None:
                raise ValueError(
                    f"`{name}` is an option of NVFP4's backward GEMMs, so it "
                    f"goes with formats={list(NV_FORMATS)}. Received: "
                    f"formats={formats!r}, {name}={value!r}. Leave `{name}` "
                    'as None, or use formats="nvfp4".'
                )
        return granularity, None, None
    own = NV_FORMATS[formats]
    if granularity not in (None, own):
        raise ValueError(
            f"formats={formats!r} scales blocks of 16 values along each "
            "GEMM's contracted axis (the kernel in 16x16 tiles; "
            f"granularity={own!r}). Received: granularity={granularity!r}. "
            'Leave `granularity` as None, or use formats="hybrid" or "e4m3" '
            "for other granularities."
        )
    # "static" is a frozen layer's (`keras_mp.fp8.freeze`): its kernel's
    # codes and scales stored, each input's scales from its call.
    if scaling == "delayed":
        raise ValueError(
            f"formats={formats!r} takes its tensor and block scales from "
            "this step's values (current scaling), with no history. "
            f'Received: scaling={scaling!r}. Use scaling="current" with '
            f'formats={formats!r}, or formats="hybrid" for {scaling} '
            "scaling."
        )
    if margin != 0:
        raise ValueError(
            f"formats={formats!r} maps each tensor's amax to 448 * 6 (its "
            "tensor scale) and each block's to its E4M3 scale, with no "
            f"margin. Received: margin={margin!r}. Leave `margin` as 0."
        )
    resolved = []
    for name, value in options.items():
        value = True if value is None else value
        if not isinstance(value, bool):
            raise TypeError(
                f"`{name}` is a bool. Received: {name}={value!r}. Pass "
                f"`{name}=True` or `{name}=False`."
            )
        resolved.append(value)
    return own, *resolved


# The GEMM roles a recipe may leave unquantized (`high_precision`).
HIGH_PRECISION_ROLES = ("forward", "backward")


def check_high_precision(role, scaling, granularity, formats, stats):
    """`role` checked against the rest of the recipe: None, or a role
    whose GEMMs run unquantized while the others run the format."""
    if role is None:
        return None
    check_choice("high_precision", role, HIGH_PRECISION_ROLES)
    fix = (
        "Leave `high_precision` as None, or "
        'use scaling="current" without statistics'
    )
    if scaling != "current" or stats:
        raise ValueError(
            "`high_precision` leaves one role's GEMMs unquantized, so they "
            "have no scales to keep and no statistics to count. Received: "
            f"high_precision={role!r}, scaling={scaling!r}, stats={stats!r}. "
            f"{fix}."
        )
    if role == "forward" and granularity in ("tensorwise", "block"):
        raise ValueError(
            f"granularity={granularity!r} reuses the forward GEMM's codes "
            "in the gradients' GEMMs, so its forward cannot run in high "
            f"precision. Received: high_precision={role!r}, formats="
            f"{formats!r}. Use granularity='rowwise', formats='mxfp8' or "
            "'nvfp4' (each quantizes every GEMM's operands from the "
            "high-precision source), or high_precision='backward'."
        )
    return role


# What a GEMM keeps of its input for the kernel gradient
# (`save_activations`).
SAVE_ACTIVATIONS = ("input", "fp8")


def check_save_activations(value, formats, high_precision):
    check_choice("save_activations", value, SAVE_ACTIVATIONS)
    if value != "fp8":
        return value
    if formats in NV_FORMATS:
        raise ValueError(
            "save_activations='fp8' keeps the forward's codes of the input "
            "and quantizes them again along the tokens for the kernel "
            "gradient; NVFP4's forward codes are 4-bit E2M1 values, and "
            "its kernel gradient rotates the input before quantizing it. "
            f"Received: save_activations={value!r}, formats={formats!r}. "
            "Leave save_activations='input' with NVFP4."
        )
    if high_precision == "forward":
        raise ValueError(
            "save_activations='fp8' keeps the forward GEMM's codes of the "
            "input, and high_precision='forward' runs that GEMM without "
            f"codes. Received: save_activations={value!r}, high_precision="
            f"{high_precision!r}. Use high_precision='backward', or "
            "save_activations='input'."
        )
    return value

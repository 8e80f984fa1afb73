"""`Recipe`: how a GEMM runs in FP8, as a plain serializable value.

A recipe says which FP8 formats the operands take, how their scales are
chosen and at what granularity, as Transformer Engine's
`transformer_engine.common.recipe` does, without tying it to one framework.
"""

import difflib
import numbers

import keras

from keras_mp import _config

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


def _unknown_fields_message(kwargs):
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


def _check_int(name, value, minimum):
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < minimum
    ):
        raise ValueError(
            f"`{name}` is an integer >= {minimum}. Received: {name}={value!r}"
        )
    return int(value)


def _check_mx(formats, granularity, scale_rounding, scaling, margin):
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


def _check_nv(formats, granularity, scaling, margin, options):
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


def _check_high_precision(role, scaling, granularity, formats, stats):
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


def _check_save_activations(value, formats, high_precision):
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


@keras.saving.register_keras_serializable(package="keras_mp")
class Recipe:
    """How the GEMMs of a layer run in FP8.

    Each GEMM of a layer (the forward product, the input gradient and the
    kernel gradient) takes FP8 operands: a tensor `x` becomes codes `c` of
    an FP8 format and a float32 power-of-two scale `s` with `x ≈ c * s`,
    and the product of codes is accumulated in float32 and multiplied by
    the scales. A recipe says which formats, which scales and how many.

    Args:
        scaling: `"current"` takes each scale from this step's amax (the
            largest absolute value) and keeps no state; `"delayed"` takes
            it from a history of earlier steps' amaxes, kept in
            non-trainable variables of the layer (Transformer Engine's
            recipe; tensorwise only; the first step runs current scaling;
            see `keras_mp/_fp8/delayed.py`). `"static"` is what
            `keras_mp.fp8.freeze` gives a layer for inference: a fixed
            input scale and the kernel stored as FP8 codes and its scale
            (tensorwise; with `formats="mxfp8"`, the kernel's codes and
            E8M0 block scales, with `formats="nvfp4"` its packed E2M1
            codes, E4M3 tile scales and tensor scale, and in both the
            input's scales from each call).
            Defaults to `"current"`.
        granularity: How many values share a scale. `"tensorwise"`: one
            per tensor. `"rowwise"`: one per row of the contracted
            dimension (per token for activations and gradients, per output
            channel for kernels). `"block"`: DeepSeek-V3's tiles, 1x128 for
            activations and output gradients, 128x128 for kernels; the
            GEMM's dimensions must be multiples of 128. `"microblock"`:
            the MX formats' own, 32 values along each GEMM's contracted
            axis (given by `formats="mxfp8"`). `"nvfp4"`: NVFP4's own, 16
            values along each GEMM's contracted axis and 16x16 kernel
            tiles (given by `formats="nvfp4"`). Or the name of a
            quantizer plugged in by `keras_mp._fp8.quantizers.register`
            (current scaling), which then runs the GEMMs. Defaults to
            `None`: the format's own for `"mxfp8"` and `"nvfp4"`,
            `"tensorwise"` otherwise.
        formats: `"hybrid"` (E4M3 for inputs and kernels, E5M2 for output
            gradients, whose range matters more than their precision),
            `"e4m3"` (E4M3 everywhere), or `"mxfp8"` (OCP MXFP8: E4M3
            values in blocks of 32 along each GEMM's contracted axis, each
            block with an E8M0 power-of-two scale, every operand quantized
            from its high-precision source; current scaling, no margin),
            `"mxfp8_hybrid"` (the same with the output gradient's blocks
            in E5M2, scaled to 57344: Transformer Engine's
            `MXFP8BlockScaling(fp8_format=HYBRID)`), or `"nvfp4"`
            (NVIDIA's NVFP4 after Transformer Engine's recipe: E2M1 values
            in blocks of 16 with E4M3 block scales and a float32 tensor
            scale; inputs and output gradients in 1x16
            blocks along each GEMM's contracted axis, the kernel in 16x16
            tiles that serve both of its GEMMs; current scaling, no
            margin; see `keras_mp/_fp8/quantizers/nvfp4.py`).
            Defaults to `"hybrid"`.
        margin: The scale leaves `2**margin` of headroom below the format's
            largest value. Defaults to `0`.
        amax_history: Steps of amax kept with `scaling="delayed"`. Defaults
            to `1024`.
        amax_algo: With `scaling="delayed"`, the scale follows the
            history's `"max"` or its `"most_recent"` entry. Defaults to
            `"max"`.
        stats: Count statistics of each FP8 GEMM inside the training step
            (the amax, flushed and saturated values of its input, kernel
            and output gradient) for `keras_mp.fp8.report`. A layer then
            has one more trainable variable, `fp8_stats`, that the
            optimizer overwrites with each step's statistics (with
            `formats="nvfp4"`: of the E2M1 codes, each value with its
            block's scale over the tensor scale). Defaults to `False` (no
            statistics, no extra work).
        scale_rounding: With `formats="mxfp8"`, how a block's E8M0 scale
            is rounded: `"rceil"`, the power of two at or above
            `amax / 448` (Transformer Engine's, JAX's and torchao's
            training rule; no value clips), or `"floor"`, the OCP
            specification's `2**(floor(log2(amax)) - 8)` (a block whose
            amax has a mantissa above 1.75 clips to 448). Defaults to
            `None`: `"rceil"` for `"mxfp8"`; other formats take no
            rounding (their scales are the power of two at or above
            `amax / fmax`).
        stochastic_rounding: With `formats="nvfp4"`, whether the output
            gradient's E2M1 codes round stochastically in both backward
            GEMMs (Transformer Engine's recipe; the inputs and the kernel
            always round to nearest even). The random bits are a hash of
            the rounded tensor itself: no state, the same bits on every
            backend. Defaults to `None`: `True` for `"nvfp4"`; other
            formats take no such option.
        hadamard: With `formats="nvfp4"`, whether the kernel gradient's
            two operands are rotated by the 16x16 random Hadamard
            transform along the tokens before they are quantized
            (Transformer Engine's wgrad RHT: the product is unchanged,
            each block's outliers spread over 16 values). Defaults to
            `None`: `True` for `"nvfp4"`; other formats take no such
            option.

        high_precision: A GEMM role left unquantized, the others running
            `formats`: `"backward"` (the input- and kernel-gradient GEMMs
            on the unquantized operands, as Transformer Engine's
            `backward_override="high_precision"`) or `"forward"` (the
            forward GEMM; not for `"tensorwise"` and `"block"`, whose
            gradients reuse the forward codes). Current scaling, no
            statistics. Defaults to `None`: every GEMM in FP8.
        save_activations: What a GEMM keeps of its input for the kernel
            gradient. `"input"`: the input itself where the kernel
            gradient quantizes it again along the tokens (rowwise, block,
            MXFP8, NVFP4; tensorwise recipes always keep the forward's
            codes, which its kernel gradient multiplies, at half the bytes
            of a bfloat16 input). `"fp8"`: the forward's codes and scales
            (about half the bytes of a bfloat16 input), dequantized and
            quantized again along the tokens in the backward, as
            DeepSeek-V3 caches its activations: each value the kernel
            gradient multiplies then carries the error of both
            quantizations (at most the forward's rounding error plus half
            a step of the backward's grid). Not for NVFP4, nor with
            `high_precision="forward"`. Defaults to `"input"`.

    Example:

    >>> recipe = keras_mp.fp8.Recipe(granularity="rowwise")
    >>> recipe.granularity, recipe.formats
    ('rowwise', 'hybrid')
    >>> keras_mp.fp8.Recipe.from_config(recipe.get_config()) == recipe
    True
    """

    def __init__(
        self,
        scaling="current",
        granularity=None,
        formats="hybrid",
        margin=0,
        amax_history=1024,
        amax_algo="max",
        stats=False,
        scale_rounding=None,
        stochastic_rounding=None,
        hadamard=None,
        high_precision=None,
        save_activations="input",
        **kwargs,
    ):
        if kwargs:
            raise ValueError(_unknown_fields_message(kwargs))
        check_choice("scaling", scaling, SCALINGS)
        check_choice("formats", formats, FORMATS)
        granularity, stochastic_rounding, hadamard = _check_nv(
            formats,
            granularity,
            scaling,
            margin,
            {"stochastic_rounding": stochastic_rounding, "hadamard": hadamard},
        )
        if formats in NV_FORMATS:
            if scale_rounding is not None:
                raise ValueError(
                    "`scale_rounding` is how an MX block's E8M0 scale is "
                    f"rounded; formats={formats!r} rounds its E4M3 block "
                    "scales to nearest even. Received: scale_rounding="
                    f"{scale_rounding!r}. Leave `scale_rounding` as None."
                )
        else:
            granularity, scale_rounding = _check_mx(
                formats, granularity, scale_rounding, scaling, margin
            )
        check_choice("amax_algo", amax_algo, AMAX_ALGOS)
        self._scaling = scaling
        self._granularity = granularity
        self._formats = formats
        self._margin = _check_int("margin", margin, 0)
        self._amax_history = _check_int("amax_history", amax_history, 1)
        self._amax_algo = amax_algo
        if not isinstance(stats, bool):
            raise TypeError(
                "`stats` is a bool: whether layers count FP8 statistics for "
                f"`keras_mp.fp8.report`. Received: stats={stats!r}. Pass "
                "`stats=True` or `stats=False`."
            )
        self._stats = stats
        self._scale_rounding = scale_rounding
        self._stochastic_rounding = stochastic_rounding
        self._hadamard = hadamard
        self._high_precision = _check_high_precision(
            high_precision, scaling, granularity, formats, stats
        )
        self._save_activations = _check_save_activations(
            save_activations, formats, self._high_precision
        )
        if (
            scaling != "current"
            and granularity != "tensorwise"
            and formats not in MX_FORMATS
            and formats not in NV_FORMATS
            and not (
                scaling == "static" and granularity in PLUGGED_GRANULARITIES
            )
        ):
            raise ValueError(
                f"{scaling.capitalize()} scaling keeps one scale per tensor "
                "(one amax history, as Transformer Engine's delayed "
                "scaling), so it scales whole tensors. "
                f"Received: scaling={scaling!r}, granularity="
                f"{granularity!r}. Use granularity='tensorwise' with "
                f"scaling={scaling!r}, or scaling='current' for rowwise and "
                "block scales."
            )

    scaling = property(lambda self: self._scaling)
    granularity = property(lambda self: self._granularity)
    formats = property(lambda self: self._formats)
    margin = property(lambda self: self._margin)
    amax_history = property(lambda self: self._amax_history)
    amax_algo = property(lambda self: self._amax_algo)
    stats = property(lambda self: self._stats)
    high_precision = property(lambda self: self._high_precision)
    scale_rounding = property(lambda self: self._scale_rounding)
    stochastic_rounding = property(lambda self: self._stochastic_rounding)
    hadamard = property(lambda self: self._hadamard)
    save_activations = property(lambda self: self._save_activations)

    @property
    def forward_format(self):
        """The format of inputs and kernels: `"e4m3"`, or `"e2m1"` for
        NVFP4."""
        return "e2m1" if self._formats in NV_FORMATS else "e4m3"

    @property
    def backward_format(self):
        """The format of output gradients: `"e5m2"` when hybrid (MX
        blocks of E5M2 for `"mxfp8_hybrid"`), `"e2m1"` for NVFP4."""
        if self._formats in NV_FORMATS:
            return "e2m1"
        return "e5m2" if self._formats in ("hybrid", "mxfp8_hybrid") else "e4m3"

    def get_config(self):
        config = {
            "scaling": self._scaling,
            "granularity": self._granularity,
            "formats": self._formats,
            "margin": self._margin,
            "amax_history": self._amax_history,
            "amax_algo": self._amax_algo,
            "stats": self._stats,
        }
        # Only the MX formats have a scale rounding: the configs of the
        # others stay what earlier versions wrote.
        if self._scale_rounding is not None:
            config["scale_rounding"] = self._scale_rounding
        # Likewise NVFP4's options, which only it has.
        if self._stochastic_rounding is not None:
            config["stochastic_rounding"] = self._stochastic_rounding
        if self._hadamard is not None:
            config["hadamard"] = self._hadamard
        if self._high_precision is not None:
            config["high_precision"] = self._high_precision
        # Written only where it is not the default, as the fields above.
        if self._save_activations != "input":
            config["save_activations"] = self._save_activations
        return config

    @classmethod
    def from_config(cls, config):
        _config.check_config(cls, config, required=[], allowed=FIELDS)
        return cls(**config)

    def __eq__(self, other):
        return type(other) is type(self) and (
            other.get_config() == self.get_config()
        )

    def __hash__(self):
        return hash(tuple(sorted(self.get_config().items())))

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"Recipe({fields})"


DEFAULT_RECIPE = Recipe()


def get(recipe):
    """Returns the `Recipe` that `recipe` names: `True` is the default one.

    Args:
        recipe: A `Recipe`, `True`, `None`, or a config dict.

    Returns:
        A `Recipe`, or `None` for `None` and `False`.
    """
    if recipe is None or recipe is False:
        return None
    if recipe is True:
        return DEFAULT_RECIPE
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, dict):
        return Recipe.from_config(recipe)
    raise TypeError(
        "An FP8 recipe is a `keras_mp.fp8.Recipe`, `True` (the default "
        f"recipe), `None`, or a Recipe config dict. Received: fp8={recipe!r}"
    )

"""`Recipe`: how a GEMM runs in FP8, as a plain serializable value.

A recipe says which FP8 formats the operands take, how their scales are
chosen and at what granularity, as Transformer Engine's
`transformer_engine.common.recipe` does, without tying it to one framework.
The values each field takes, and the checks of one field against the
others, are `recipe_fields.py`'s.
"""

import keras

from keras_mp import _config
from keras_mp._fp8.recipe_fields import AMAX_ALGOS
from keras_mp._fp8.recipe_fields import FIELDS
from keras_mp._fp8.recipe_fields import FORMATS
from keras_mp._fp8.recipe_fields import MX_FORMATS
from keras_mp._fp8.recipe_fields import NV_FORMATS
from keras_mp._fp8.recipe_fields import PLUGGED_GRANULARITIES
from keras_mp._fp8.recipe_fields import SCALINGS
from keras_mp._fp8.recipe_fields import check_choice
from keras_mp._fp8.recipe_fields import check_high_precision
from keras_mp._fp8.recipe_fields import check_int
from keras_mp._fp8.recipe_fields import check_mx
from keras_mp._fp8.recipe_fields import check_nv
from keras_mp._fp8.recipe_fields import check_save_activations
from keras_mp._fp8.recipe_fields import unknown_fields_message


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
            raise ValueError(unknown_fields_message(kwargs))
        check_choice("scaling", scaling, SCALINGS)
        check_choice("formats", formats, FORMATS)
        granularity, stochastic_rounding, hadamard = check_nv(
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
            granularity, scale_rounding = check_mx(
                formats, granularity, scale_rounding, scaling, margin
            )
        check_choice("amax_algo", amax_algo, AMAX_ALGOS)
        self._scaling = scaling
        self._granularity = granularity
        self._formats = formats
        self._margin = check_int("margin", margin, 0)
        self._amax_history = check_int("amax_history", amax_history, 1)
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
        self._high_precision = check_high_precision(
            high_precision, scaling, granularity, formats, stats
        )
        self._save_activations = check_save_activations(
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

"""`DEFAULT_RULES`: which layers compute their GEMMs in FP8, and which cannot.

`keras_mp.set_global_policy(policy, fp8=recipe)` gives the recipe to the
layers these rules select; the checks here also refuse a recipe given to a
layer that has no GEMM, or a `"block"` recipe given to a GEMM whose
dimensions do not divide into its tiles. Only Keras's public API is used
here; `keras_mp.precision` (floor 4) applies the rules to a model's layers.
Imports nothing from keras_mp but `_fp8/recipe.py` and
`_fp8/recipe_fields.py`.
"""

import math

import keras

from keras_mp._fp8 import recipe as recipe_module
from keras_mp._fp8.recipe_fields import check_int


def has_gemm(layer):
    """Whether `layer` runs its GEMM through keras_mp's FP8 path.

    That is a `keras.layers.Dense` or `keras.layers.EinsumDense` whose
    `call` is the class's own: a subclass that replaces `call` computes
    what it likes, which keras_mp cannot route.
    """
    return any(
        isinstance(layer, cls) and type(layer).call is cls.call
        for cls in (keras.layers.Dense, keras.layers.EinsumDense)
    )


def gemm_dims(layer):
    """`(K, N)` of a built layer's GEMM: contracted and output sizes.

    A Dense kernel is `(K, N)`. An EinsumDense kernel's axes that its
    input shares are contracted (their product is K), the others are
    outputs (their product is N), as the GEMM that computes the einsum
    sees them.
    """
    shape = tuple(int(size) for size in layer.kernel.shape)
    if isinstance(layer, keras.layers.EinsumDense):
        inputs, _, rest = layer.equation.partition(",")
        kernel_axes = rest.partition("->")[0]
        contracted = [s for a, s in zip(kernel_axes, shape) if a in inputs]
        outputs = [s for a, s in zip(kernel_axes, shape) if a not in inputs]
        return math.prod(contracted), math.prod(outputs)
    return shape[0], shape[-1]


def _dims_text(dims):
    return "x".join(str(size) for size in dims)


class Rules:
    """Which layers `set_global_policy(..., fp8=recipe)` gives FP8 GEMMs.

    Every `Dense` and `EinsumDense` (`MultiHeadAttention`'s projections
    included) whose GEMM dimensions are multiples of `multiple`
    (`block_multiple` for a `"block"` recipe, `mx_multiple` for an MX
    format's), except the layers that
    produce a Sequential or functional model's outputs: the logits, which
    a loss reads, keep the compute dtype, as embeddings do (an `Embedding`
    has no GEMM). FP8 tensor cores and `torch._scaled_mm` need dimensions
    that are multiples of 16; a smaller or ragged GEMM gains nothing.

    Args:
        multiple: The GEMM's K and N must be multiples of it. Defaults to
            `16`.
        block_multiple: The same for a `"block"` recipe, whose kernel
            tiles are 128x128. Defaults to `128`.
        mx_multiple: The same for `formats="mxfp8"`, whose blocks are 32
            values along each GEMM's contracted axis (K for the forward
            GEMM, N for the input gradient). Defaults to `32`.
        nvfp4_multiple: The same for `formats="nvfp4"`, whose kernel tiles
            are 16x16 (16 values along K for the forward GEMM, along N for
            the input gradient). Defaults to `16`.
        nvfp4_high_precision_first: Under `formats="nvfp4"`, how many of a
            model's first blocks keep their GEMMs in the compute dtype
            (Megatron's `--first-last-layers-bf16`). A block is a layer that
            a model holds directly (a `Dense` of a `Sequential`, a
            transformer layer of a keras-hub backbone), counted in the
            order the model tracks its layers (a functional model's: the
            order its graph computes them), and only where one of its
            `Dense` / `EinsumDense` layers (itself or one inside it) would
            otherwise run NVFP4 (not an output layer, not given a policy
            by a precision rule, dimensions multiples of `nvfp4_multiple`).
            Decided once, when the model is built. Defaults to `1`.
        nvfp4_high_precision_last: The same for the model's last blocks.
            Defaults to `1`.

    Example:

    >>> rules = keras_mp.fp8.DEFAULT_RULES
    >>> layer = keras.layers.Dense(3)
    >>> layer.build((None, 10))
    >>> rules.skip_reason(layer, keras_mp.fp8.DEFAULT_RECIPE)
    'dims 10x3 not multiples of 16'
    """

    def __init__(
        self,
        multiple=16,
        block_multiple=128,
        mx_multiple=32,
        nvfp4_multiple=16,
        nvfp4_high_precision_first=1,
        nvfp4_high_precision_last=1,
    ):
        for name, value, minimum in (
            ("multiple", multiple, 1),
            ("block_multiple", block_multiple, 1),
            ("mx_multiple", mx_multiple, 1),
            ("nvfp4_multiple", nvfp4_multiple, 1),
            ("nvfp4_high_precision_first", nvfp4_high_precision_first, 0),
            ("nvfp4_high_precision_last", nvfp4_high_precision_last, 0),
        ):
            check_int(name, value, minimum)
        self._multiple = int(multiple)
        self._block_multiple = int(block_multiple)
        self._mx_multiple = int(mx_multiple)
        self._nvfp4_multiple = int(nvfp4_multiple)
        self._nvfp4_first = int(nvfp4_high_precision_first)
        self._nvfp4_last = int(nvfp4_high_precision_last)

    multiple = property(lambda self: self._multiple)
    block_multiple = property(lambda self: self._block_multiple)
    mx_multiple = property(lambda self: self._mx_multiple)
    nvfp4_multiple = property(lambda self: self._nvfp4_multiple)
    nvfp4_high_precision_first = property(lambda self: self._nvfp4_first)
    nvfp4_high_precision_last = property(lambda self: self._nvfp4_last)

    def required_multiple(self, recipe):
        """The multiple a GEMM's dimensions need under `recipe`."""
        if recipe.granularity == "block":
            return self._block_multiple
        if recipe.granularity == "microblock":
            return self._mx_multiple
        if recipe.granularity == "nvfp4":
            return self._nvfp4_multiple
        return self._multiple

    def high_precision_blocks(self, recipe, count):
        """`{index: "first" or "last"}`: which of a model's `count` blocks
        (those whose GEMMs would run `recipe`, in order) keep their GEMMs
        in the compute dtype; none but under `formats="nvfp4"`. A block
        among both the first and the last ones is a first one."""
        if recipe.formats != "nvfp4":
            return {}
        last = range(max(count - self._nvfp4_last, 0), count)
        positions = {index: "last" for index in last}
        positions.update(
            {index: "first" for index in range(min(self._nvfp4_first, count))}
        )
        return positions

    def high_precision_reason(self, recipe, position, compute_dtype):
        """The reason `explain_precision` shows for a GEMM of a first or
        last block: `"nvfp4: first block kept in bfloat16"`."""
        count = self._nvfp4_first if position == "first" else self._nvfp4_last
        blocks = "block" if count == 1 else f"{count} blocks"
        return f"{recipe.formats}: {position} {blocks} kept in {compute_dtype}"

    def skip_reason(self, layer, recipe, is_output=False, boundary=None):
        """Why these rules give `layer` no FP8 recipe, or None if they do.

        Args:
            layer: A Keras layer. Its dimensions are checked once built.
            recipe: The `Recipe` the rules would give it.
            is_output: Whether the layer produces the model's outputs.
                Defaults to `False`.
            boundary: The reason of a GEMM of a first or last block
                (`high_precision_reason`), where it is in one. Defaults to
                `None`.

        Returns:
            None, or a short reason: `"embedding"`, `"no GEMM"`,
            `"output layer"`, `"dims 10x3 not multiples of 16"`,
            `"nvfp4: first block kept in bfloat16"`.
        """
        if isinstance(layer, keras.layers.Embedding):
            return "embedding"
        if not has_gemm(layer):
            return "no GEMM"
        if is_output:
            return "output layer"
        if layer.built:
            dims = gemm_dims(layer)
            multiple = self.required_multiple(recipe)
            if any(size % multiple for size in dims):
                return f"dims {_dims_text(dims)} not multiples of {multiple}"
        return boundary

    def __repr__(self):
        return (
            f"Rules(multiple={self._multiple}, "
            f"block_multiple={self._block_multiple}, "
            f"mx_multiple={self._mx_multiple}, "
            f"nvfp4_multiple={self._nvfp4_multiple}, "
            f"nvfp4_high_precision_first={self._nvfp4_first}, "
            f"nvfp4_high_precision_last={self._nvfp4_last})"
        )


DEFAULT_RULES = Rules()


def check_layer(layer, recipe):
    """Raises ValueError when `layer` cannot take `recipe` as it was asked.

    A recipe given explicitly (a `dtype=` argument, a precision rule, a
    `DTypePolicyMap` entry) to a layer without a GEMM, or a `"block"`
    recipe given to a built layer whose GEMM dimensions are not multiples
    of 128, is an error: the default rules skip such layers instead.
    """
    recipe = recipe_module.get(recipe)
    if recipe is None:
        return
    name = type(layer).__name__
    if not has_gemm(layer):
        raise ValueError(
            f"Layer {layer.name!r} ({name}) has no GEMM that FP8 could run: "
            "only Dense and EinsumDense layers (with their own `call`) take "
            f"a policy with an FP8 recipe. Received: fp8={recipe!r}. Give "
            "this layer a policy without `fp8`, e.g. select "
            "`(keras.layers.Dense, keras.layers.EinsumDense)` in "
            "`keras_mp.precision_rules`, or use `keras_mp.set_global_policy("
            "policy, fp8=recipe)`, whose rules pick the layers."
        )
    if (
        recipe.granularity not in ("block", "microblock", "nvfp4")
        or recipe.scaling == "static"
        or not layer.built
    ):
        return
    dims = gemm_dims(layer)
    multiple = DEFAULT_RULES.required_multiple(recipe)
    blocks = {
        "block": "128x128 tiles of granularity='block'",
        "microblock": f"blocks of 32 of formats={recipe.formats!r}",
        "nvfp4": f"16x16 tiles of formats={recipe.formats!r}",
    }[recipe.granularity]
    if any(size % multiple for size in dims):
        raise ValueError(
            f"Layer {layer.name!r} ({name}) has GEMM dimensions "
            f"{_dims_text(dims)}, not multiples of {multiple}, so its "
            f"kernel does not divide into the {blocks}. Received: "
            f"fp8={recipe!r}. Use granularity='rowwise' or 'tensorwise' "
            "for this layer, or make its dimensions multiples of "
            f"{multiple}."
        )

"""`dot`: `x @ kernel` whose three GEMMs all take FP8 operands.

The forward product, the input gradient `dx = g @ kernel^T` and the kernel
gradient `dw = x^T @ g` each quantize their two operands (`quantize.py`),
multiply the codes with float32 accumulation (`keras_mp.backend.fp8`), and
multiply by the scales after: per tensor, per row of the contracted axis,
or, for DeepSeek-V3's blocks, per 128-long chunk of the contracted axis,
each chunk's partial product times its own scales before the chunks are
summed. Scales are powers of two, so multiplying by them is exact and a
loss scale passes through the backward GEMMs without changing a code.
Given a statistics carrier (`stats.py`), the custom gradient also returns
the statistics of the quantizations as the carrier's gradient.

Imports only `keras_mp.backend` and its `keras_mp.fp8` siblings.
"""

import collections

import keras
from keras import ops

from keras_mp.backend import fp8 as fp8_backend
from keras_mp.backend import gradients as backend_gradients
from keras_mp.fp8 import delayed as delayed_module
from keras_mp.fp8 import recipe as recipe_module
from keras_mp.fp8 import stats as stats_module
from keras_mp.fp8.quantize import check_float
from keras_mp.fp8.quantize import quantize_reduced
from keras_mp.fp8.quantize import scale_from_amax
from keras_mp.fp8.recipe import BLOCK_SIZE

# The layouts of a 2-D operand (`gemm_operands`): row-major, for the GEMM
# that takes it as its A (or its transpose as B), and column-major, for
# the one that takes it as B (or its transpose as A).
_ROW = ("row",)
_BOTH = ("row", "column")


def _operand(x, fmt, axes, margin, scale=None, layouts=_ROW):
    """`x` quantized as GEMM operands, one per layout, and its scales."""
    return quantize_reduced(x, fmt, axes, margin, scale, layouts)


def _kernel_operand(w, fmt, axes, margin, layouts, shape=None):
    """`_operand` of the kernel (reshaped to `shape`, where given),
    computed once while the kernel is unchanged
    (`keras_mp.backend.fp8.reuse`: on PyTorch, once per optimizer step
    however many calls and micro-steps share it). Current scaling only:
    the codes then depend on the kernel alone."""

    def compute():
        tensor = w if shape is None else ops.reshape(w, shape)
        return _operand(tensor, fmt, axes, margin, None, layouts)

    key = ("kernel", fmt, axes, margin, layouts, shape)
    return fp8_backend.reuse(w, key, compute)


def _delayed_scale(scaling, index, t, fmt, margin, rows):
    """The scale of tensor `index` of a delayed call (`delayed.pick`), or
    None for current scaling. Its amax is kept in `rows` for `_observe`:
    a side output of the step, which no cast waits for where the step is
    compiled (JAX, TensorFlow): there the first step's current scale
    reduces `t` again, inside its own branch, so the cast of a later step
    reads the stored scale alone and XLA may fuse the amax beside it (one
    read of `t`). PyTorch runs op by op: a branch would read the flag on
    the host, so it selects, and reuses the amax."""
    if scaling is None:
        return None
    amax = fp8_backend.amax(t, None)
    rows.amaxes[index] = amax
    if fp8_backend.branches_on_host():
        current = lambda: scale_from_amax(amax, fmt, margin)  # noqa: E731
    else:
        current = lambda: scale_from_amax(  # noqa: E731
            fp8_backend.amax(t, None), fmt, margin
        )
    scale = delayed_module.pick(
        scaling, index, current, not fp8_backend.branches_on_host()
    )
    return ops.reshape(scale, ops.shape(amax))


class _Rows(dict):
    """The statistics rows of one call, by tensor; `counts`: whether they
    count flushed and saturated values (statistics asked for), or hold
    the amax alone (delayed scaling's); `amaxes`: amaxes already known."""

    def __init__(self, counts=True):
        super().__init__()
        self.counts = counts
        self.amaxes = {}


class _Dtypes(collections.namedtuple("_Dtypes", "out dx dw")):
    """The dtypes the forward product and the two gradients are cast to:
    a GEMM whose result is cast to bfloat16 may round to it itself."""


def _observe(rows, name, x, scale, fmt):
    """Records the statistics row of one quantization, when `rows` (a
    `_Rows`) asks for them; nothing at all when it is None."""
    if rows is not None:
        index = stats_module.TENSORS.index(name)
        rows[name] = stats_module.tensor_row(
            x, scale, fmt, rows.counts, rows.amaxes.get(index)
        )


def _scaled(product, factor):
    """A GEMM's product (float32, or bfloat16 where its result is cast to
    bfloat16: `einsum_float32`) times float32 power-of-two scales, in
    float32: exact wherever the result is a normal number, so a bfloat16
    product gives the bits of the float32 one, rounded. Tensorwise scales
    go to `scaled_einsum` instead, as one factor (`sx * sw`: exact, one
    pass less, and a scale a GEMM can take)."""
    return ops.cast(product, "float32") * factor


def _tensorwise(x, w, recipe, rows, dtypes, scaling=None):
    """One scale per tensor; the forward codes serve the backward GEMMs,
    each operand written in both layouts in one pass where the GEMM cares
    (PyTorch). The scales are one factor, which a GEMM may take itself
    (`scaled_einsum`). With a delayed `scaling`, the scales are its own."""
    forward, backward, margin = _formats(recipe)
    sx = _delayed_scale(scaling, 0, x, forward, margin, rows)
    sw = _delayed_scale(scaling, 1, w, forward, margin, rows)
    (cx, cx_column), sx = _operand(x, forward, None, margin, sx, _BOTH)
    if scaling is None:
        (cw, cw_column), sw = _kernel_operand(w, forward, None, margin, _BOTH)
    else:
        (cw, cw_column), sw = _operand(w, forward, None, margin, sw, _BOTH)
    _observe(rows, "input", x, sx, forward)
    _observe(rows, "kernel", w, sw, forward)
    # Fast accumulation in the forward GEMM only, as Transformer Engine
    # and torchao: the gradients keep the full accumulation.
    out = fp8_backend.scaled_einsum(
        "mk,kn->mn", cx, cw_column, sx * sw, dtypes.out, True
    )

    def gradients(g):
        sg = _delayed_scale(scaling, 2, g, backward, margin, rows)
        (cg, cg_column), sg = _operand(g, backward, None, margin, sg, _BOTH)
        _observe(rows, "output_gradient", g, sg, backward)
        dx = fp8_backend.scaled_einsum("mn,kn->mk", cg, cw, sg * sw, dtypes.dx)
        dw = fp8_backend.scaled_einsum(
            "mk,mn->kn", cx_column, cg_column, sx * sg, dtypes.dw
        )
        return dx, dw

    return out, gradients


def _rowwise(x, w, recipe, rows, dtypes):
    """One scale per row of each GEMM's contracted axis: each operand is
    quantized again for each GEMM it enters along another axis, in the
    layout that GEMM takes it in."""
    forward, backward, margin = _formats(recipe)
    (cx,), sx = _operand(x, forward, 1, margin)  # (M, 1)
    (cw,), sw = _kernel_operand(w, forward, 0, margin, ("column",))  # (1, N)
    _observe(rows, "input", x, sx, forward)
    _observe(rows, "kernel", w, sw, forward)
    product = fp8_backend.einsum_float32("mk,kn->mn", cx, cw, dtypes.out)
    out = _scaled(product, sx) * sw

    def gradients(g):
        (cg,), sg = _operand(g, backward, 1, margin)  # (M, 1)
        _observe(rows, "output_gradient", g, sg, backward)
        (cw_n,), sw_n = _kernel_operand(w, forward, 1, margin, _ROW)  # (K, 1)
        dx = fp8_backend.einsum_float32("mn,kn->mk", cg, cw_n, dtypes.dx)
        dx = _scaled(dx, sg) * ops.transpose(sw_n)
        # (1, K) and (1, N): x^T is the A of the kernel gradient, g its B.
        (cx_m,), sx_m = _operand(x, forward, 0, margin, layouts=("column",))
        (cg_m,), sg_m = _operand(g, backward, 0, margin, layouts=("column",))
        dw = fp8_backend.einsum_float32("mk,mn->kn", cx_m, cg_m, dtypes.dw)
        dw = _scaled(dw, ops.transpose(sx_m)) * sg_m
        return dx, dw

    return out, gradients


def _pad_rows(t):
    """`t` with zero rows appended up to a multiple of `BLOCK_SIZE`: a
    zero changes no tile's amax and no sum."""
    rows = ops.shape(t)[0]
    pad = -rows % BLOCK_SIZE
    if isinstance(rows, int):
        return ops.pad(t, ((0, pad), (0, 0))) if pad else t
    # A TensorFlow graph of unknown batch size: `pad` is a tensor.
    return ops.concatenate([t, ops.zeros((pad, t.shape[1]), t.dtype)], 0)


def _sum_tiles(partials):
    """The sum over the leading (tile) axis, in float32. Slice by slice
    where the number of tiles is static: XLA's CPU reduction over a
    leading axis of a broadcast product runs 6x slower than the adds."""
    tiles = partials.shape[0]
    if tiles is None:
        return ops.sum(partials, axis=0)
    total = partials[0]
    for tile in range(1, tiles):
        total = total + partials[tile]
    return total


def _block(x, w, recipe, rows, dtypes):
    """DeepSeek-V3's tiles: 1x128 along the contracted axis for
    activations and output gradients (128x1, 128 tokens, for the kernel
    gradient), 128x128 for the kernel. Each 128-chunk of the contracted
    axis gives a partial product, multiplied by its own scales, and the
    chunks are summed in float32."""
    forward, backward, margin = _formats(recipe)
    k, n = w.shape
    tiles_k, tiles_n = k // BLOCK_SIZE, n // BLOCK_SIZE
    tiled_x = ops.reshape(x, (-1, tiles_k, BLOCK_SIZE))
    tiles = (tiles_k, BLOCK_SIZE, tiles_n, BLOCK_SIZE)
    tiled_w = ops.reshape(w, tiles)
    (cx,), sx = _operand(tiled_x, forward, 2, margin)  # (M, tiles_k, 1)
    # sw: (tiles_k, 1, tiles_n, 1)
    (cw,), sw = _kernel_operand(w, forward, (1, 3), margin, _ROW, tiles)
    _observe(rows, "input", tiled_x, sx, forward)
    _observe(rows, "kernel", tiled_w, sw, forward)
    partial = fp8_backend.einsum_float32("mtb,tbjc->tmjc", cx, cw)
    sx_t = ops.expand_dims(ops.transpose(sx, (1, 0, 2)), -1)
    out = ops.reshape(_sum_tiles(partial * sx_t * sw), (-1, n))

    def gradients(g):
        tiled_g = ops.reshape(g, (-1, tiles_n, BLOCK_SIZE))
        (cg,), sg = _operand(tiled_g, backward, 2, margin)  # (M, n/128, 1)
        _observe(rows, "output_gradient", tiled_g, sg, backward)
        partial = fp8_backend.einsum_float32("mjc,tbjc->jmtb", cg, cw)
        sg_t = ops.expand_dims(ops.transpose(sg, (1, 0, 2)), -1)
        sw_t = ops.transpose(sw, (2, 1, 0, 3))
        dx = ops.reshape(_sum_tiles(partial * sg_t * sw_t), (-1, k))
        # The kernel gradient contracts the tokens: tiles of 128 tokens.
        (cx_m,), sx_m = _operand(
            ops.reshape(_pad_rows(x), (-1, BLOCK_SIZE, k)), forward, 1, margin
        )  # sx_m: (tiles_m, 1, K)
        (cg_m,), sg_m = _operand(
            ops.reshape(_pad_rows(g), (-1, BLOCK_SIZE, n)), backward, 1, margin
        )  # sg_m: (tiles_m, 1, N)
        partial = fp8_backend.einsum_float32("sbk,sbn->skn", cx_m, cg_m)
        sx_m = ops.transpose(sx_m, (0, 2, 1))
        dw = _sum_tiles(partial * sx_m * sg_m)
        return dx, dw

    return out, gradients


_GRANULARITIES = {
    "tensorwise": _tensorwise,
    "rowwise": _rowwise,
    "block": _block,
}


def _formats(recipe):
    return recipe.forward_format, recipe.backward_format, recipe.margin


def _check_operands(x, kernel, recipe, output_dtype, delayed=None):
    if recipe.scaling != "current" and delayed is None:
        raise ValueError(
            "`fp8.dot` takes its scales from the operands of this step "
            '(scaling="current"); delayed scales live in an FP8 layer\'s '
            f"state. Received: recipe={recipe!r}. Use "
            'keras_mp.fp8.Recipe(scaling="current", ...).'
        )
    x_dtype = check_float("x", x)
    kernel_dtype = check_float("kernel", kernel)
    if len(kernel.shape) != 2 or len(x.shape) < 1:
        raise ValueError(
            "`fp8.dot` multiplies x[..., K] by a 2-D kernel[K, N]. Received: "
            f"x.shape={tuple(x.shape)}, kernel.shape={tuple(kernel.shape)}. "
            "Use `fp8.einsum` for other contractions."
        )
    k, n = kernel.shape
    if x.shape[-1] is not None and k is not None and x.shape[-1] != k:
        raise ValueError(
            "The last dimension of `x` is the first of `kernel`. Received: "
            f"x.shape={tuple(x.shape)}, kernel.shape={tuple(kernel.shape)}"
        )
    if recipe.granularity == "block" and any(
        d is None or d % BLOCK_SIZE for d in (k, n)
    ):
        raise ValueError(
            f'granularity="block" tiles the kernel in {BLOCK_SIZE}x'
            f"{BLOCK_SIZE} blocks, so both of its dimensions must be "
            f"multiples of {BLOCK_SIZE}. Received: kernel.shape={(k, n)}. "
            'Use keras_mp.fp8.Recipe(granularity="rowwise"), or pad the '
            f"kernel's dimensions to multiples of {BLOCK_SIZE}."
        )
    if output_dtype is None:
        return x_dtype, kernel_dtype, x_dtype
    output_dtype = keras.backend.standardize_dtype(output_dtype)
    if output_dtype not in ("float16", "bfloat16", "float32", "float64"):
        raise ValueError(
            "`output_dtype` is a floating point dtype. Received: "
            f"output_dtype={output_dtype!r}. Pass e.g. 'float32', or None "
            "for the dtype of `x`."
        )
    return x_dtype, kernel_dtype, output_dtype


def dot(x, kernel, recipe=None, output_dtype=None, stats=None, delayed=None):
    """`x @ kernel` with FP8 operands in the forward and backward GEMMs.

    The forward product quantizes `x` and `kernel` to E4M3; the gradient
    of the output is quantized to the recipe's backward format (E5M2 for
    `formats="hybrid"`). The input gradient `g @ kernel^T` and the kernel
    gradient `x^T @ g` each take their operands quantized along their own
    contracted axis (`"rowwise"`, `"block"`); `"tensorwise"` reuses the
    forward codes. Every product of codes is exact and accumulated in
    float32 (on a CPU; a GPU's FP8 tensor cores accumulate with fewer bits,
    see `keras_mp.backend.fp8`); the power-of-two scales multiply the
    float32 result (per 128-chunk of the contracted axis for `"block"`,
    before the chunks are summed). Each scale comes from this call's
    operands (`"current"` scaling): no state. A non-finite value in `x`,
    `kernel` or the output gradient keeps its GEMM's result non-finite, so
    a loss-scale skip sees it.

    Args:
        x: A floating point tensor `[..., K]`.
        kernel: A floating point tensor `[K, N]`. With
            `granularity="block"`, `K` and `N` are multiples of 128.
        recipe: A `keras_mp.fp8.Recipe` with `scaling="current"`, `True`
            or a config dict. Defaults to `None`, the default recipe
            (tensorwise, hybrid).
        output_dtype: The dtype of the result. Defaults to `None`, the
            dtype of `x`. Gradients take the dtypes of `x` and `kernel`.
        stats: A float32 "carrier" of shape `(3, 515)` (an FP8 layer's
            `fp8_stats` variable, read), or None. Its value is ignored; its
            gradient is the statistics of this call's quantizations of the
            input, the kernel and the output gradient (see
            `keras_mp/fp8/stats.py`). Defaults to `None`: no statistics and
            no work for them.
        delayed: For `scaling="delayed"` only, what an FP8 layer's state
            gives this call (`keras_mp.fp8.delayed.Scaling`); `stats` is
            then the layer's carrier, of shape `(3, 518)`, whose gradient
            also takes the parity of its fold count. Defaults to `None`.

    Returns:
        A tensor `[..., N]`.

    Example:

    >>> x = np.ones((2, 16), "float32")
    >>> kernel = np.full((16, 4), 0.5, "float32")
    >>> y = keras_mp.fp8.dot(x, kernel)
    >>> keras.ops.convert_to_numpy(y).tolist()[0]
    [8.0, 8.0, 8.0, 8.0]
    """
    if recipe is None:
        recipe = recipe_module.DEFAULT_RECIPE
    recipe = recipe_module.get(recipe)
    if recipe is None:
        raise TypeError(
            "`fp8.dot` needs a recipe. Received: recipe=False. Pass a "
            "`keras_mp.fp8.Recipe`, or None for the default one."
        )
    x = fp8_backend.read_tensor(x)
    kernel = fp8_backend.read_tensor(kernel)
    x_dtype, kernel_dtype, output_dtype = _check_operands(
        x, kernel, recipe, output_dtype, delayed
    )
    k, n = kernel.shape
    run = _GRANULARITIES[recipe.granularity]

    dtypes = _Dtypes(output_dtype, x_dtype, kernel_dtype)

    def forward(x, kernel, rows, scaling=None):
        x_shape = ops.shape(x)
        x2 = ops.reshape(ops.cast(x, "float32"), (-1, k))
        kernel = ops.cast(kernel, "float32")
        if scaling is None:
            out, gradients = run(x2, kernel, recipe, rows, dtypes)
        else:
            out, gradients = _tensorwise(
                x2, kernel, recipe, rows, dtypes, scaling
            )
        out = ops.reshape(out, (*x_shape[:-1], n))

        def backward(args, upstream):
            # TensorFlow and JAX pass the output gradient alone; PyTorch
            # passes the inputs, and the output gradient by name.
            if upstream is None:
                (upstream,) = args
            g = ops.reshape(ops.cast(upstream, "float32"), (-1, n))
            dx, dw = gradients(g)
            dx = ops.cast(ops.reshape(dx, x_shape), x_dtype)
            return dx, ops.cast(dw, kernel_dtype)

        return ops.cast(out, output_dtype), backward

    if stats is None:

        @ops.custom_gradient
        def fp8_dot(x, kernel):
            out, backward = forward(x, kernel, None)

            def grad(*args, upstream=None):
                return backward(args, upstream)

            return out, grad

        return fp8_dot(x, kernel)

    if delayed is not None:
        return _delayed_dot(x, kernel, stats, delayed, forward, recipe)

    stats = _check_stats(fp8_backend.read_tensor(stats))

    @ops.custom_gradient
    def fp8_dot_with_stats(x, kernel, stats):
        rows = _Rows()
        out, backward = forward(x, kernel, rows)

        def grad(*args, upstream=None):
            dx, dw = backward(args, upstream)
            # Filled by `backward` with the output gradient's row.
            statistics = ops.stack([rows[t] for t in stats_module.TENSORS])
            return dx, dw, _across_replicas(statistics)

        return out, grad

    return fp8_dot_with_stats(x, kernel, stats)


def _across_replicas(carrier_gradient):
    """The element-wise max of a carrier's gradient over tf.distribute's
    replicas (as is elsewhere): every replica's optimizer then assigns
    the bins of the global batch, whichever replica's it keeps (Keras's
    keeps one replica's overwritten gradients)."""
    return backend_gradients.all_reduce_max([carrier_gradient])[0]


def _delayed_dot(x, kernel, carrier, scaling, forward, recipe):
    carrier = _check_stats(
        fp8_backend.read_tensor(carrier), delayed_module.CARRIER_SHAPE
    )
    packed = delayed_module.pack(scaling)

    @ops.custom_gradient
    def fp8_dot_delayed(x, kernel, carrier, packed):
        rows = _Rows(counts=recipe.stats)
        scaling = delayed_module.unpack(packed)
        out, backward = forward(x, kernel, rows, scaling)

        def grad(*args, upstream=None):
            dx, dw = backward(args, upstream)
            statistics = ops.stack([rows[t] for t in stats_module.TENSORS])
            carrier = delayed_module.carrier_gradient(statistics, scaling)
            return dx, dw, _across_replicas(carrier), ops.zeros_like(packed)

        return out, grad

    return fp8_dot_delayed(x, kernel, carrier, packed)


def _check_stats(stats, shape=stats_module.SHAPE):
    if (
        tuple(stats.shape) != shape
        or keras.backend.standardize_dtype(stats.dtype) != "float32"
    ):
        raise ValueError(
            f"`stats` is a float32 carrier of shape {shape}, as an FP8 "
            "layer with `keras_mp.fp8.Recipe(stats=True)` (or "
            "`scaling='delayed'`) owns. "
            f"Received: stats of shape {tuple(stats.shape)} and dtype "
            f"{stats.dtype}. Pass the layer's `fp8_stats` variable, or None."
        )
    return stats

"""`dot`: `x @ kernel` whose three GEMMs all take FP8 operands.

The forward product, the input gradient `dx = g @ kernel^T` and the kernel
gradient `dw = x^T @ g` each quantize their two operands, as the recipe's
quantizer (`quantizers/`) does for that GEMM's role, multiply the codes
with float32 accumulation (`keras_mp.backend.fp8`), and multiply by the
scales after: per tensor, per row of the contracted axis,
or, for DeepSeek-V3's blocks, per 128-long chunk of the contracted axis,
each chunk's partial product times its own scales before the chunks are
summed. Scales are powers of two, so multiplying by them is exact and a
loss scale passes through the backward GEMMs without changing a code.
Given a statistics carrier (`stats.py`), the custom gradient also returns
the statistics of the quantizations as the carrier's gradient.
"""

import math

import keras
from keras import ops

from keras_mp._fp8 import delayed as delayed_module
from keras_mp._fp8 import quantizers
from keras_mp._fp8 import recipe as recipe_module
from keras_mp._fp8 import recipe_fields
from keras_mp._fp8 import stats as stats_module
from keras_mp._fp8.formats.e4m3_e5m2 import check_float
from keras_mp.backend import fp8 as fp8_backend
from keras_mp.backend import gradients as backend_gradients
from keras_mp.backend.torch import ops as torch_ops


def _check_operands(x, kernel, recipe, output_dtype, delayed=None):
    # A frozen NVFP4 layer's recipe (`scaling="static"`): its kernel
    # holds NVFP4 values already, and each call's input is scaled anew.
    frozen_nv = (
        recipe.scaling == "static"
        and recipe.formats in recipe_fields.NV_FORMATS
    )
    if recipe.scaling != "current" and delayed is None and not frozen_nv:
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
    quantizers.get(recipe).check((k, n), recipe)
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
            (tensorwise, hybrid). `Recipe(formats="nvfp4",
            scaling="static")` is a frozen NVFP4 layer's: `kernel` then
            holds the dequantized values of its 16x16 tiles (as
            `keras_mp.fp8.freeze` stored them), which no GEMM quantizes
            again.
        output_dtype: The dtype of the result. Defaults to `None`, the
            dtype of `x`. Gradients take the dtypes of `x` and `kernel`.
        stats: A float32 "carrier" of shape `(3, 515)` (an FP8 layer's
            `fp8_stats` variable, read), or None. Its value is ignored; its
            gradient is the statistics of this call's quantizations of the
            input, the kernel and the output gradient (see
            `keras_mp/_fp8/stats.py`). Defaults to `None`: no statistics and
            no work for them.
        delayed: For `scaling="delayed"` only, what an FP8 layer's state
            gives this call (`keras_mp._fp8.delayed.Scaling`); `stats` is
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
    quantizer = quantizers.get(recipe)
    dtypes = quantizers.Dtypes(output_dtype, x_dtype, kernel_dtype)

    def operand(t):
        """2-D `t` as the quantizer takes it: float32, or as it is where
        the quantizer and backend read bfloat16 and float16 values
        themselves (each made float32 inside their passes: exact)."""
        if quantizer.reads_16bit and fp8_backend.reads_16bit(t):
            return t
        return torch_ops.cast(t, "float32")

    def forward(x, kernel, rows, scaling=None):
        x_shape = ops.shape(x)
        source_x = torch_ops.reshape(x, (-1, k))
        x2 = operand(source_x)
        kernel = torch_ops.cast(kernel, "float32")
        call = quantizers.Call(recipe, rows, dtypes, scaling, source_x)
        out = quantizer.forward(call, x2, kernel)
        call.end_forward(keep_input=quantizer.keeps_input(call))
        out = torch_ops.reshape(out, (*x_shape[:-1], n))

        def backward(args, upstream):
            # TensorFlow and JAX pass the output gradient alone; PyTorch
            # (`backend/gradients.custom_gradient`) passes it by name.
            if upstream is None:
                (upstream,) = args
            g = operand(torch_ops.reshape(upstream, (-1, n)))
            dx = quantizer.input_gradient(call, g)
            dw = quantizer.kernel_gradient(call, g)
            call.end_backward()
            dx = torch_ops.cast(torch_ops.reshape(dx, x_shape), x_dtype)
            return dx, torch_ops.cast(dw, kernel_dtype)

        return torch_ops.cast(out, output_dtype), backward

    if stats is None:

        @backend_gradients.custom_gradient
        def fp8_dot(x, kernel):
            out, backward = forward(x, kernel, None)

            def grad(*args, upstream=None):
                return backward(args, upstream)

            return out, grad

        return fp8_dot(x, kernel)

    if delayed is not None:
        return _delayed_dot(x, kernel, stats, delayed, forward, recipe)

    stats = _check_stats(fp8_backend.read_tensor(stats))

    @backend_gradients.custom_gradient
    def fp8_dot_with_stats(x, kernel, stats):
        rows = quantizers.Rows()
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
    # PyTorch's custom gradient may close over the call's `Scaling` (its
    # `first` may be a Python False, `fp8_layers/state.py`), and makes the
    # three rows of the carrier's gradient at once from the amaxes (an
    # eager step's ops cost host time each). JAX's must not close over
    # values of the step: it takes them packed, as an input.
    on_torch = torch_ops.has_bit_ops(carrier)
    packed = None if on_torch else delayed_module.pack(scaling)
    from_amaxes = not recipe.stats and on_torch

    @backend_gradients.custom_gradient
    def fp8_dot_delayed(x, kernel, carrier, packed):
        rows = quantizers.Rows(counts=recipe.stats, from_amaxes=from_amaxes)
        call = scaling if packed is None else delayed_module.unpack(packed)
        out, backward = forward(x, kernel, rows, call)
        sizes = _operand_sizes(x, kernel) if from_amaxes else None

        def grad(*args, upstream=None):
            dx, dw = backward(args, upstream)
            if from_amaxes:
                carrier = delayed_module.carrier_gradient_of_amaxes(
                    [rows.amaxes[i] for i in range(3)], sizes, call
                )
            else:
                statistics = ops.stack([rows[t] for t in stats_module.TENSORS])
                carrier = delayed_module.carrier_gradient(statistics, call)
            carrier = _across_replicas(carrier)
            if packed is None:
                return dx, dw, carrier, None
            return dx, dw, carrier, ops.zeros_like(packed)

        return out, grad

    return fp8_dot_delayed(x, kernel, carrier, packed)


def _operand_sizes(x, kernel):
    """The numbers of values of a GEMM's input, kernel and output
    gradient, as Python floats."""
    k, n = kernel.shape
    rows = math.prod(x.shape) // k
    return (float(rows * k), float(k * n), float(rows * n))


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

"""`einsum`: EinsumDense's contractions as one FP8 `dot`.

An equation of `x` and a kernel whose every shared letter is contracted
(`"abc,cde->abde"`, `"abcd,cde->abe"`, ...) is a matrix product once the
contracted axes of `x` are moved last and those of the kernel first: `x`
becomes `[..., K]`, the kernel `[K, N]`, and the result is reshaped and
transposed into the equation's output. Anything else (a batch letter in
both operands and the output, a letter summed out of one operand, a
repeated letter) raises a ValueError naming the equation.
"""

import math
import string

from keras import ops

from keras_mp._fp8.dot import dot
from keras_mp.backend import fp8 as fp8_backend


def _fail(equation, why):
    raise ValueError(
        f"`fp8.einsum` runs equations that are one matrix product of `x` "
        f"and `kernel` (every letter the two share is contracted, every "
        f"other letter is in the output), as EinsumDense's are: {why}. "
        f"Received: equation={equation!r}. Use `fp8.dot` on reshaped "
        "operands, or `keras.ops.einsum` outside FP8."
    )


def _parse(equation, x_ndim):
    """The letters of `x`, the kernel and the output, with `x`'s and the
    output's leading `...` spelled out as letters of their own."""
    if not isinstance(equation, str) or equation.count("->") != 1:
        _fail(equation, 'it needs one "->"')
    inputs, output = equation.replace(" ", "").split("->")
    if inputs.count(",") != 1:
        _fail(equation, "it needs exactly two operands")
    x_spec, kernel_spec = inputs.split(",")
    if "..." in kernel_spec:
        _fail(equation, "the kernel cannot have an ellipsis")
    if "..." in x_spec or "..." in output:
        if not (x_spec.startswith("...") and output.startswith("...")):
            _fail(equation, "an ellipsis leads both `x` and the output")
        used = set(x_spec + kernel_spec + output)
        spare = [c for c in string.ascii_uppercase if c not in used]
        extra = "".join(spare[: x_ndim - (len(x_spec) - 3)])
        x_spec = extra + x_spec[3:]
        output = extra + output[3:]
    for spec in (x_spec, kernel_spec, output):
        if len(set(spec)) != len(spec) or not spec.isalpha():
            _fail(equation, "each operand names each axis once, by a letter")
    return x_spec, kernel_spec, output


def _plan(equation, x_ndim, kernel_ndim):
    x_spec, kernel_spec, output = _parse(equation, x_ndim)
    if len(x_spec) != x_ndim or len(kernel_spec) != kernel_ndim:
        _fail(
            equation,
            f"`x` has {x_ndim} axes and `kernel` {kernel_ndim}, not as "
            "many as their letters",
        )
    contracted = [c for c in x_spec if c in kernel_spec]
    if any(c in output for c in contracted):
        _fail(equation, "a letter of both operands stays in the output")
    if not contracted:
        _fail(equation, "no letter is contracted")
    x_free = [c for c in x_spec if c not in kernel_spec]
    kernel_free = [c for c in kernel_spec if c not in x_spec]
    if sorted(x_free + kernel_free) != sorted(output):
        _fail(equation, "a letter of one operand is summed out")
    return x_spec, kernel_spec, output, contracted, x_free, kernel_free


def kernel_matrix(equation, kernel_shape, x_ndim=None):
    """How `einsum` sees a kernel of `kernel_shape` as its `[K, N]` matrix:
    `(permutation, K, N)`, the kernel transposed by `permutation` (its
    contracted axes first) and reshaped to `(K, N)`.

    Args:
        equation: An einsum equation as `einsum` takes it.
        kernel_shape: The kernel's static shape.
        x_ndim: The number of axes of `x` (needed where it starts with
            `...`). Defaults to `None`: as many as its letters.
    """
    x_spec = equation.replace(" ", "").split(",")[0]
    if x_ndim is None:
        x_ndim = len(x_spec.replace("...", ""))
    x_spec, kernel_spec, _, contracted, _, kernel_free = _plan(
        equation, x_ndim, len(kernel_shape)
    )
    sizes = dict(zip(kernel_spec, kernel_shape))
    permutation = [kernel_spec.index(c) for c in contracted + kernel_free]
    k = math.prod(sizes[c] for c in contracted)
    return permutation, k, math.prod(sizes[c] for c in kernel_free)


def einsum(
    equation,
    x,
    kernel,
    recipe=None,
    output_dtype=None,
    stats=None,
    delayed=None,
):
    """`keras.ops.einsum(equation, x, kernel)` on FP8 operands.

    Reduces the equation to one `keras_mp.fp8.dot`: the contracted axes
    of `x` are moved last and flattened into `K`, those of the kernel
    first, its other axes flattened into `N` (so `"block"` granularity
    tiles the kernel as that `[K, N]` matrix). Gradients follow `dot`'s.

    Args:
        equation: An einsum equation of `x` and `kernel` as EinsumDense
            takes them, e.g. `"abc,cde->abde"`; `x` and the output may
            start with `...`.
        x: A floating point tensor.
        kernel: A floating point tensor with a static shape.
        recipe: A `keras_mp.fp8.Recipe`. Defaults to `None`, the default
            recipe.
        output_dtype: The dtype of the result. Defaults to `None`, the
            dtype of `x`.
        stats: A statistics carrier, as `fp8.dot` takes it: its gradient
            is the statistics of the one `dot` the equation becomes.
            Defaults to `None`.
        delayed: What an FP8 layer with `scaling="delayed"` gives this
            call, as `fp8.dot` takes it. Defaults to `None`.

    Returns:
        The tensor `keras.ops.einsum(equation, x, kernel)` approximates.

    Example:

    >>> x = np.ones((2, 3, 16), "float32")
    >>> kernel = np.full((16, 2, 4), 0.25, "float32")
    >>> y = keras_mp.fp8.einsum("abc,cde->abde", x, kernel)
    >>> tuple(y.shape), float(keras.ops.convert_to_numpy(y)[0, 0, 0, 0])
    ((2, 3, 2, 4), 4.0)
    """
    x = fp8_backend.read_tensor(x)
    kernel = fp8_backend.read_tensor(kernel)
    x_spec, kernel_spec, output, contracted, x_free, kernel_free = _plan(
        equation, len(x.shape), len(kernel.shape)
    )
    sizes = dict(zip(kernel_spec, kernel.shape))
    free_sizes = [sizes[c] for c in kernel_free]
    permutation, k, n = kernel_matrix(equation, kernel.shape, len(x.shape))
    kernel = ops.reshape(ops.transpose(kernel, permutation), (k, n))
    x = ops.transpose(x, [x_spec.index(c) for c in x_free + contracted])
    x_free_shape = tuple(ops.shape(x)[: len(x_free)])
    x = ops.reshape(x, (*x_free_shape, k))
    y = dot(
        x,
        kernel,
        recipe=recipe,
        output_dtype=output_dtype,
        stats=stats,
        delayed=delayed,
    )
    y = ops.reshape(y, (*x_free_shape, *free_sizes))
    order = x_free + kernel_free
    return ops.transpose(y, [order.index(c) for c in output])

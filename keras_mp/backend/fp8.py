"""Products of FP8 codes accumulated in float32: what `keras.ops` cannot say.

`keras.ops.einsum` refuses FP8 operands on TensorFlow and PyTorch and, on
JAX, accumulates in the operands' dtype. `einsum_float32` multiplies FP8
codes exactly (a product of two FP8 values is exact in float32) and sums
in float32, per backend:

- JAX: `jnp.einsum` with `preferred_element_type=float32` (bfloat16
  where the caller casts the result to bfloat16), a `lax.dot_general` on
  the FP8 operands themselves (XLA emits an FP8 GEMM where the device has
  one; on CPU it upcasts exactly).
- PyTorch: on CUDA, `torch._scaled_mm` for a 2-D product where its layout
  and size rules hold, otherwise the codes upcast to float32 and
  `torch.einsum`. On a CPU, where torch converts FP8 codes one value at a
  time (3.8 ms per million on a 2-core EPYC, against 0.13 ms for bfloat16),
  the operands are never FP8 tensors: `round_to_format` rounds the scaled
  float32 values onto the format's grid in float32 arithmetic (the values the
  codes would have, bit for bit), and the GEMM multiplies those.
- TensorFlow: the codes upcast to float32 and `tf.einsum` (TensorFlow's
  kernels reject FP8 operands; only casts take them); under XLA to
  bfloat16 where the result is cast to bfloat16, the pattern XLA's GPU
  compiler makes an FP8 GEMM. Without XLA there is no FP8 GEMM (a
  warning, once, where a GPU is visible).

On a CPU the sums are float32 sums. A GPU's FP8 tensor cores (JAX's XLA,
torch's `_scaled_mm`) accumulate with fewer bits: on an H100 the tests'
products were within 2.2e-3 of the sum of |products| (forward, E4M3 x E4M3:
2.2e-4), against float32 rounding (1e-6 of it) on a CPU.
"""

import functools
import warnings

import keras

from keras_mp.backend.torch import ops as torch_ops

# Whether PyTorch on a CPU multiplies FP8 codes with `torch._scaled_mm`
# instead of float32 values on the FP8 grid (tests compare the two).
SCALED_MM_ON_CPU = False

# Format name -> (mantissa bits, exponent of the smallest normal value).
_GRIDS = {"e4m3": (3, -6), "e5m2": (2, -14)}


def rounds_to_values(x):
    """Whether the GEMM operands of `x` are float32 values on the FP8 grid
    (`round_to_format`) rather than FP8 codes: PyTorch on a CPU."""
    if keras.backend.backend() != "torch" or SCALED_MM_ON_CPU:
        return False
    return x.device.type == "cpu"


def round_to_format(x, scale, fmt, fmax):
    """The values of the FP8 codes of `x / scale`, as float32 (PyTorch).

    Bit for bit what casting `x / scale` to FP8 and back gives under
    keras_mp's rule (`keras_mp._fp8.formats.e4m3_e5m2.encode`): finite values
    clipped to `±fmax`, then rounded to nearest even on the format's grid
    (subnormals included); inf stays inf in E5M2 and becomes NaN in E4M3;
    NaN stays NaN; the sign of zero is kept. Written without `torch.where`
    and comparisons, which run one value at a time on a CPU (4 ms per
    million values against 0.1 ms for an add): about ten vectorized
    passes, most in place.

    The rounding adds and subtracts `C = 2**(e + 23 - m)`, `e` the
    exponent of `|y|` (at least the smallest normal's) and `m` the
    mantissa bits: `|y| + C` then has a float32 spacing of exactly the FP8
    spacing at `|y|`, so float32's own round-to-nearest-even rounds it.

    Args:
        x: A float32 tensor.
        scale: Positive float32 scales (powers of two, or inf),
            broadcastable to `x`.
        fmt: `"e4m3"` or `"e5m2"`.
        fmax: The format's largest finite value.
    """
    import torch

    mantissa, min_exponent = _GRIDS[fmt]
    # Two fresh tensors, the rest in place: a fresh megabyte is a fresh
    # mmap whose page faults cost more than the arithmetic (1.0 against
    # 0.43 ms for 2048x128 values).
    y = torch.div(x, scale)
    if fmt == "e5m2":
        # y - clip(y): 0, a finite excess, ±inf or NaN. Times 2**-378 (in
        # normal steps) a finite excess is 0 and inf stays inf: inf is put
        # back below.
        excess = torch.clamp(y, -fmax, fmax)
        torch.sub(y, excess, out=excess)
        excess.mul_(2.0**-126).mul_(2.0**-126).mul_(2.0**-126)
    else:
        excess = torch.sub(y, y)  # 0, or NaN where y is inf or NaN
    # clip(y) + excess, as its magnitude: NaN stays NaN, inf -> fmax + excess
    magnitude = y.clamp_(-fmax, fmax).add_(excess).abs_()
    c = excess.view(torch.int32)  # its buffer, reused
    torch.bitwise_right_shift(magnitude.view(torch.int32), 23, out=c)
    lowest = 127 + min_exponent + 23 - mantissa
    c.add_(23 - mantissa).clamp_(lowest, 254).bitwise_left_shift_(23)
    c = c.view(torch.float32)
    # A positive scale keeps the sign of x (zeros included).
    return magnitude.add_(c).sub_(c).copysign_(x)


def einsum_float32(equation, a, b, result_dtype="float32"):
    """`einsum(equation, a, b)` of FP8 codes, accumulated in float32.

    Args:
        equation: An einsum equation with two operands and no ellipsis,
            e.g. `"mk,kn->mn"`.
        a: FP8 codes (`float8_e4m3fn` or `float8_e5m2`), or on PyTorch
            float32 values on an FP8 grid (`round_to_format`).
        b: The same, for the second operand.
        result_dtype: The dtype the caller casts the result to after
            multiplying it by power-of-two scales. Where it is `"bfloat16"`
            and the operands are float32 values on the FP8 grid (PyTorch
            on a CPU), a 2-D product runs as a bfloat16 GEMM, which sums in
            float32 and rounds once to bfloat16 (FP8 values are exact in
            bfloat16), but in its own order: it may differ from the
            float32 GEMM's sum, rounded, by 1 bfloat16 ulp (seen at K =
            257 and 1024; tests/fp8_compiler_gemm_test.py); on JAX, of
            FP8 codes, and on TensorFlow under XLA, the GEMM returns
            bfloat16 (a float32 sum rounded once, bit for bit the float32
            result rounded on a CPU).
            Defaults to `"float32"`.

    Returns:
        A float32 tensor, or a bfloat16 one as `result_dtype` allows.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        return _jax_einsum_float32(equation, a, b, result_dtype)
    if backend == "torch":
        return _torch_einsum_float32(equation, a, b, result_dtype)
    if backend == "tensorflow":
        return _tensorflow_einsum_float32(equation, a, b, result_dtype)
    raise ValueError(f"Unsupported Keras backend: {backend!r}")


def branches_on_host():
    """Whether a branch on a tensor (`keras.ops.cond`) reads it on the
    host: PyTorch, whose ops run one by one."""
    return keras.backend.backend() == "torch"


def amax(x, axis):
    """The largest `|x|` over `axis` (an int, a tuple, or None for every
    axis), kept as size-1 dimensions, float32; a NaN counts as inf.

    XLA's CPU max reductions drop NaNs in large tensors (jax 0.10), so a
    NaN is made inf before the reduction there; torch's max propagates NaN,
    so it is made inf on the reduced result, one pass fewer.
    """
    if keras.backend.backend() == "torch":
        return torch_ops.amax(x, axis)
    ops = keras.ops
    magnitude = ops.where(ops.isnan(x), float("inf"), ops.abs(x))
    return ops.max(magnitude, axis=axis, keepdims=True)


def read_tensor(x):
    """`x` as a tensor; a variable (Keras or TensorFlow) is read first.

    TensorFlow's `custom_gradient` requires a gradient function taking
    `variables=` when a variable is read inside it; reading it before
    makes the variable's gradient flow through the tensor instead.
    """
    if keras.backend.backend() == "tensorflow":
        return _tensorflow_read_tensor(x)
    return keras.ops.convert_to_tensor(x)


def _tensorflow_read_tensor(x):
    import tensorflow as tf

    if isinstance(x, keras.Variable):
        x = x.value
    return tf.convert_to_tensor(x)


def _jax_einsum_float32(equation, a, b, result_dtype):
    import jax.numpy as jnp

    # XLA sums in float32 and rounds once to a bfloat16 result (on a CPU
    # bit for bit the float32 result rounded: tests/fp8_compiler_gemm_test
    # .py); on a GPU, cuBLASLt's FP8 GEMM writes bfloat16 itself. Only FP8
    # codes ask for it: MXFP8's and NVFP4's emulated GEMMs multiply float32
    # values, and cuBLASLt has no float32 GEMM with a bfloat16 result (an
    # MXFP8 step failed so on an H200, `benchmarks/gpu/results/h200-2026-
    # 11-28-run6`): theirs stays float32, which the caller casts.
    narrow = result_dtype == "bfloat16" and all(
        jnp.dtype(t.dtype).itemsize == 1 for t in (a, b)
    )
    dtype = jnp.bfloat16 if narrow else jnp.float32
    return jnp.einsum(equation, a, b, preferred_element_type=dtype)


# Whether `_tensorflow_einsum_float32` said that TensorFlow without XLA has
# no FP8 GEMM (once a process).
_warned_no_xla = False


def _tensorflow_has_gpu():
    import tensorflow as tf

    return bool(tf.config.list_logical_devices("GPU"))


def _in_xla():
    """Whether TensorFlow is tracing for XLA (`jit_compile=True`)."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    graph = tf.compat.v1.get_default_graph()
    return control_flow_util.GraphOrParentsInXlaContext(graph)


def _tensorflow_einsum_float32(equation, a, b, result_dtype):
    import tensorflow as tf

    global _warned_no_xla
    if _in_xla():
        # `dot(convert(f8), convert(f8))`, the form XLA's GPU GemmRewriter
        # makes an FP8 GEMM, in the dtype of the result where that is
        # bfloat16 (XLA sums it in float32 and rounds once).
        dtype = tf.bfloat16 if result_dtype == "bfloat16" else tf.float32
        return tf.einsum(equation, tf.cast(a, dtype), tf.cast(b, dtype))
    if not _warned_no_xla and _tensorflow_has_gpu():
        _warned_no_xla = True
        warnings.warn(
            "keras_mp FP8 on TensorFlow: there is no FP8 GEMM without XLA. "
            "TensorFlow's kernels take no FP8 operands, so outside "
            "`jit_compile=True` the FP8 codes are multiplied as float32 "
            "(exact, but slower than bfloat16). Compile the model with "
            "`model.compile(..., jit_compile=True)` (Keras turns XLA off "
            "under tf.distribute), or use the JAX or PyTorch backend.",
            stacklevel=4,
        )
    # Outside XLA the codes stay float32: oneDNN's bfloat16 matmul does
    # not round its float32 sum once.
    return tf.einsum(equation, tf.cast(a, tf.float32), tf.cast(b, tf.float32))


def _as_matrix_product(equation):
    """For `"ab,bc->ac"`-like equations: (transpose a, transpose b,
    transpose the result), or None for anything that is not one 2-D
    matrix product."""
    inputs, output = equation.split("->")
    left, right = inputs.split(",")
    if len(left) != 2 or len(right) != 2 or len(output) != 2:
        return None
    shared = set(left) & set(right)
    if len(shared) != 1 or shared & set(output):
        return None
    (k,) = shared
    m = left.replace(k, "")
    n = right.replace(k, "")
    if {m, n} != set(output) or m == n:
        return None
    return left[0] == k, right[1] == k, output == n + m


def _torch_scaled_mm_applies(a, b):
    import torch

    if a.device.type == "cpu":
        # torch's CPU `_scaled_mm` is an emulation that upcasts with extra
        # copies: twice the time of the exact upcast below (3.7 against
        # 7.6 ms for 2048x128 @ 128x512 on a 2-core EPYC). Tests turn it on
        # to check that it gives the bits of the values path.
        return SCALED_MM_ON_CPU
    # CUDA's FP8 GEMM: no e5m2 x e5m2, sizes multiples of 16.
    both_e5m2 = a.dtype == b.dtype == torch.float8_e5m2
    sizes = (*a.shape, b.shape[1])
    return not both_e5m2 and all(size % 16 == 0 for size in sizes)


def _torch_matrices(equation, a, b):
    """`(A, B, transpose_out)` with `einsum(equation, a, b)` equal to
    `A @ B`, transposed where `transpose_out`; None where `equation` is
    not one 2-D matrix product. Transposes are views: no copy."""
    product = _as_matrix_product(equation)
    if product is None:
        return None
    transpose_a, transpose_b, transpose_out = product
    a = a.t() if transpose_a else a
    b = b.t() if transpose_b else b
    return a, b, transpose_out


@functools.cache
def _unit_scale(device):
    """A float32 scalar 1 on torch `device`, made once (a `torch.ones` at
    each GEMM is a kernel launch, 20 us of host time on an H200): the
    scale of a GEMM operand whose scale is applied elsewhere. Never
    written."""
    import torch

    return torch.ones((), dtype=torch.float32, device=device)


def _torch_scaled_mm(a, b, scale, out_dtype, fast_accumulation, scale_b=None):
    import torch

    # Row-major A, column-major B: the layout cuBLASLt's FP8 GEMM takes
    # (the CPU kernel takes any). `torch/fp8_operands.py` writes each operand
    # in the layout its GEMM asks for, so these copies run only for
    # operands made elsewhere.
    if not a.is_contiguous():
        a = a.contiguous()
    if not b.t().is_contiguous():
        b = b.t().contiguous().t()
    if scale_b is None:
        scale_b = _unit_scale(a.device)
    return torch._scaled_mm(
        a,
        b,
        scale,
        scale_b,
        out_dtype=out_dtype,
        use_fast_accum=fast_accumulation,
    )


def _torch_einsum_float32(equation, a, b, result_dtype):
    import torch

    matrices = _torch_matrices(equation, a, b)
    if matrices is None:
        return torch.einsum(equation, a.float(), b.float())
    a, b, transpose_out = matrices
    if a.dtype == torch.float32:
        # Values on the FP8 grid (a CPU): exact in bfloat16.
        if result_dtype == "bfloat16":
            a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
        out = a @ b
    elif _torch_scaled_mm_applies(a, b):
        one = _unit_scale(a.device)
        out = _torch_scaled_mm(a, b, one, torch.float32, False)
    else:
        out = a.float() @ b.float()
    return out.t() if transpose_out else out


def scaled_einsum(
    equation, a, b, factor, result_dtype="float32", fast_accumulation=False
):
    """`einsum_float32(equation, a, b, result_dtype)` times `factor`.

    On PyTorch where `torch._scaled_mm` runs the product, the factor is
    its scale and the GEMM writes `result_dtype` itself where that is
    bfloat16 or float16: cuBLASLt rounds `factor * sum` (float32) once,
    the bits of the float32 product times the factor, cast, without two
    passes over the result. Elsewhere the product is multiplied after, in
    float32 (exact: a power of two).

    Args:
        equation: A 2-D matrix product, e.g. `"mk,kn->mn"` (others go
            through `einsum_float32`).
        a: What `einsum_float32` takes.
        b: The same, for the second operand.
        factor: A float32 scalar tensor, a power of two: the product of
            the operands' tensorwise scales.
        result_dtype: The dtype the caller casts the result to. Defaults
            to `"float32"`.
        fast_accumulation: Whether the GEMM may accumulate with Hopper's
            fast FP8 accumulation (`use_fast_accum`), as Transformer
            Engine and torchao do for the forward GEMM only. Defaults to
            `False`.

    Returns:
        A float32 tensor, or one of `result_dtype` where a GEMM wrote it.
    """
    if keras.backend.backend() == "torch":
        out = _torch_scaled_product(
            equation, a, b, factor, result_dtype, fast_accumulation
        )
        if out is not None:
            return out
    product = einsum_float32(equation, a, b, result_dtype)
    return keras.ops.cast(product, "float32") * factor


def _torch_scaled_product(
    equation, a, b, factor, result_dtype, fast_accumulation
):
    """`_torch_scaled_mm` with the factor as its scale, or None."""
    import torch

    matrices = _torch_matrices(equation, a, b)
    if matrices is None or a.dtype == torch.float32:
        return None
    a, b, transpose_out = matrices
    if not _torch_scaled_mm_applies(a, b):
        return None
    out_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        result_dtype, torch.float32
    )
    factor = factor.to(device=a.device, dtype=torch.float32).reshape(())
    out = _torch_scaled_mm(a, b, factor, out_dtype, fast_accumulation)
    return out.t() if transpose_out else out


# Whether PyTorch's rowwise GEMMs take their row and column scales in
# `_scaled_mm`'s epilogue (`outer_scaled_einsum`); off, they multiply a
# float32 product after (a GPU benchmark times the two).
ROWWISE_SCALES_IN_GEMM = True


def outer_scaled_einsum(
    equation, a, b, row_scale, column_scale, result_dtype="float32"
):
    """`einsum_float32(equation, a, b, result_dtype)` times `row_scale`
    (one per row of the result, `(M, 1)`) and `column_scale` (`(1, N)`).

    On PyTorch where `torch._scaled_mm` takes them (E4M3 operands, a
    bfloat16 result: its rowwise GEMM on CUDA), the scales are its row and
    column scales and it writes bfloat16 itself: float32 `sum * row *
    column` rounded once, the bits of the float32 product times the scales
    (powers of two: exact), cast, without three passes over the result.
    Elsewhere the product is multiplied after, in float32.

    Args:
        equation: A 2-D matrix product whose result is not transposed, e.g.
            `"mk,kn->mn"` or `"mn,kn->mk"` (others go through
            `einsum_float32`).
        a: What `einsum_float32` takes.
        b: The same, for the second operand.
        row_scale: float32 `(M, 1)` powers of two.
        column_scale: float32 `(1, N)` powers of two.
        result_dtype: The dtype the caller casts the result to. Defaults
            to `"float32"`.

    Returns:
        A float32 tensor, or a bfloat16 one where the GEMM wrote it.
    """
    if keras.backend.backend() == "torch" and ROWWISE_SCALES_IN_GEMM:
        out = _torch_rowwise_product(
            equation, a, b, row_scale, column_scale, result_dtype
        )
        if out is not None:
            return out
    product = einsum_float32(equation, a, b, result_dtype)
    return keras.ops.cast(product, "float32") * row_scale * column_scale


def _torch_rowwise_product(equation, a, b, row_scale, column_scale, dtype):
    """`_scaled_mm` with row and column scales, or None where the rowwise
    GEMM of CUDA (sm89/sm90: E4M3 x E4M3, bfloat16 out) would not take it:
    the CPU emulation checks the same rules, so that a CPU counts what a
    GPU runs."""
    import torch

    matrices = _torch_matrices(equation, a, b)
    if matrices is None or dtype != "bfloat16":
        return None
    a, b, transpose_out = matrices
    e4m3 = torch.float8_e4m3fn
    if (
        transpose_out
        or a.dtype != e4m3
        or b.dtype != e4m3
        or not _torch_scaled_mm_applies(a, b)
    ):
        return None
    return _torch_scaled_mm(
        a,
        b,
        _scale_vector(row_scale, (a.shape[0], 1), a.device),
        torch.bfloat16,
        False,
        scale_b=_scale_vector(column_scale, (1, b.shape[1]), a.device),
    )


def _scale_vector(scale, shape, device):
    """float32 `scale` as `_scaled_mm` takes a row or column of scales:
    `shape`, each stride 1 where its size is (a view where the values
    already are consecutive)."""
    import torch

    flat = scale.to(device=device, dtype=torch.float32).reshape(-1)
    return flat.contiguous().view(shape)


def has_layouts(x):
    """Whether the GEMM operands of float32 `x` are FP8 codes whose
    memory layout the GEMM cares about (PyTorch, other than a CPU's
    values, for a 2-D `x`): `encode` in `torch/fp8_operands.py`."""
    return (
        keras.backend.backend() == "torch"
        and not rounds_to_values(x)
        and len(x.shape) == 2
    )


def reads_16bit(x):
    """Whether the FP8 codes of 2-D bfloat16 or float16 `x` are made from
    `x` as it is, without a float32 cast first: PyTorch's codes
    (`has_layouts`), whose amax (`amax`) and casts
    (`torch/fp8_operands.encode`, of any of its `SOURCE_DTYPES`) read
    16-bit values and make each one float32 inside their pass."""
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

    dtype = keras.backend.standardize_dtype(x.dtype)
    return has_layouts(x) and dtype in torch_fp8_operands.SOURCE_DTYPES


def torch_gemm_operands(x, scale, fmt, layouts, inverse=None):
    """FP8 codes of `x / scale` in each layout, in one pass
    (`keras_mp.backend.torch.fp8_operands.encode`; `inverse`, `1 / scale`,
    where `torch_operand_scales` gave it)."""
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

    return torch_fp8_operands.encode(x, scale, fmt, layouts, inverse)


def torch_gemm_operands_and_amax(x, scale, fmt, layouts):
    """`(torch_gemm_operands(x, scale, fmt, layouts), amax)`, the amax of
    `x` read by the same pass as a float32 vector whose max is `amax(x,
    None)` (`torch/fp8_operands.encode_with_amax`), where `x`'s operands
    are FP8 codes Triton's kernel writes; else None."""
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

    if not has_layouts(x):
        return None
    return torch_fp8_operands.encode_with_amax(x, scale, fmt, layouts)


def torch_rowwise_operands(x, fmt, exponent, carry, low, high):
    """`(row_codes, row_scales, column_codes, column_scales)` of 2-D `x`:
    its codes scaled per row, row-major, with their `(rows, 1)` scales,
    and scaled per column, column-major, with their `(1, columns)` ones,
    in two launches where the operands are Triton's
    (`torch/fp8_operands.rowwise_operands`); else None. `exponent`,
    `carry`, `low` and `high` are `torch/ops.scale_from_amax`'s."""
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

    if not has_layouts(x):
        return None
    return torch_fp8_operands.rowwise_operands(
        x, fmt, exponent, carry, low, high
    )


def torch_operand_scales(x, axes, exponent, carry, low, high):
    """`(scale, inverse)` of 2-D `x`'s largest magnitudes over `axes`, for
    its GEMM operands (`has_layouts`): `scale_from_amax(amax(x, axes))`
    and its reciprocal, bit for bit, in one kernel after the reduction
    where the operands are Triton's (`torch/fp8_operands.scales`); else
    None. `exponent`, `carry`, `low` and `high` are
    `torch/ops.scale_from_amax`'s, Python ints."""
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

    if not has_layouts(x):
        return None
    magnitudes = torch_ops.largest_magnitudes(x, axes)
    return torch_fp8_operands.scales(magnitudes, exponent, carry, low, high)


def stored_variable(variable):
    """A variable's stored value for an FP8 GEMM that differentiates it.

    PyTorch: the variable's own tensor, so that `torch/versions.reuse` keys
    on it (its version counts the optimizer's updates). Elsewhere a copy
    (TensorFlow's custom gradient refuses a function that captures a
    variable).
    """
    if keras.backend.backend() == "torch":
        return keras.ops.convert_to_tensor(variable)
    return keras.ops.copy(variable)

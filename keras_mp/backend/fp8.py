"""Products of FP8 codes accumulated in float32: what `keras.ops` cannot say.

`keras.ops.einsum` refuses FP8 operands on TensorFlow and PyTorch and, on
JAX, accumulates in the operands' dtype. `einsum_float32` multiplies FP8
codes exactly (a product of two FP8 values is exact in float32) and sums
in float32, per backend:

- JAX: `jnp.einsum` with `preferred_element_type=float32`, a
  `lax.dot_general` on the FP8 operands themselves (XLA emits an FP8 GEMM
  where the device has one; on CPU it upcasts exactly).
- PyTorch: `torch._scaled_mm` for a 2-D product where it applies (on CPU
  always; on CUDA where its layout and size rules hold), otherwise the
  codes upcast to float32 and `torch.einsum`.
- TensorFlow: the codes upcast to float32 and `tf.einsum` (TensorFlow's
  kernels reject FP8 operands; only casts take them).

On a CPU the sums are float32 sums. A GPU's FP8 tensor cores (JAX's XLA,
torch's `_scaled_mm`) accumulate with fewer bits: on an H100 the tests'
products were within 2.2e-3 of the sum of |products| (forward, E4M3 x E4M3:
2.2e-4), against float32 rounding (1e-6 of it) on a CPU.

Imports nothing from keras_mp.
"""

import keras

# Whether a CPU product of FP8 codes goes through `torch._scaled_mm` (tests
# compare it with the upcast used by default there).
SCALED_MM_ON_CPU = False


def einsum_float32(equation, a, b):
    """`einsum(equation, a, b)` of FP8 codes, accumulated in float32.

    Args:
        equation: An einsum equation with two operands and no ellipsis,
            e.g. `"mk,kn->mn"`.
        a: FP8 codes (`float8_e4m3fn` or `float8_e5m2`).
        b: FP8 codes.

    Returns:
        A float32 tensor.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        return _jax_einsum_float32(equation, a, b)
    if backend == "torch":
        return _torch_einsum_float32(equation, a, b)
    if backend == "tensorflow":
        return _tensorflow_einsum_float32(equation, a, b)
    raise ValueError(f"Unsupported Keras backend: {backend!r}")


def amax(x, axis):
    """The largest `|x|` over `axis` (an int, a tuple, or None for every
    axis), kept as size-1 dimensions, float32; a NaN counts as inf.

    XLA's CPU max reductions drop NaNs in large tensors (jax 0.10), so a
    NaN is made inf before the reduction there; torch's max propagates NaN,
    so it is made inf on the reduced result, one pass fewer.
    """
    if keras.backend.backend() == "torch":
        return _torch_amax(x, axis)
    ops = keras.ops
    magnitude = ops.where(ops.isnan(x), float("inf"), ops.abs(x))
    return ops.max(magnitude, axis=axis, keepdims=True)


def _torch_amax(x, axis):
    import torch

    if axis is None:
        axis = tuple(range(x.ndim))
    result = torch.amax(torch.abs(x), dim=axis, keepdim=True)
    return torch.where(torch.isnan(result), float("inf"), result)


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


def _jax_einsum_float32(equation, a, b):
    import jax.numpy as jnp

    return jnp.einsum(equation, a, b, preferred_element_type=jnp.float32)


def _tensorflow_einsum_float32(equation, a, b):
    import tensorflow as tf

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
        # to check both give the same bits.
        return SCALED_MM_ON_CPU
    # CUDA's FP8 GEMM: no e5m2 x e5m2, sizes multiples of 16.
    both_e5m2 = a.dtype == b.dtype == torch.float8_e5m2
    sizes = (*a.shape, b.shape[1])
    return not both_e5m2 and all(size % 16 == 0 for size in sizes)


def _torch_einsum_float32(equation, a, b):
    import torch

    product = _as_matrix_product(equation)
    if product is not None:
        transpose_a, transpose_b, transpose_out = product
        a = a.t() if transpose_a else a
        b = b.t() if transpose_b else b
        if _torch_scaled_mm_applies(a, b):
            one = torch.ones((), dtype=torch.float32, device=a.device)
            # Row-major A, column-major B: the layout cuBLASLt's FP8 GEMM
            # takes (the CPU kernel takes any).
            out = torch._scaled_mm(
                a.contiguous(),
                b.t().contiguous().t(),
                one,
                one,
                out_dtype=torch.float32,
            )
            return out.t() if transpose_out else out
        out = a.float() @ b.float()
        return out.t() if transpose_out else out
    return torch.einsum(equation, a.float(), b.float())

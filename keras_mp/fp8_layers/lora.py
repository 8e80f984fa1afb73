"""LoRA on an FP8 layer: the FP8 GEMM multiplies the frozen base kernel
(`gemm_kernel`), the low-rank path runs in the compute dtype
(`add_lora`), and W, A and B are saved by name beside Keras's merged
kernel (`LORA_ENTRIES`).
"""

import keras

from keras_mp import _keras_internals
from keras_mp.backend import fp8 as backend_fp8
from keras_mp.fp8_layers.decisions import layer_recipe


def has_lora(layer):
    return getattr(layer, "lora_enabled", False)


def gemm_kernel(layer):
    """The kernel the FP8 GEMM multiplies: with LoRA, the frozen base
    kernel alone (Keras's `layer.kernel` adds the low-rank product, which
    would then be rounded to FP8 with it and mostly lost). On PyTorch the
    variable's own tensor, not a copy: `fp8.dot` then quantizes it once
    per optimizer step (`keras_mp.backend.torch.versions.reuse`)."""
    kernel = layer._kernel if has_lora(layer) else layer.kernel
    with _keras_internals.without_autocast():
        return backend_fp8.stored_variable(kernel)


def add_lora(layer, inputs, x, equation=None):
    """`x` plus the LoRA path of `layer`, if it has one: `inputs @ A @ B`
    times `lora_alpha / lora_rank` in the compute dtype (not in FP8: the
    low-rank update is small next to the kernel's FP8 rounding)."""
    if not has_lora(layer):
        return x
    dtype = layer.compute_dtype
    a = keras.ops.cast(layer.lora_kernel_a, dtype)
    b = keras.ops.cast(layer.lora_kernel_b, dtype)
    if equation is None:
        low_rank = keras.ops.matmul(keras.ops.matmul(inputs, a), b)
    else:
        # The kernel `...l` is `A[..., r] @ B[r, l]`: one three-operand
        # einsum, which contracts the small rank axis first.
        operands, output = equation.split("->")
        x_spec, kernel_spec = operands.split(",")
        rank = next(
            c for c in "rstuvwxyzqponmlkjihgfedcba" if c not in equation
        )
        last = kernel_spec[-1]
        low_rank = keras.ops.einsum(
            f"{x_spec},{kernel_spec[:-1]}{rank},{rank}{last}->{output}",
            inputs,
            a,
            b,
        )
    scale = layer.lora_alpha / layer.lora_rank
    return keras.ops.add(x, keras.ops.multiply(low_rank, scale))


# Named entries of an FP8 layer with LoRA, besides Keras's merged kernel.
LORA_ENTRIES = (
    "fp8_lora_base_kernel",
    "fp8_lora_kernel_a",
    "fp8_lora_kernel_b",
)


def lora_variables(layer):
    return (layer._kernel, layer.lora_kernel_a, layer.lora_kernel_b)


def saves_lora(layer):
    return has_lora(layer) and layer_recipe(layer) is not None

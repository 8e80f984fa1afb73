"""Per-role formats: the GEMMs of one role in high precision, the others
as a recipe's quantizer runs them (`Recipe(high_precision="forward" |
"backward")`).

Transformer Engine's MXFP8 recipe takes `backward_override=
"high_precision"` (the gradients' GEMMs unquantized), and NVFP4 training
recipes that keep the forward in higher precision are the other half. A
high-precision GEMM multiplies the unquantized float32 operands (the
layer's inputs and kernel, and the output gradient) with float32
accumulation; the quantizer's other roles are untouched.
"""

from keras import ops

from keras_mp._fp8.quantizers.base import Quantizer

ROLES = ("forward", "backward")


class HighPrecision(Quantizer):
    """`inner`, with the GEMMs of `role` unquantized."""

    def __init__(self, inner, role):
        self.inner = inner
        self.role = role
        self.name = inner.name

    @property
    def backward_reads_input(self):
        # A high-precision kernel gradient multiplies the input itself.
        return self.role == "backward" or self.inner.backward_reads_input

    def keeps_input(self, call):
        return self.role == "backward" or self.inner.keeps_input(call)

    # A frozen layer runs its forward GEMM only, as `inner` stores it.
    frozen_layout = property(lambda self: self.inner.frozen_layout)
    frozen_input_scale = property(lambda self: self.inner.frozen_input_scale)
    freezes = property(lambda self: self.inner.freezes)

    def frozen_variables(self, shape):
        return self.inner.frozen_variables(shape)

    def freeze_kernel(self, kernel, recipe, input_scale=None):
        return self.inner.freeze_kernel(kernel, recipe, input_scale)

    def kernel_from_frozen(self, state, recipe):
        return self.inner.kernel_from_frozen(state, recipe)

    def quantize(self, x, fmt, axis, margin, scale, block_shape):
        return self.inner.quantize(x, fmt, axis, margin, scale, block_shape)

    def dequantize(self, codes, scale, axis, block_shape):
        return self.inner.dequantize(codes, scale, axis, block_shape)

    def check(self, kernel_shape, recipe):
        self.inner.check(kernel_shape, recipe)

    def forward(self, call, x, w):
        if self.role == "forward":
            if not self.inner.quantizes_from_source:
                raise ValueError(
                    f"The {self.inner.name} quantizer's gradients reuse its "
                    "forward codes, so its forward cannot run in high "
                    "precision. Received: high_precision='forward'. Use "
                    "high_precision='backward', or a rowwise, MXFP8 or "
                    "NVFP4 recipe."
                )
            # What the inner quantizer's gradients quantize from.
            call.saved.update(w=w)
            return ops.einsum("mk,kn->mn", x, w)
        call.saved.update(high_precision_w=w)
        call.quantized_kernel_gradient = False
        return self.inner.forward(call, x, w)

    def input_gradient(self, call, g):
        if self.role == "backward":
            return ops.einsum("mn,kn->mk", g, call.saved["high_precision_w"])
        return self.inner.input_gradient(call, g)

    def kernel_gradient(self, call, g):
        if self.role == "backward":
            return ops.einsum("mk,mn->kn", call.input(), g)
        return self.inner.kernel_gradient(call, g)

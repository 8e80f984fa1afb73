"""OCP MXFP8: E4M3 values in blocks of 32 along each GEMM's contracted
axis, each block with an E8M0 power-of-two scale (`keras_mp/_fp8/formats/mxfp8.py`);
with `formats="mxfp8_hybrid"` the output gradient's blocks hold E5M2.

Every operand is quantized from its high-precision source along the axis
its GEMM contracts, as Transformer Engine's MXFP8 recipe does:

- forward `x @ w`: x in 1x32 blocks along K, the kernel in 32x1 blocks
  along K;
- input gradient `g @ w^T`: g along N, the kernel along N;
- kernel gradient `x^T @ g`: x and g in blocks of 32 tokens (the token
  count padded with zero rows to a multiple of 32: a zero changes no
  block's scale and no sum).

Each GEMM multiplies the dequantized operands (exact: a code times a power
of two) with float32 accumulation: on a CPU, bit for bit "dequantize,
then a float32 matmul".
"""

from keras import ops

from keras_mp._fp8.formats import mxfp8
from keras_mp._fp8.formats.e4m3_e5m2 import e4m3_bits
from keras_mp._fp8.formats.e4m3_e5m2 import e4m3_values
from keras_mp._fp8.quantizers.base import Quantizer
from keras_mp._fp8.quantizers.base import pad_rows
from keras_mp._fp8.recipe import Recipe
from keras_mp.backend import fp8 as fp8_backend
from keras_mp.backend.torch import versions as torch_versions


class Mxfp8(Quantizer):
    """MXFP8 with one rule for rounding its E8M0 scales."""

    name = "microblock"
    quantizes_from_source = True
    # A frozen kernel is stored in the forward GEMM's blocks, along K.
    frozen_layout = "matrix"

    def __init__(self, scale_rounding="rceil"):
        self.scale_rounding = scale_rounding

    def quantize(self, x, fmt, axis, margin, scale, block_shape):
        return mxfp8.quantize(x, axis, self.scale_rounding)

    def dequantize(self, codes, scale, axis, block_shape):
        return mxfp8.dequantize(codes, scale, axis)

    def check(self, kernel_shape, recipe):
        if any(d is None or d % mxfp8.BLOCK for d in kernel_shape):
            raise ValueError(
                f"formats='mxfp8' quantizes the kernel in blocks of "
                f"{mxfp8.BLOCK} along K (forward) and along N (input "
                f"gradient), so both of its dimensions must be multiples "
                f"of {mxfp8.BLOCK}. Received: kernel.shape="
                f"{tuple(kernel_shape)}. Pad the kernel's dimensions to "
                f"multiples of {mxfp8.BLOCK}, or use formats='hybrid' for "
                "this GEMM."
            )

    def _values(self, call, name, t, axis, fmt="e4m3", keep=None):
        """`t` quantized in blocks along `axis` and dequantized: the
        values the GEMM multiplies; the quantization's statistics go to
        `name`'s row where asked. `keep(values)` is given a function of
        the codes and scales that gives the values again."""
        codes, scale = mxfp8.quantize(t, axis, self.scale_rounding, fmt)
        values = mxfp8.dequantize(codes, scale, axis)
        if keep is not None:
            keep(lambda: mxfp8.dequantize(codes, scale, axis))
        if call.rows is not None and name not in call.rows:
            shape = list(ops.shape(t))
            shape[axis : axis + 1] = [-1, mxfp8.BLOCK]
            scales = ops.expand_dims(mxfp8.scale_values(scale), axis + 1)
            call.observe(name, ops.reshape(t, shape), scales, fmt)
        return values

    def _kernel_values(self, call, w, axis):
        """The kernel's values along `axis`, computed once while it is
        unchanged (`keras_mp.backend.torch.versions.reuse`)."""
        if call.rows is not None:
            return self._values(call, "kernel", w, axis)
        key = ("mxfp8", self.scale_rounding, axis)
        return torch_versions.reuse(
            w, key, lambda: self._values(call, "kernel", w, axis)
        )

    def forward(self, call, x, w):
        call.saved.update(w=w)
        vx = self._values(call, "input", x, 1, keep=call.keep_input_codes)
        vw = self._kernel_values(call, w, 0)
        return fp8_backend.einsum_float32("mk,kn->mn", vx, vw, call.dtypes.out)

    def input_gradient(self, call, g):
        vg = self._values(call, "output_gradient", g, 1, call.backward_format)
        vw = self._kernel_values(call, call.saved["w"], 1)
        return fp8_backend.einsum_float32("mn,kn->mk", vg, vw, call.dtypes.dx)

    def _token_values(self, call, name, t, fmt="e4m3"):
        """`t`'s values in blocks of 32 tokens: padded, viewed as `[tiles,
        32, columns]` (a block axis of known size, also where a traced
        TensorFlow step's token count is not) and quantized along it."""
        columns = t.shape[1]
        tiled = ops.reshape(
            pad_rows(t, mxfp8.BLOCK), (-1, mxfp8.BLOCK, columns)
        )
        values = self._values(call, name, tiled, 1, fmt)
        return ops.reshape(values, (-1, columns))

    def kernel_gradient(self, call, g):
        vx = self._token_values(call, "input", call.input())
        vg = self._token_values(
            call, "output_gradient", g, call.backward_format
        )
        return fp8_backend.einsum_float32("mk,mn->kn", vx, vg, call.dtypes.dw)

    def frozen_variables(self, shape):
        # E4M3 codes of the `[K, N]` kernel (uint8 bit patterns) and their
        # E8M0 block scales along K: 1.03 bytes a weight.
        k, n = shape
        return {
            "fp8_kernel_codes": ((k, n), "uint8", "zeros"),
            "fp8_kernel_scale": ((k // mxfp8.BLOCK, n), "uint8", "zeros"),
        }

    def freeze_kernel(self, kernel, recipe, input_scale=None):
        # The forward GEMM's blocks, so the frozen GEMM multiplies the
        # values training's forward did.
        codes, scale = mxfp8.quantize(
            ops.convert_to_tensor(kernel, "float32"),
            axis=0,
            scale_rounding=self.scale_rounding,
        )
        return {
            "fp8_kernel_codes": e4m3_bits(ops.cast(codes, "float32")),
            "fp8_kernel_scale": scale,
        }

    def kernel_from_frozen(self, state, recipe):
        # The stored values, whose quantization along K by the forward
        # gives them back; the input quantized by the call, as in training.
        codes = e4m3_values(state["fp8_kernel_codes"])
        matrix = mxfp8.dequantize(
            ops.cast(codes, "float8_e4m3fn"), state["fp8_kernel_scale"], 0
        )
        current = Recipe(
            formats=recipe.formats, scale_rounding=recipe.scale_rounding
        )
        return matrix, dict(recipe=current)

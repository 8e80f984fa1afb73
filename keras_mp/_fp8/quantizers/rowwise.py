"""One power-of-two scale per row of each GEMM's contracted axis.

Per token for activations and output gradients, per output channel for
kernels: each operand is quantized again for each GEMM it enters along
another axis, in the layout that GEMM takes it in.
"""

from keras import ops

from keras_mp._fp8.formats.e4m3_e5m2 import quantize_reduced
from keras_mp._fp8.quantizers.base import COLUMN
from keras_mp._fp8.quantizers.base import ROW
from keras_mp._fp8.quantizers.base import Quantizer
from keras_mp._fp8.quantizers.base import kernel_operand
from keras_mp._fp8.quantizers.base import operand
from keras_mp.backend import fp8 as fp8_backend


class Rowwise(Quantizer):
    name = "rowwise"
    quantizes_from_source = True

    def quantize(self, x, fmt, axis, margin, scale, block_shape):
        return quantize_reduced(x, fmt, axis, margin, scale)

    def dequantize(self, codes, scale, axis, block_shape):
        return ops.cast(codes, "float32") * scale

    def forward(self, call, x, w):
        fmt, margin = call.forward_format, call.margin
        (cx,), sx = operand(x, fmt, 1, margin)  # (M, 1)
        call.keep_input_codes(lambda: self.dequantize(cx, sx, 1, None))
        (cw,), sw = kernel_operand(w, fmt, 0, margin, COLUMN)  # (1, N)
        call.observe("input", x, sx, fmt)
        call.observe("kernel", w, sw, fmt)
        call.saved.update(w=w)
        return fp8_backend.outer_scaled_einsum(
            "mk,kn->mn", cx, cw, sx, sw, call.dtypes.out
        )

    def input_gradient(self, call, g):
        fmt, margin = call.backward_format, call.margin
        (cg,), sg = operand(g, fmt, 1, margin)  # (M, 1)
        call.observe("output_gradient", g, sg, fmt)
        w = call.saved["w"]
        (cw_n,), sw_n = kernel_operand(w, call.forward_format, 1, margin, ROW)
        return fp8_backend.outer_scaled_einsum(  # sw_n: (K, 1)
            "mn,kn->mk", cg, cw_n, sg, ops.transpose(sw_n), call.dtypes.dx
        )

    def kernel_gradient(self, call, g):
        # (1, K) and (1, N): x^T is the A of the kernel gradient, g its B.
        margin = call.margin
        x = call.input()
        (cx_m,), sx_m = operand(x, call.forward_format, 0, margin, None, COLUMN)
        (cg_m,), sg_m = operand(
            g, call.backward_format, 0, margin, None, COLUMN
        )
        return fp8_backend.outer_scaled_einsum(
            "mk,mn->kn", cx_m, cg_m, ops.transpose(sx_m), sg_m, call.dtypes.dw
        )

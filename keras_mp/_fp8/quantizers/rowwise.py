"""One power-of-two scale per row of each GEMM's contracted axis.

Per token for activations and output gradients, per output channel for
kernels: each operand is quantized again for each GEMM it enters along
another axis, in the layout that GEMM takes it in. Where PyTorch's Triton
kernel makes the operands, both of a tensor's come from one pass over it
after one of its maxima (`_both`): the forward keeps the input's second
for the kernel gradient, and the kernel's two are made once a step.
"""

from keras import ops

from keras_mp._fp8.formats.e4m3_e5m2 import quantize_reduced
from keras_mp._fp8.formats.e4m3_e5m2 import torch_scale_constants
from keras_mp._fp8.quantizers.base import COLUMN
from keras_mp._fp8.quantizers.base import ROW
from keras_mp._fp8.quantizers.base import Quantizer
from keras_mp._fp8.quantizers.base import kernel_operand
from keras_mp._fp8.quantizers.base import operand
from keras_mp.backend import fp8 as fp8_backend
from keras_mp.backend.torch import versions as torch_versions


def _both(t, fmt, margin):
    """`(row_codes, row_scales, column_codes, column_scales)` of 2-D `t`:
    its operand scaled per row (`(R, 1)`, row-major) and per column
    (`(1, C)`, column-major), as `operand(t, fmt, 1, margin)` and
    `operand(t, fmt, 0, margin, None, COLUMN)` give them, in two launches
    where PyTorch's Triton kernel makes the operands; else None."""
    return fp8_backend.torch_rowwise_operands(
        t, fmt, *torch_scale_constants(fmt, margin)
    )


def _kernel_both(w, fmt, margin):
    """`_both` of the kernel, once while it is unchanged (once per
    optimizer step: `torch_versions.reuse`), or None."""
    key = ("rowwise kernel", fmt, margin)
    return torch_versions.reuse(w, key, lambda: _both(w, fmt, margin))


class Rowwise(Quantizer):
    name = "rowwise"
    quantizes_from_source = True
    # Its amaxes and casts read 16-bit values where PyTorch makes the codes
    # (`tensorwise.py`): no float32 cast of the input and the output
    # gradient first.
    reads_16bit = True

    def quantize(self, x, fmt, axis, margin, scale, block_shape):
        return quantize_reduced(x, fmt, axis, margin, scale)

    def dequantize(self, codes, scale, axis, block_shape):
        return ops.cast(codes, "float32") * scale

    def keeps_input(self, call):
        # The kernel gradient's operand of the input made in the forward
        # (`_both`): its FP8 codes are held instead of the input.
        return "cx_m" not in call.saved

    def forward(self, call, x, w):
        fmt, margin = call.forward_format, call.margin
        both = _both(x, fmt, margin)
        if both is None:
            (cx,), sx = operand(x, fmt, 1, margin)  # (M, 1)
        else:
            cx, sx, cx_m, sx_m = both
            if call.quantized_kernel_gradient and not call.save_codes:
                # The kernel gradient's operand, made with the forward's.
                call.saved.update(cx_m=cx_m, sx_m=sx_m)
        call.keep_input_codes(lambda: self.dequantize(cx, sx, 1, None))
        kernel = _kernel_both(w, fmt, margin)
        if kernel is None:
            (cw,), sw = kernel_operand(w, fmt, 0, margin, COLUMN)  # (1, N)
        else:
            cw_n, sw_n, cw, sw = kernel
            call.saved.update(cw_n=cw_n, sw_n=sw_n)
        call.observe("input", x, sx, fmt)
        call.observe("kernel", w, sw, fmt)
        call.saved.update(w=w)
        return fp8_backend.outer_scaled_einsum(
            "mk,kn->mn", cx, cw, sx, sw, call.dtypes.out
        )

    def _gradient(self, call, g):
        """The output gradient's two operands (`_both`), made once for
        both gradient GEMMs, or None."""
        return call.once(
            "gradient", lambda: _both(g, call.backward_format, call.margin)
        )

    def input_gradient(self, call, g):
        fmt, margin = call.backward_format, call.margin
        both = self._gradient(call, g)
        if both is None:
            (cg,), sg = operand(g, fmt, 1, margin)  # (M, 1)
        else:
            cg, sg = both[:2]
        call.observe("output_gradient", g, sg, fmt)
        saved = call.saved
        if "cw_n" in saved:
            cw_n, sw_n = saved["cw_n"], saved["sw_n"]
        else:
            (cw_n,), sw_n = kernel_operand(
                saved["w"], call.forward_format, 1, margin, ROW
            )
        return fp8_backend.outer_scaled_einsum(  # sw_n: (K, 1)
            "mn,kn->mk", cg, cw_n, sg, ops.transpose(sw_n), call.dtypes.dx
        )

    def kernel_gradient(self, call, g):
        # (1, K) and (1, N): x^T is the A of the kernel gradient, g its B.
        margin = call.margin
        saved = call.saved
        if "cx_m" in saved:
            cx_m, sx_m = saved["cx_m"], saved["sx_m"]
        else:
            x = call.input()
            (cx_m,), sx_m = operand(
                x, call.forward_format, 0, margin, None, COLUMN
            )
        both = self._gradient(call, g)
        if both is None:
            (cg_m,), sg_m = operand(
                g, call.backward_format, 0, margin, None, COLUMN
            )
        else:
            cg_m, sg_m = both[2:]
        return fp8_backend.outer_scaled_einsum(
            "mk,mn->kn", cx_m, cg_m, ops.transpose(sx_m), sg_m, call.dtypes.dw
        )

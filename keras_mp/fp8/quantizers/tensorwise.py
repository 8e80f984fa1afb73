"""One power-of-two scale per tensor (Transformer Engine's tensorwise FP8).

The forward codes serve the backward GEMMs: each operand is written in
both layouts in one pass where the GEMM cares (PyTorch), and the two
scales of a GEMM are one factor, which a GEMM may take itself
(`keras_mp.backend.fp8.scaled_einsum`). The only quantizer that takes
delayed scales (`keras_mp/fp8/delayed.py`).
"""

from keras import ops

from keras_mp.backend import fp8 as fp8_backend
from keras_mp.fp8 import delayed as delayed_module
from keras_mp.fp8.codes import quantize_reduced
from keras_mp.fp8.codes import scale_from_amax
from keras_mp.fp8.quantizers.base import BOTH
from keras_mp.fp8.quantizers.base import Quantizer
from keras_mp.fp8.quantizers.base import kernel_operand
from keras_mp.fp8.quantizers.base import operand


def _delayed_scale(call, index, t, fmt):
    """The scale of tensor `index` of a delayed call (`delayed.pick`), or
    None for current scaling. Its amax is kept in `call.rows` for the
    statistics: a side output of the step, which no cast waits for where
    the step is compiled (JAX, TensorFlow): there the first step's current
    scale reduces `t` again, inside its own branch, so the cast of a later
    step reads the stored scale alone and XLA may fuse the amax beside it
    (one read of `t`). PyTorch runs op by op: a branch would read the flag
    on the host, so it selects, and reuses the amax."""
    if call.scaling is None:
        return None
    amax = fp8_backend.amax(t, None)
    call.rows.amaxes[index] = amax
    if fp8_backend.branches_on_host():
        current = lambda: scale_from_amax(amax, fmt, call.margin)  # noqa: E731
    else:
        current = lambda: scale_from_amax(  # noqa: E731
            fp8_backend.amax(t, None), fmt, call.margin
        )
    scale = delayed_module.pick(
        call.scaling, index, current, not fp8_backend.branches_on_host()
    )
    return ops.reshape(scale, ops.shape(amax))


class Tensorwise(Quantizer):
    name = "tensorwise"

    def quantize(self, x, fmt, axis, margin, scale, block_shape):
        codes, scale = quantize_reduced(x, fmt, None, margin, scale)
        return codes, ops.reshape(scale, ())

    def dequantize(self, codes, scale, axis, block_shape):
        return ops.cast(codes, "float32") * scale

    def forward(self, call, x, w):
        fmt, margin = call.forward_format, call.margin
        sx = _delayed_scale(call, 0, x, fmt)
        sw = _delayed_scale(call, 1, w, fmt)
        (cx, cx_column), sx = operand(x, fmt, None, margin, sx, BOTH)
        if call.scaling is None:
            (cw, cw_column), sw = kernel_operand(w, fmt, None, margin, BOTH)
        else:
            (cw, cw_column), sw = operand(w, fmt, None, margin, sw, BOTH)
        call.observe("input", x, sx, fmt)
        call.observe("kernel", w, sw, fmt)
        call.saved.update(cx_column=cx_column, cw=cw, sx=sx, sw=sw)
        # Fast accumulation in the forward GEMM only, as Transformer Engine
        # and torchao: the gradients keep the full accumulation.
        return fp8_backend.scaled_einsum(
            "mk,kn->mn", cx, cw_column, sx * sw, call.dtypes.out, True
        )

    def _gradient(self, call, g):
        """The output gradient's codes in both layouts, and its scale:
        quantized once for both gradient GEMMs."""

        def compute():
            fmt = call.backward_format
            sg = _delayed_scale(call, 2, g, fmt)
            (cg, cg_column), sg = operand(g, fmt, None, call.margin, sg, BOTH)
            call.observe("output_gradient", g, sg, fmt)
            return cg, cg_column, sg

        return call.once("gradient", compute)

    def input_gradient(self, call, g):
        cg, _, sg = self._gradient(call, g)
        saved = call.saved
        return fp8_backend.scaled_einsum(
            "mn,kn->mk", cg, saved["cw"], sg * saved["sw"], call.dtypes.dx
        )

    def kernel_gradient(self, call, g):
        _, cg_column, sg = self._gradient(call, g)
        saved = call.saved
        return fp8_backend.scaled_einsum(
            "mk,mn->kn",
            saved["cx_column"],
            cg_column,
            saved["sx"] * sg,
            call.dtypes.dw,
        )

"""One power-of-two scale per tensor (Transformer Engine's tensorwise FP8).

The forward codes serve the backward GEMMs: each operand is written in
both layouts in one pass where the GEMM cares (PyTorch), and the two
scales of a GEMM are one factor, which a GEMM may take itself
(`keras_mp.backend.fp8.scaled_einsum`). The only quantizer that takes
delayed scales (`keras_mp/_fp8/delayed.py`).
"""

import functools

from keras import ops

from keras_mp._fp8 import delayed as delayed_module
from keras_mp._fp8.formats.e4m3_e5m2 import e4m3_bits
from keras_mp._fp8.formats.e4m3_e5m2 import e4m3_values
from keras_mp._fp8.formats.e4m3_e5m2 import quantize_reduced
from keras_mp._fp8.formats.e4m3_e5m2 import scale_from_amax
from keras_mp._fp8.quantizers.base import BOTH
from keras_mp._fp8.quantizers.base import Quantizer
from keras_mp._fp8.quantizers.base import kernel_operand
from keras_mp._fp8.quantizers.base import operand
from keras_mp._fp8.recipe import Recipe
from keras_mp.backend import fp8 as fp8_backend
from keras_mp.backend.torch import ops as torch_ops


def _delayed_scales(call, tensors, fmt):
    """The scales of `tensors`, `(index, tensor)` pairs of a delayed call
    (`delayed.pick`, one branch for all of them; on PyTorch
    `delayed.select`), or Nones for current scaling. Their amaxes are kept
    in `call.rows` for the statistics: a side output of the step, which no
    cast waits for where the step is compiled (JAX, TensorFlow): there the
    first step's current scales reduce the tensors again, inside their own
    branch, so the casts of a later step read the stored scales alone and
    XLA may fuse each amax beside its cast (one read of the tensor). PyTorch
    runs op by op, where a branch would read the flag on the host: once the
    host knows the layer has a history (`first` a Python False,
    `fp8_layers/state.py`) the casts take the stored scales alone, and
    where the rows are made from the amaxes (`Rows.from_amaxes`) each amax
    is left to its cast (`_operand`: None in `call.rows.amaxes` until
    then); before, it computes the current scales from the amaxes and
    selects."""
    if call.scaling is None:
        return (None,) * len(tensors)
    indices = tuple(index for index, _ in tensors)
    shapes = [(1,) * len(t.shape) for _, t in tensors]
    if call.scaling.first is False and call.rows.from_amaxes:
        scales = delayed_module.select(call.scaling, indices, None)
        for index in indices:
            call.rows.amaxes[index] = None
        return tuple(
            torch_ops.reshape(scales[i], shape)
            for i, shape in enumerate(shapes)
        )
    amaxes = []
    for index, t in tensors:
        amax = fp8_backend.amax(t, None)
        call.rows.amaxes[index] = amax
        amaxes.append(amax)
    if fp8_backend.branches_on_host():
        # Every tensor's current scale in one computation, and one select
        # for all of them: each op of an eager step is a kernel launch on
        # a GPU.
        # Once the host knows the layer has a history (`first` is a
        # Python False: `fp8_layers/state.py`), no current scale is made.
        currents = None
        if call.scaling.first is not False:
            currents = scale_from_amax(
                torch_ops.stack([torch_ops.reshape(a, ()) for a in amaxes]),
                fmt,
                call.margin,
            )
        scales = delayed_module.select(call.scaling, indices, currents)
        scales = [scales[i] for i in range(len(amaxes))]
    else:
        currents = [
            functools.partial(_current_scale, t, fmt, call.margin)
            for _, t in tensors
        ]
        scales = delayed_module.pick(call.scaling, indices, currents)
    return tuple(
        torch_ops.reshape(scale, shape) for scale, shape in zip(scales, shapes)
    )


def _operand(call, index, t, fmt, scale):
    """`operand(t, ..., scale, BOTH)` of tensor `index` of the call; where
    its amax is still to be found (`_delayed_scales`), read by the same
    pass where PyTorch's Triton kernel writes the codes
    (`torch_gemm_operands_and_amax`, as Transformer Engine's cast: the
    reduction and the kernel after it saved), else by its own reduction."""
    amaxes = None if call.rows is None else call.rows.amaxes
    if amaxes is not None and index in amaxes and amaxes[index] is None:
        fused = fp8_backend.torch_gemm_operands_and_amax(t, scale, fmt, BOTH)
        if fused is not None:
            codes, amaxes[index] = fused
            return tuple(codes), scale
        amaxes[index] = fp8_backend.amax(t, None)
    return operand(t, fmt, None, call.margin, scale, BOTH)


def _current_scale(t, fmt, margin):
    return scale_from_amax(fp8_backend.amax(t, None), fmt, margin)


class Tensorwise(Quantizer):
    name = "tensorwise"
    # The kernel gradient multiplies the forward's codes of the input.
    backward_reads_input = False
    # Its amaxes and casts read 16-bit values where PyTorch makes the codes
    # (a float32 cast first wrote and read twice the tensor's bytes again:
    # for the output gradient of a 16k-token, 16384-wide layer, 1.3 GB).
    reads_16bit = True
    # A frozen layer's forward multiplies the input's codes at a fixed
    # scale: one scale per tensor leaves none for a call to choose.
    frozen_input_scale = True

    def quantize(self, x, fmt, axis, margin, scale, block_shape):
        codes, scale = quantize_reduced(x, fmt, None, margin, scale)
        return codes, ops.reshape(scale, ())

    def dequantize(self, codes, scale, axis, block_shape):
        return ops.cast(codes, "float32") * scale

    def forward(self, call, x, w):
        fmt, margin = call.forward_format, call.margin
        sx, sw = _delayed_scales(call, ((0, x), (1, w)), fmt)
        (cx, cx_column), sx = _operand(call, 0, x, fmt, sx)
        if call.scaling is None:
            (cw, cw_column), sw = kernel_operand(w, fmt, None, margin, BOTH)
        else:
            (cw, cw_column), sw = _operand(call, 1, w, fmt, sw)
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
            (sg,) = _delayed_scales(call, ((2, g),), fmt)
            (cg, cg_column), sg = _operand(call, 2, g, fmt, sg)
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

    def frozen_variables(self, shape):
        # The kernel's E4M3 codes (uint8 bit patterns) in its own shape,
        # its power-of-two scale and the input's.
        return {
            "fp8_kernel_codes": (shape, "uint8", "zeros"),
            "fp8_kernel_scale": ((), "float32", "ones"),
            "fp8_input_scale": ((), "float32", "ones"),
        }

    def freeze_kernel(self, kernel, recipe, input_scale=None):
        kernel = ops.convert_to_tensor(kernel, "float32")
        scale = scale_from_amax(ops.max(ops.abs(kernel)), "e4m3", recipe.margin)
        # The codes `fp8.quantize` gives: clipped to 448, rounded to
        # nearest even.
        return {
            "fp8_kernel_codes": e4m3_bits(ops.clip(kernel / scale, -448, 448)),
            "fp8_kernel_scale": scale,
            "fp8_input_scale": ops.convert_to_tensor(input_scale, "float32"),
        }

    def kernel_from_frozen(self, state, recipe):
        # Delayed scaling's GEMM with the stored scales as its history's:
        # the codes of the kernel are the stored ones, and the input's are
        # those of its fixed scale.
        kernel_scale = state["fp8_kernel_scale"]
        kernel = e4m3_values(state["fp8_kernel_codes"]) * kernel_scale
        scaling = delayed_module.Scaling(
            scales=ops.stack([state["fp8_input_scale"], kernel_scale, 1.0]),
            first=ops.convert_to_tensor(False),
            parity=ops.zeros((2,), "float32"),
            loss_scale=ops.convert_to_tensor(1.0, "float32"),
        )
        arguments = dict(
            recipe=Recipe(
                scaling="delayed", formats=recipe.formats, margin=recipe.margin
            ),
            stats=ops.zeros(delayed_module.CARRIER_SHAPE, "float32"),
            delayed=scaling,
        )
        return kernel, arguments

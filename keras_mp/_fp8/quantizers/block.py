"""DeepSeek-V3's tiles: 1x128 along the contracted axis for activations
and output gradients (128x1, 128 tokens, for the kernel gradient),
128x128 for the kernel.

Each 128-chunk of a GEMM's contracted axis gives a partial product,
multiplied by its own scales, and the chunks are summed in float32.
"""

from keras import ops

from keras_mp._fp8.formats.e4m3_e5m2 import quantize_reduced
from keras_mp._fp8.quantizers.base import ROW
from keras_mp._fp8.quantizers.base import Quantizer
from keras_mp._fp8.quantizers.base import kernel_operand
from keras_mp._fp8.quantizers.base import operand
from keras_mp._fp8.quantizers.base import pad_rows
from keras_mp._fp8.recipe_fields import BLOCK_SIZE
from keras_mp.backend import fp8 as fp8_backend


def _static_size(x, axis, what):
    size = x.shape[axis]
    if size is None or size % BLOCK_SIZE:
        raise ValueError(
            f'granularity="block" tiles {what} in blocks of {BLOCK_SIZE}, so '
            f"its size must be a known multiple of {BLOCK_SIZE}. Received: "
            f'x.shape={tuple(x.shape)}. Use granularity="rowwise", or pad '
            f"that dimension to a multiple of {BLOCK_SIZE} with zeros."
        )
    return size


def _check_block_shape(x, block_shape):
    if (
        len(x.shape) != 2
        or not isinstance(block_shape, (tuple, list))
        or tuple(block_shape) != (BLOCK_SIZE, BLOCK_SIZE)
    ):
        raise ValueError(
            f"`block_shape` is ({BLOCK_SIZE}, {BLOCK_SIZE}) for a 2-D "
            'tensor with granularity="block" (or None for 1x'
            f"{BLOCK_SIZE} tiles along `axis`). Received: "
            f"block_shape={block_shape!r} for x.shape={tuple(x.shape)}"
        )


def _sum_tiles(partials):
    """The sum over the leading (tile) axis, in float32. Slice by slice
    where the number of tiles is static: XLA's CPU reduction over a
    leading axis of a broadcast product runs 6x slower than the adds."""
    tiles = partials.shape[0]
    if tiles is None:
        return ops.sum(partials, axis=0)
    total = partials[0]
    for tile in range(1, tiles):
        total = total + partials[tile]
    return total


class Block(Quantizer):
    name = "block"

    def quantize(self, x, fmt, axis, margin, scale, block_shape):
        if block_shape is not None:
            return self._quantize_2d(x, fmt, margin, scale, block_shape)
        size = _static_size(x, axis, "`x` along `axis`")
        shape = ops.shape(x)
        tiled = (
            *shape[:axis],
            size // BLOCK_SIZE,
            BLOCK_SIZE,
            *shape[axis + 1 :],
        )
        if scale is not None:
            scale = ops.expand_dims(scale, axis + 1)
        codes, scale = quantize_reduced(
            ops.reshape(x, tiled), fmt, axis + 1, margin, scale
        )
        return ops.reshape(codes, shape), ops.squeeze(scale, axis + 1)

    def _quantize_2d(self, x, fmt, margin, scale, block_shape):
        _check_block_shape(x, block_shape)
        rows = _static_size(x, 0, "both dimensions of a 2-D `x`")
        columns = _static_size(x, 1, "both dimensions of a 2-D `x`")
        tiled = (
            rows // BLOCK_SIZE,
            BLOCK_SIZE,
            columns // BLOCK_SIZE,
            BLOCK_SIZE,
        )
        if scale is not None:
            scale = ops.reshape(scale, (tiled[0], 1, tiled[2], 1))
        codes, scale = quantize_reduced(
            ops.reshape(x, tiled), fmt, (1, 3), margin, scale
        )
        return ops.reshape(codes, (rows, columns)), ops.reshape(
            scale, (tiled[0], tiled[2])
        )

    def dequantize(self, codes, scale, axis, block_shape):
        if block_shape is not None:
            _check_block_shape(codes, block_shape)
            scale = ops.repeat(ops.repeat(scale, BLOCK_SIZE, 0), BLOCK_SIZE, 1)
        else:
            scale = ops.repeat(scale, BLOCK_SIZE, axis)
        return ops.cast(codes, "float32") * scale

    def check(self, kernel_shape, recipe):
        if any(d is None or d % BLOCK_SIZE for d in kernel_shape):
            raise ValueError(
                f'granularity="block" tiles the kernel in {BLOCK_SIZE}x'
                f"{BLOCK_SIZE} blocks, so both of its dimensions must be "
                f"multiples of {BLOCK_SIZE}. Received: kernel.shape="
                f"{tuple(kernel_shape)}. Use keras_mp.fp8.Recipe("
                'granularity="rowwise"), or pad the kernel\'s dimensions to '
                f"multiples of {BLOCK_SIZE}."
            )

    def forward(self, call, x, w):
        fmt, margin = call.forward_format, call.margin
        k, n = w.shape
        tiles_k, tiles_n = k // BLOCK_SIZE, n // BLOCK_SIZE
        tiled_x = ops.reshape(x, (-1, tiles_k, BLOCK_SIZE))
        tiles = (tiles_k, BLOCK_SIZE, tiles_n, BLOCK_SIZE)
        (cx,), sx = operand(tiled_x, fmt, 2, margin)  # (M, tiles_k, 1)
        call.keep_input_codes(
            lambda: ops.reshape(ops.cast(cx, "float32") * sx, (-1, k))
        )
        # sw: (tiles_k, 1, tiles_n, 1)
        (cw,), sw = kernel_operand(w, fmt, (1, 3), margin, ROW, tiles)
        call.observe("input", tiled_x, sx, fmt)
        call.observe("kernel", ops.reshape(w, tiles), sw, fmt)
        call.saved.update(cw=cw, sw=sw)
        partial = fp8_backend.einsum_float32("mtb,tbjc->tmjc", cx, cw)
        sx_t = ops.expand_dims(ops.transpose(sx, (1, 0, 2)), -1)
        return ops.reshape(_sum_tiles(partial * sx_t * sw), (-1, n))

    def input_gradient(self, call, g):
        fmt, cw, sw = call.backward_format, call.saved["cw"], call.saved["sw"]
        k = call.input_columns
        n = g.shape[1]
        tiled_g = ops.reshape(g, (-1, n // BLOCK_SIZE, BLOCK_SIZE))
        (cg,), sg = operand(tiled_g, fmt, 2, call.margin)  # (M, n/128, 1)
        call.observe("output_gradient", tiled_g, sg, fmt)
        partial = fp8_backend.einsum_float32("mjc,tbjc->jmtb", cg, cw)
        sg_t = ops.expand_dims(ops.transpose(sg, (1, 0, 2)), -1)
        sw_t = ops.transpose(sw, (2, 1, 0, 3))
        return ops.reshape(_sum_tiles(partial * sg_t * sw_t), (-1, k))

    def kernel_gradient(self, call, g):
        # The kernel gradient contracts the tokens: tiles of 128 tokens.
        x, margin = call.input(), call.margin
        k, n = x.shape[1], g.shape[1]
        (cx_m,), sx_m = operand(
            ops.reshape(pad_rows(x, BLOCK_SIZE), (-1, BLOCK_SIZE, k)),
            call.forward_format,
            1,
            margin,
        )  # sx_m: (tiles_m, 1, K)
        (cg_m,), sg_m = operand(
            ops.reshape(pad_rows(g, BLOCK_SIZE), (-1, BLOCK_SIZE, n)),
            call.backward_format,
            1,
            margin,
        )  # sg_m: (tiles_m, 1, N)
        partial = fp8_backend.einsum_float32("sbk,sbn->skn", cx_m, cg_m)
        sx_m = ops.transpose(sx_m, (0, 2, 1))
        return _sum_tiles(partial * sx_m * sg_m)

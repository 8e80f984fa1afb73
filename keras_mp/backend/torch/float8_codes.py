"""The codes of float8 optimizer state, decoded and encoded in place.

`Float8Codes`: `state_dtype="float8"`'s E4M3 codes with a float32
power-of-two scale per block of elements
(`keras_mp/optimizers/state_formats.py`'s `Float8BlockState`), written as
in-place PyTorch calls on scratch buffers, bit for bit its `keras.ops`
`quantize` and `dequantize`: the fused update
(`fused_state_update.py`) decodes each float8 slot into float32 with one
table lookup, updates it there, and encodes it again. Eager `keras.ops`
would allocate a fresh full-size tensor for each of the ~80 operations of
a step (a page-faulting pass each: 7 times the bfloat16 state's step on a
CPU).
"""

from keras_mp.backend.torch import fused_batches


class Float8Codes:
    """In-place `dequantize` and `quantize` of float8 state (see the module).

    Args:
        scale_from_amax: `keras_mp._fp8.formats.e4m3_e5m2.scale_from_amax`.
        values: The float32 values of the 256 codes (a NumPy array), those
            `e4m3_e5m2.e4m3_values` looks up.
        block_size: Elements per scale (`state_formats.BLOCK_SIZE`).
    """

    def __init__(self, scale_from_amax, values, block_size):
        import torch

        self.block_size = block_size
        self._scale_from_amax = scale_from_amax
        self._table = torch.from_numpy(values.copy())

    def decode(self, codes, scales, out, ints):
        """`dequantize`: the codes' values times their block's scale, into
        float32 `out`, with int32 scratch `ints`."""
        import torch

        if self._table.device != out.device:
            self._table = self._table.to(out.device)
        ints.copy_(codes)
        torch.index_select(self._table, 0, ints, out=out)
        _per_block(out, scales, "mul_", self.block_size)

    def encode(self, x, codes, scales, y, ints, index, key=None):
        """`quantize` of float32 `x` (left as it is) into `codes` and
        `scales`, with float32 scratch `y` and four int32 scratch `ints`;
        stochastically with int32 `key` (added to `index`, the elements'
        positions, then hashed), or to nearest."""
        import torch

        i0, i1, i2, i3 = ints
        # amax: a NaN counts as inf (`backend.fp8.amax`); the zeros that
        # pad the last block never change a max of magnitudes.
        torch.abs(x, out=y)
        block = self.block_size
        full = x.numel() // block * block
        amax = y[:full].view(-1, block).amax(1)
        if full < x.numel():
            amax = torch.cat([amax, y[full:].amax().reshape(1)])
        amax = torch.where(torch.isnan(amax), float("inf"), amax)
        scales.copy_(self._scale_from_amax(amax, "e4m3"))
        # y = x / scale
        y.copy_(x)
        _per_block(y, scales, "div_", block)
        # `e4m3_e5m2.e4m3_bits`, step by step.
        bits = y.view(torch.int32)
        torch.bitwise_and(bits, 0x7FFFFFFF, out=i0)  # |y|
        torch.bitwise_right_shift(i0, 23, out=i1)
        i1.clamp_(min=121)  # exponent
        # 127 where the exponent is 255 (inf, NaN), else 0; ORed at the end
        # with the sign bit, kept in `bits`.
        torch.add(i1, 1, out=i2)
        i2.bitwise_right_shift_(8).mul_(127)
        bits.bitwise_right_shift_(24).bitwise_and_(0x80).bitwise_or_(i2)
        # steps = |y| * 2**(3 - e)
        torch.sub(257, i1, out=i2)
        i2.bitwise_left_shift_(23)
        steps = i0.view(torch.float32)
        steps.mul_(i2.view(torch.float32))
        if key is not None:
            torch.add(index, key, out=i2)
            fused_batches.hash32_in_place(i2, i3)
            i2.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF)
            uniform = i3.view(torch.float32)
            uniform.copy_(i2)
            uniform.mul_(2.0**-24)
            steps.add_(uniform)
            steps.floor_()
        # The integer of steps, off the bits of steps + 2**23 (rounded to
        # nearest there where no key floored it).
        steps.add_(2.0**23)
        torch.sub(i0, 0x4B000000, out=i2)
        i1.sub_(121).mul_(8)
        i2.add_(i1).clamp_(0, 126).bitwise_or_(bits)
        codes.copy_(i2)


def _per_block(x, scales, method, block):
    """`x`'s blocks of `block` elements (the last one possibly short) times
    or divided by their scale, in place."""
    full = x.numel() // block
    if full:
        head = x[: full * block].view(full, block)
        getattr(head, method)(scales[:full, None])
    if full * block < x.numel():
        getattr(x[full * block :], method)(scales[full])

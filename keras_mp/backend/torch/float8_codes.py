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
        values: The float32 value of each of the 256 codes, a tensor
            (`e4m3_e5m2.e4m3_value_table`).
        block_size: Elements per scale (`state_formats.BLOCK_SIZE`).
        code_program: `e4m3_e5m2.e4m3_code_program`, the encoder this runs
            in place (on `_InPlaceLanes`).
        scale_constants: `scale_from_amax`'s E4M3 constants `(exponent,
            carry, low, high)` (`e4m3_e5m2.torch_scale_constants`), and
        code_constants: `code_program`'s (`e4m3_e5m2.e4m3_code_constants`),
            for the Triton kernel of `update_kernels.py`, which runs both
            step for step.
    """

    def __init__(
        self,
        scale_from_amax,
        values,
        block_size,
        code_program,
        scale_constants,
        code_constants,
    ):
        self.block_size = block_size
        self._scale_from_amax = scale_from_amax
        self._table = values
        self._code_program = code_program
        self.scale_constants = scale_constants
        self.code_constants = code_constants

    def table(self, device):
        """The 256 codes' float32 values, on `device`."""
        if self._table.device != device:
            self._table = self._table.to(device)
        return self._table

    def decode(self, codes, scales, out, ints):
        """`dequantize`: the codes' values times their block's scale, into
        float32 `out`, with int32 scratch `ints`."""
        import torch

        ints.copy_(codes)
        torch.index_select(self.table(out.device), 0, ints, out=out)
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
        # `e4m3_e5m2.e4m3_bits`' program, in place.
        lanes = _InPlaceLanes(index, key)
        codes.copy_(
            self._code_program(lanes, y, ints, stochastic=key is not None)
        )


def _in_place(name):
    """The step `out = name(a, b)` of `_InPlaceLanes`, in place:
    `a.name_(b)` where `out` is `a`, else `torch.name(a, b, out=out)` (`a`
    may be a Python number)."""

    def step(out, a, b):
        import torch

        if out is a:
            getattr(out, f"{name}_")(b)
        else:
            getattr(torch, name)(a, b, out=out)

    return staticmethod(step)


class _InPlaceLanes:
    """Runs `e4m3_e5m2.e4m3_code_program` on torch tensors in place: each
    step writes into its output tensor (`out=`, or the in-place method
    where the output is the input), and `ints`/`floats` are views."""

    def __init__(self, index, key):
        self._index = index
        self._key = key

    add = _in_place("add")
    subtract = _in_place("sub")
    multiply = _in_place("mul")
    # With a number (the program's only use): `clamp(a, min=number)`.
    maximum = _in_place("clamp")
    bitwise_and = _in_place("bitwise_and")
    bitwise_or = _in_place("bitwise_or")
    right_shift = _in_place("bitwise_right_shift")
    left_shift = _in_place("bitwise_left_shift")

    @staticmethod
    def clip(out, a, low, high):
        import torch

        torch.clamp(a, low, high, out=out)

    @staticmethod
    def ints(tensor):
        import torch

        return tensor.view(torch.int32)

    @staticmethod
    def floats(tensor):
        import torch

        return tensor.view(torch.float32)

    @staticmethod
    def to_float(out, a):
        out.copy_(a)

    @staticmethod
    def floor(out, a):
        import torch

        torch.floor(a, out=out)

    def random_bits(self, out, scratch):
        import torch

        torch.add(self._index, self._key, out=out)
        fused_batches.hash32_in_place(out, scratch)


def _per_block(x, scales, method, block):
    """`x`'s blocks of `block` elements (the last one possibly short) times
    or divided by their scale, in place."""
    full = x.numel() // block
    if full:
        head = x[: full * block].view(full, block)
        getattr(head, method)(scales[:full, None])
    if full * block < x.numel():
        getattr(x[full * block :], method)(scales[full])

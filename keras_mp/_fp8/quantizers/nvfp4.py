"""NVFP4: E2M1 values in blocks of 16, E4M3 block scales and a float32
tensor scale (`keras_mp/_fp8/formats/nvfp4.py`), after Transformer Engine's NVFP4
recipe (`NVFP4BlockScaling`).

Every operand is quantized from its high-precision source along the axis
its GEMM contracts:

- forward `x @ w`: x in 1x16 blocks along K, rounded to nearest even; the
  kernel in 16x16 tiles, rounded to nearest even;
- input gradient `g @ w^T`: g in 1x16 blocks along N, rounded
  stochastically; the kernel's same 16x16 values (a tile is a block along
  K and along N at once, so one quantization serves both GEMMs);
- kernel gradient `x^T @ g`: x and g in blocks of 16 tokens (the token
  count padded with zero rows to a multiple of 16), both first rotated by
  the 16x16 random Hadamard transform along the tokens (`hadamard=True`);
  x rounded to nearest even, g stochastically.

Each GEMM multiplies the dequantized operands with float32 accumulation:
on a CPU, bit for bit "dequantize, then a float32 matmul". The rotation is
orthogonal (`H @ H.T = I` exactly), so before quantization the rotated
product is the unrotated one.

Stochastic rounding needs random bits that are the same on every backend
for the same tensor, differ from step to step, and need no state (no seed
variable, no step counter): `rounding_bits` hashes them out of the tensor
being rounded itself (see there).

Non-finite values are never hidden: a block holding inf or NaN
dequantizes to NaN, and a non-finite tensor amax makes the whole operand
NaN, so a non-finite output gradient keeps both gradients non-finite for a
loss-scale skip to see.
"""

from keras import ops

from keras_mp import _random_bits
from keras_mp._fp8.formats import nvfp4
from keras_mp._fp8.formats.e4m3_e5m2 import e4m3_bits
from keras_mp._fp8.formats.e4m3_e5m2 import e4m3_values
from keras_mp._fp8.quantizers.base import Quantizer
from keras_mp._fp8.quantizers.base import pad_rows
from keras_mp.backend import fp8 as fp8_backend
from keras_mp.backend.torch import versions as torch_versions

TILE = (nvfp4.BLOCK_SIZE, nvfp4.BLOCK_SIZE)
# The constant each stochastically rounded role mixes into its key, so the
# two backward GEMMs draw different bits even from equal tensors.
ROLE_KEYS = {"input_gradient": 1, "kernel_gradient": 2}


def _flush(t):
    """Float32 `t` with subnormals as (signed) zero, as `nvfp4.quantize`
    counts them: XLA on a CPU flushes them and PyTorch does not."""
    return ops.where(ops.abs(t) < nvfp4.FLOAT32_MIN, ops.multiply(t, 0.0), t)


def rounding_bits(t, role):
    """The random bits with which `role` rounds the 2-D float32 `t`.

    Stateless and the same on every backend: with `v` the int32 bits of
    `t` (subnormals as zero), `key = hash(sum(hash(v)) + c)`, the sum over
    every element wrapping in 32 bits (the same in any order, so on every
    backend), `c` the role's constant (`ROLE_KEYS`); element `i`
    (row-major) gets `hash(v[i] ^ hash(i + key))`, `hash` the `lowbias32`
    integer hash of `keras_mp._random_bits` with wrapping int32
    arithmetic. Any change to the tensor (another step's gradient) changes
    the key and so every element's bits; the same tensor draws the same
    bits on every backend and every run. `nvfp4.quantize` uses the low 8
    bits of each.

    Args:
        t: The float32 `[rows, columns]` tensor about to be quantized
            (padded and rotated already, in the kernel gradient).
        role: `"input_gradient"` or `"kernel_gradient"`.

    Returns:
        An int32 tensor of `t`'s shape.
    """
    hash32 = _random_bits.hash32
    v = ops.view(_flush(ops.cast(t, "float32")), "int32")
    # JAX and TensorFlow sum int32 wrapping; PyTorch sums it in int64,
    # whose cast to int32 keeps the low 32 bits: the same wrapped sum.
    total = ops.cast(ops.sum(hash32(v)), "int32")
    key = hash32(ops.add(total, ROLE_KEYS[role]))
    columns = t.shape[1]
    rows = ops.arange(ops.shape(t)[0], dtype="int32")
    index = ops.add(
        ops.multiply(ops.expand_dims(rows, 1), columns),
        ops.expand_dims(ops.arange(columns, dtype="int32"), 0),
    )
    return hash32(ops.bitwise_xor(v, hash32(ops.add(index, key))))


def values(t, axis=None, random_bits=None):
    """`t` quantized to NVFP4 and dequantized: 1x16 blocks along `axis`,
    or 16x16 tiles where `axis` is None; the values a GEMM multiplies."""
    block_shape = TILE if axis is None else None
    axis = -1 if axis is None else axis
    codes, scale = nvfp4.quantize(t, axis, block_shape, random_bits=random_bits)
    return nvfp4.dequantize(codes, scale, axis, block_shape)


class Nvfp4(Quantizer):
    """NVFP4 with or without stochastic rounding of the output gradient
    and the Hadamard transform of the kernel gradient's operands."""

    name = "nvfp4"
    quantizes_from_source = True
    # A frozen kernel is stored in the forward GEMM's 16x16 tiles.
    frozen_layout = "matrix"

    def __init__(self, stochastic_rounding=True, hadamard=True):
        self.stochastic_rounding = stochastic_rounding
        self.hadamard = hadamard

    def quantize(self, x, fmt, axis, margin, scale, block_shape):
        return nvfp4.quantize(x, axis, block_shape)

    def dequantize(self, codes, scale, axis, block_shape):
        return nvfp4.dequantize(codes, scale, axis, block_shape)

    def check(self, kernel_shape, recipe):
        if any(d is None or d % nvfp4.BLOCK_SIZE for d in kernel_shape):
            raise ValueError(
                "formats='nvfp4' quantizes the kernel in 16x16 tiles (blocks "
                "of 16 along K for the forward GEMM and along N for the "
                "input gradient), so both of its dimensions must be "
                "multiples of 16. Received: kernel.shape="
                f"{tuple(kernel_shape)}. Pad the kernel's dimensions to "
                "multiples of 16, or use formats='hybrid' for this GEMM."
            )

    def _bits(self, t, role):
        return rounding_bits(t, role) if self.stochastic_rounding else None

    def _values(self, call, name, t, axis=None, random_bits=None):
        """`values(t, axis, random_bits)`; the quantization's statistics
        (E2M1, counted from its codes and scales) go to `name`'s row where
        asked and not yet recorded: the forward's input and kernel, the
        input gradient's output gradient."""
        if call.rows is None or name in call.rows:
            return values(t, axis, random_bits)
        block_shape = TILE if axis is None else None
        axis = -1 if axis is None else axis
        codes, scale = nvfp4.quantize(
            t, axis, block_shape, random_bits=random_bits
        )
        flushed, saturated = nvfp4.flushed_and_saturated(
            t, codes, scale, axis, block_shape
        )
        call.observe_counted(name, t, flushed, saturated)
        return nvfp4.dequantize(codes, scale, axis, block_shape)

    def _kernel_values(self, call, w):
        """The kernel's 16x16-tile values, computed once while it is
        unchanged (`keras_mp.backend.torch.versions.reuse`)."""
        if call.rows is not None:
            return self._values(call, "kernel", w)
        return torch_versions.reuse(w, ("nvfp4", TILE), lambda: values(w))

    def forward(self, call, x, w):
        call.saved.update(w=w)
        vx = self._values(call, "input", x, 1)
        vw = self._kernel_values(call, w)
        # Float32 results: NVFP4's values (a code times an E4M3 scale over
        # a float32 tensor scale) are not all bfloat16 numbers, so no role
        # lets its GEMM round to bfloat16 itself.
        return fp8_backend.einsum_float32("mk,kn->mn", vx, vw)

    def input_gradient(self, call, g):
        bits = self._bits(g, "input_gradient")
        vg = self._values(call, "output_gradient", g, 1, bits)
        vw = self._kernel_values(call, call.saved["w"])
        return fp8_backend.einsum_float32("mn,kn->mk", vg, vw)

    def frozen_variables(self, shape):
        # The `[K, N]` kernel's E2M1 codes two a byte along K (the first
        # of a pair in the low nibble), its tiles' E4M3 scales (uint8
        # bits) and its tensor scale: 0.504 bytes a weight.
        k, n = shape
        tile = nvfp4.BLOCK_SIZE
        return {
            "fp8_kernel_codes": ((k // 2, n), "uint8", "zeros"),
            "fp8_kernel_scale": ((k // tile, n // tile), "uint8", "zeros"),
            "fp8_kernel_tensor_scale": ((), "float32", "ones"),
        }

    def freeze_kernel(self, kernel, recipe, input_scale=None):
        # As training's forward quantizes it: 16x16 tiles, round to
        # nearest even.
        codes, (block, tensor_scale) = nvfp4.quantize(
            ops.convert_to_tensor(kernel, "float32"), block_shape=TILE
        )
        return {
            "fp8_kernel_codes": nvfp4.pack(codes, 0),
            "fp8_kernel_scale": e4m3_bits(ops.cast(block, "float32")),
            "fp8_kernel_tensor_scale": tensor_scale,
        }

    def kernel_from_frozen(self, state, recipe):
        # The values training's forward multiplied, which the static
        # recipe's GEMM (`FrozenNvfp4`) takes as they are.
        matrix = nvfp4.dequantize(
            nvfp4.unpack(state["fp8_kernel_codes"], 0),
            (
                e4m3_values(state["fp8_kernel_scale"]),
                state["fp8_kernel_tensor_scale"],
            ),
            block_shape=TILE,
        )
        return matrix, dict(recipe=recipe)

    def kernel_gradient(self, call, g):
        k, n = call.saved["w"].shape
        # `[tokens / 16, 16, columns]`: blocks of 16 tokens along axis 1,
        # of known size where the token count is not (a TensorFlow graph
        # of unknown batch size); the same blocks as along axis 0 of the
        # padded `[tokens, columns]`.
        x = ops.reshape(
            pad_rows(call.input(), nvfp4.BLOCK_SIZE), (-1, nvfp4.BLOCK_SIZE, k)
        )
        g = ops.reshape(
            pad_rows(g, nvfp4.BLOCK_SIZE), (-1, nvfp4.BLOCK_SIZE, n)
        )
        if self.hadamard:
            x, g = nvfp4.hadamard(x, 1), nvfp4.hadamard(g, 1)
        bits = self._bits(ops.reshape(g, (-1, n)), "kernel_gradient")
        if bits is not None:
            bits = ops.reshape(bits, ops.shape(g))
        vx = ops.reshape(values(x, 1), (-1, k))
        vg = ops.reshape(values(g, 1, bits), (-1, n))
        return fp8_backend.einsum_float32("mk,mn->kn", vx, vg)


class FrozenNvfp4(Nvfp4):
    """The GEMMs of a frozen NVFP4 layer (`Recipe(formats="nvfp4",
    scaling="static")`, `keras_mp.fp8.freeze`): its kernel is the values
    of its 16x16 tiles already, dequantized from the stored codes and
    scales, and no role quantizes it again (a second NVFP4 quantization of
    NVFP4 values may pick other scales: the tensor scale of their amax is
    not the first one's). Every other operand is quantized as in
    training, so the forward is training's, bit for bit."""

    def _kernel_values(self, call, w):
        return w

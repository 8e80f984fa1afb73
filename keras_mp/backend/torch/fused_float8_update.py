"""Torch's in-place Adam update of float8 optimizer state.

`FusedFloat8Update`: `state_dtype="float8"`'s Adam step for one variable
(`keras_mp/optimizers/float8_state.py`), written as in-place PyTorch calls
over cache-sized scratch buffers, bit-identical to its `keras.ops` path.
Eager `keras.ops` allocate a fresh full-size tensor for each of the ~80
operations of a step (a page-faulting pass each: 7 times the bfloat16
state's step on a CPU); here the codes are decoded with one table lookup
and every other operation runs in place on a slice of at most
`_CHUNK_ELEMENTS` elements.
"""

from keras_mp import _keras_internals
from keras_mp import _random_bits
from keras_mp.backend.torch import fused_batches

# Whether the fused PyTorch update below may run (tests turn it off to
# compare it with the `keras.ops` path it replaces).
FUSED_TORCH_UPDATES = True

# Elements per chunk of a variable: a multiple of the block size (128), so
# that no block straddles two chunks. Seven scratch buffers of this size
# (7 MiB in all).
_CHUNK_ELEMENTS = 1 << 18
# On an accelerator a chunk costs its ~40 kernel launches whatever its
# size: chunks of 4M elements (seven buffers, 112 MiB) take most variables
# whole. On an H100, 256K-element chunks made a float8-state Adam step of
# a 25M-parameter decoder 541 ms, against 40 ms for float32 state.
_ACCELERATOR_CHUNK_ELEMENTS = 1 << 22
_BLOCK_SIZE = 128


class FusedFloat8Update:
    """Adam's float8 update of one variable, in place (PyTorch only).

    The same arithmetic as `Float8Adam.update_step`, in the same order and
    with the same float32 roundings: every operation of it is the PyTorch
    kernel `keras.ops` would call (in place where it can be), chunk by
    chunk of whole blocks, so codes, scales and the weight come out bit
    for bit as on that path (the decode is the same lookup in the 256
    values of E4M3, as `index_select` with int32 indices).

    Args:
        scale_from_amax: `keras_mp._fp8.formats.e4m3_e5m2.scale_from_amax`.
        values: The float32 values of the 256 codes (a NumPy array), those
            `e4m3_e5m2.e4m3_values` looks up.
    """

    def __init__(self, scale_from_amax, values):
        import torch

        self._scale_from_amax = scale_from_amax
        self._table = torch.from_numpy(values.copy())
        self._buffers = None

    def applies(self, gradient, variable, slots):
        """Whether the fused update can run: on PyTorch tensors of a float32
        variable, its gradient and contiguous slots, outside a stateless
        scope (where updates must not touch the variables in place)."""
        import torch

        if not FUSED_TORCH_UPDATES or _keras_internals.in_stateless_scope():
            return False
        value = variable.value
        if (
            value.dtype != torch.float32
            or not value.is_contiguous()
            or not isinstance(gradient, torch.Tensor)
            or gradient.shape != value.shape
            or gradient.device != value.device
        ):
            return False
        for codes, scales in slots:
            if not (
                codes.value.is_contiguous()
                and scales.value.is_contiguous()
                and codes.value.device == value.device
            ):
                return False
        return True

    def __call__(self, gradient, variable, slots, coefficients, seed):
        """Updates `variable` and its moments' codes and scales in place.

        Args:
            gradient: The gradient, a tensor of the variable's shape.
            variable: The float32 Keras variable.
            slots: `((m_codes, m_scales), (v_codes, v_scales))`, Keras
                variables; `v`'s codes hold its square root.
            coefficients: `(alpha, 1 - beta_1, 1 - beta_2, epsilon)`,
                float32 0-d tensors as `update_step` computes them.
            seed: The int32 key pair of `v`'s stochastic rounding, or None
                to round it to nearest.
        """
        import torch

        with torch.no_grad(), _keras_internals.without_autocast():
            self._update(gradient, variable, slots, coefficients, seed)

    def _update(self, gradient, variable, slots, coefficients, seed):
        import torch

        alpha, one_minus_beta_1, one_minus_beta_2, epsilon = coefficients
        weight = variable.value.view(-1)
        gradient = gradient.to(torch.float32).reshape(-1)
        (m_codes, m_scales), (v_codes, v_scales) = [
            (codes.value.view(-1), scales.value) for codes, scales in slots
        ]
        key = None
        if seed is not None:
            # `_random_bits.random_bits`'s key: each element's bits hash its
            # index plus this.
            key = _random_bits.hash32(seed[0] * -1640531527 + seed[1])
        size = weight.numel()
        chunk = (
            _CHUNK_ELEMENTS
            if weight.device.type == "cpu"
            else _ACCELERATOR_CHUNK_ELEMENTS
        )
        self._ensure_buffers(min(size, chunk), weight.device)
        for start in range(0, size, chunk):
            stop = min(start + chunk, size)
            blocks = slice(start // _BLOCK_SIZE, -(-stop // _BLOCK_SIZE))
            n = stop - start
            m, t, r, i0, i1, i2, i3 = [b[:n] for b in self._buffers]
            g = gradient[start:stop]
            # m += (g - m) * (1 - beta_1)
            self._decode(m_codes[start:stop], m_scales[blocks], m, i0)
            torch.sub(g, m, out=t)
            t.mul_(one_minus_beta_1)
            m.add_(t)
            # v = root * root; v += (g * g - v) * (1 - beta_2); root = sqrt(v)
            self._decode(v_codes[start:stop], v_scales[blocks], r, i0)
            r.mul_(r)
            torch.square(g, out=t)
            t.sub_(r)
            t.mul_(one_minus_beta_2)
            r.add_(t)
            r.sqrt_()
            self._quantize(
                m, m_codes[start:stop], m_scales[blocks], t, i0, i1, i2, i3
            )
            chunk_key = None if key is None else key + start
            self._quantize(
                r,
                v_codes[start:stop],
                v_scales[blocks],
                t,
                i0,
                i1,
                i2,
                i3,
                chunk_key,
            )
            # variable -= m * alpha / (root + epsilon)
            m.mul_(alpha)
            r.add_(epsilon)
            m.div_(r)
            weight[start:stop].sub_(m)

    def _ensure_buffers(self, size, device):
        import torch

        if (
            self._buffers is not None
            and self._buffers[0].numel() >= size
            and self._buffers[0].device == device
        ):
            return
        floats = [torch.empty(size, dtype=torch.float32, device=device)]
        floats += [torch.empty_like(floats[0]) for _ in range(2)]
        ints = [
            torch.empty(size, dtype=torch.int32, device=device)
            for _ in range(4)
        ]
        self._buffers = floats + ints
        self._index = torch.arange(size, dtype=torch.int32, device=device)
        if self._table.device != device:
            self._table = self._table.to(device)

    def _decode(self, codes, scales, out, ints):
        """`dequantize`: the codes' values times their block's scale."""
        import torch

        ints.copy_(codes)
        torch.index_select(self._table, 0, ints, out=out)
        _per_block(out, scales, "mul_")

    def _quantize(self, x, codes, scales, y, i0, i1, i2, i3, key=None):
        """`quantize` of float32 `x` (left as it is) into `codes` and
        `scales`, with scratch `y` (float32) and `i0`..`i3` (int32)."""
        import torch

        # amax: a NaN counts as inf (`backend.fp8.amax`); the zeros that
        # pad the last block never change a max of magnitudes.
        torch.abs(x, out=y)
        full = x.numel() // _BLOCK_SIZE * _BLOCK_SIZE
        amax = y[:full].view(-1, _BLOCK_SIZE).amax(1)
        if full < x.numel():
            amax = torch.cat([amax, y[full:].amax().reshape(1)])
        amax = torch.where(torch.isnan(amax), float("inf"), amax)
        scales.copy_(self._scale_from_amax(amax, "e4m3"))
        # y = x / scale
        y.copy_(x)
        _per_block(y, scales, "div_")
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
            torch.add(self._index[: x.numel()], key, out=i2)
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


def _per_block(x, scales, method):
    """`x`'s blocks of 128 (the last one possibly short) times or divided by
    their scale, in place."""
    full = x.numel() // _BLOCK_SIZE
    if full:
        head = x[: full * _BLOCK_SIZE].view(full, _BLOCK_SIZE)
        getattr(head, method)(scales[:full, None])
    if full * _BLOCK_SIZE < x.numel():
        getattr(x[full * _BLOCK_SIZE :], method)(scales[full])

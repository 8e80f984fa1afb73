"""Adam's update of 16-bit and float8 optimizer state in one Triton
kernel per variable, on CUDA.

`fused_state_update.FusedStateUpdate` runs an update rule as a few dozen
in-place torch calls per batch of elements: on a CPU that keeps each pass
in its caches, but on a CUDA device each call is a kernel launch (about
20 us of host time on an H200) and a pass over the batch's bytes. Here
Keras's `Adam.update_step` (AdamW's decay is Keras's, applied before it)
on bfloat16, float16 or float8 slots of a float32 variable is one kernel
launch per variable, which reads the gradient, the variable and each
slot once and writes each once (issue 46, item 4), the state dtype, the
rounding and amsgrad compile-time constants: `adam_16bit`, and
`adam_float8` for float8 state's E4M3 codes with a power-of-two scale per
block of 128 (`float8_state.STORAGE`: the second moment stored as its
square root, rounded stochastically; without amsgrad, as the batch path).

Its bits are the batch path's, `update_rules.Adam` run on `_BatchLanes`:

- the arithmetic in the rule's order, each step rounded to float32 (the
  launch turns off the fusion of a product and a sum into one FMA; the
  square root and the division are the correctly rounded ones);
- a 16-bit slot stored rounded, and read back rounded, as `update_step`
  reads the slot variable: bfloat16 by its bits, to nearest (ties to even)
  or stochastically with the counter hash of `keras_mp._random_bits` (the
  same keys, element `i` of a variable hashed at `i + key`); float16 by
  the cast, which rounds to nearest as torch's does;
- a float8 slot decoded by the codes' table times the block's scale, and
  encoded as `float8_codes.Float8Codes.encode` does: the block's amax (a
  NaN counts as inf), its scale by `scale_from_amax`'s bit arithmetic, the
  values divided by it, `e4m3_e5m2.e4m3_code_program` step for step (its
  constants passed in), the update going on with the float32 moments;
- a NaN where the batch path has one. Its bits are the device's: a NaN is
  stored by the float32-to-bfloat16 conversion torch's CUDA cast runs
  (PTX's `cvt.rn`, one canonical NaN), and CUDA's arithmetic gives every
  NaN one payload, where a CPU's keeps signs and payloads its own way
  (the interpreter's NumPy and torch's vector loops differ): the tests
  compare where the NaNs are, and every other bit.

The kernels compile lazily (Triton is imported at first use, on CUDA
alone) and launch through `fp8_operands.run_kernel`: where one cannot build,
a warning, and the batch path from then on. `UPDATE_KERNELS` turns them off
(tests compare the two paths).
"""

import numpy as np

# Whether the update kernel runs where Triton serves (tests compare it with
# the batch path).
UPDATE_KERNELS = True

# Elements per program. An elementwise kernel of about 20 bytes an element:
# not timed on a GPU yet.
_BLOCK = 1024
_WARPS = 4

# The state dtypes, as the 16-bit kernel's compile-time constant (float8
# state has a kernel of its own).
_STATES = {"bfloat16": 0, "float16": 1, "float8": None}
# float8 state: blocks of 128 per program of the kernel.
_ROWS = 8
# Variables of this many elements or more take the batch path: the kernels'
# element indices (and stochastic rounding's counters) are int32.
_LARGEST = 2**31 - _BLOCK * _ROWS

# The kernel's name for `fp8_operands.run_kernel` (a failed one is not
# launched again).
_NAME = "triton_adam"
_kernel = None
_kernel_float8 = None


def serves(tensor, state_dtype, stochastic):
    """Whether `adam` runs its kernel for variables like `tensor` with
    slots of `state_dtype`, rounded stochastically where `stochastic` (a
    caller asks before it gathers the slots)."""
    from keras_mp.backend.torch import fp8_operands

    return (
        UPDATE_KERNELS
        and state_dtype in _STATES
        and (state_dtype != "float16" or not stochastic)
        and fp8_operands.kernel_serves(_NAME, tensor)
    )


def adam(
    variables, grads, slots, alpha, constants, seed, state_dtype, codec=None
):
    """Adam's update of each float32 variable in `variables` (flat,
    contiguous, on one device) and its `slots` (per variable `[momentum,
    velocity]`, plus `velocity_hat` with amsgrad on 16-bit state), one
    kernel launch a variable: True, or None where the kernel does not serve
    (the caller's batch path runs; nothing was written).

    Args:
        grads: float32 gradients, flat and contiguous.
        alpha: `update_rules.Adam.constants`' alpha, a float32 tensor.
        constants: `(1 - beta_1, 1 - beta_2, epsilon)`, Python numbers.
        seed: The int32 state `[s0, s1]` of stochastic rounding's seed
            generator (not moved on here: the caller adds the draws, one
            per slot store), or None to round to nearest. The key of the
            j-th store of this step is `hash32(s0 * -1640531527 + s1 + j)`,
            as `FusedStateUpdate._draw_keys` draws them, made inside the
            kernel: no launches of their own.
        state_dtype: "bfloat16", "float16" or "float8" (Adam without
            amsgrad: each slot `(codes, scales)`, the second moment's
            codes its square root's, rounded stochastically with `seed`).
        codec: float8 state's `float8_codes.Float8Codes` (the codes'
            values, the block size and the encoder's constants).
    """
    from keras_mp.backend.torch import fp8_operands

    if not variables or not serves(variables[0], state_dtype, seed is not None):
        return None
    if any(variable.numel() >= _LARGEST for variable in variables):
        # The kernels index elements in int32.
        return None
    return fp8_operands.run_kernel(
        _NAME,
        "the optimizer update",
        variables[0],
        _triton_adam,
        variables,
        grads,
        slots,
        alpha,
        constants,
        seed,
        state_dtype,
        codec,
    )


def _triton_adam(variables, grads, slots, alpha, constants, seed, state, codec):
    import torch

    # The hyperparameters as the float32 values torch's in-place calls
    # multiply by (a Python number is rounded to a float32 tensor's dtype).
    constants = tuple(float(np.float32(c)) for c in constants)
    alpha = alpha.reshape(1).to(torch.float32)
    if state == "float8":
        return _triton_adam_float8(
            variables, grads, slots, alpha, constants, seed, codec
        )
    one_minus_beta_1, one_minus_beta_2, epsilon = constants
    kernel = _adam_kernel()
    bfloat16 = state == "bfloat16"
    amsgrad = len(slots[0]) == 3
    for index, (variable, grad, variable_slots) in enumerate(
        zip(variables, grads, slots)
    ):
        size = variable.numel()
        if not size:
            continue
        if bfloat16:
            variable_slots = [slot.view(torch.int16) for slot in variable_slots]
        momentum, velocity, *rest = variable_slots
        kernel[(_cdiv(size, _BLOCK),)](
            variable,
            grad,
            momentum,
            velocity,
            rest[0] if amsgrad else momentum,
            alpha,
            alpha if seed is None else seed,
            index * len(variable_slots),
            size,
            one_minus_beta_1,
            one_minus_beta_2,
            epsilon,
            STATE=_STATES[state],
            STOCHASTIC=seed is not None,
            AMSGRAD=amsgrad,
            BLOCK=_BLOCK,
            num_warps=_WARPS,
            enable_fp_fusion=False,
        )
    return True


def _triton_adam_float8(variables, grads, slots, alpha, constants, seed, codec):
    kernel = _float8_kernel()
    one_minus_beta_1, one_minus_beta_2, epsilon = constants
    table = codec.table(variables[0].device)
    exponent, carry, low, high = codec.scale_constants
    block = codec.block_size
    for index, (variable, grad, ((m, m_scales), (v, v_scales))) in enumerate(
        zip(variables, grads, slots)
    ):
        size = variable.numel()
        if not size:
            continue
        kernel[(_cdiv(_cdiv(size, block), _ROWS),)](
            variable,
            grad,
            m,
            m_scales,
            v,
            v_scales,
            table,
            alpha,
            alpha if seed is None else seed,
            index,
            size,
            one_minus_beta_1,
            one_minus_beta_2,
            epsilon,
            exponent,
            carry,
            low,
            high,
            STOCHASTIC=seed is not None,
            ROWS=_ROWS,
            BLOCK_SIZE=block,
            num_warps=_WARPS,
            enable_fp_fusion=False,
            **codec.code_constants,
        )
    return True


def _cdiv(a, b):
    return -(-a // b)


def _adam_kernel():
    global _kernel
    if _kernel is None:
        _kernel = _make_adam_kernel()
    return _kernel


def _float8_kernel():
    global _kernel_float8
    if _kernel_float8 is None:
        _kernel_float8 = _make_float8_kernel()
    return _kernel_float8


def _make_adam_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adam_16bit(
        variable_ptr,
        grad_ptr,
        momentum_ptr,
        velocity_ptr,
        velocity_hat_ptr,
        alpha_ptr,
        seed_ptr,
        first_draw,
        size,
        one_minus_beta_1,
        one_minus_beta_2,
        epsilon,
        STATE: tl.constexpr,
        STOCHASTIC: tl.constexpr,
        AMSGRAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < size
        alpha = tl.load(alpha_ptr)
        if STOCHASTIC:
            # The noise of every slot's store from one hash of a
            # (BLOCK, 4) tile: element index plus the slot's key
            # (`_random_bits.random_bits`, the hash's right shifts
            # logical), the low 16 bits kept. A slot's key is the hash of
            # its draw, `FusedStateUpdate._draw_keys`' computation.
            slots = tl.arange(0, 4)
            h = tl.load(seed_ptr) * -1640531527 + tl.load(seed_ptr + 1)
            h = h + first_draw + slots
            # The hash twice: of each store's draw (its key), then of each
            # element's index plus its store's key.
            for hashed in tl.static_range(2):
                if hashed == 1:
                    h = offsets[:, None] + h[None, :]
                h = h ^ (h.to(tl.uint32, bitcast=True) >> 16).to(
                    tl.int32, bitcast=True
                )
                h = h * 0x7FEB352D
                h = h ^ (h.to(tl.uint32, bitcast=True) >> 15).to(
                    tl.int32, bitcast=True
                )
                h = h * -2073254261
                h = h ^ (h.to(tl.uint32, bitcast=True) >> 16).to(
                    tl.int32, bitcast=True
                )
            h = h & 0xFFFF
        g = tl.load(grad_ptr + offsets, mask=mask, other=0.0)

        # Each slot loaded, updated, stored rounded and read back rounded,
        # in `update_step`'s order: m += (g - m) * (1 - beta_1), then
        # v += (g * g - v) * (1 - beta_2), then with amsgrad
        # v_hat = maximum(v_hat, v) (a NaN wins), which the update reads:
        # z the momentum read back, w the velocity (or v_hat).
        z = g
        w = g
        for slot in tl.static_range(3):
            if slot < 2 or AMSGRAD:
                if slot == 0:
                    pointer = momentum_ptr
                elif slot == 1:
                    pointer = velocity_ptr
                else:
                    pointer = velocity_hat_ptr
                if STATE == 0:
                    x = tl.load(pointer + offsets, mask=mask, other=0)
                    x = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
                else:
                    x = tl.load(pointer + offsets, mask=mask, other=0.0)
                    x = x.to(tl.float32)
                if slot == 0:
                    y = g - x
                    y = y * one_minus_beta_1
                    x = x + y
                elif slot == 1:
                    y = g * g
                    y = y - x
                    y = y * one_minus_beta_2
                    x = x + y
                else:
                    x = tl.maximum(x, w, propagate_nan=tl.PropagateNan.ALL)
                if STATE == 0:
                    bits = x.to(tl.int32, bitcast=True)
                    if STOCHASTIC:
                        noise = tl.where(slots[None, :] == slot, h, 0)
                        bits = bits + tl.sum(noise, axis=1)
                    else:
                        bits = bits + 0x7FFF + ((bits >> 16) & 1)
                    # A NaN as the device's conversion stores it.
                    nan = x.to(tl.bfloat16).to(tl.int16, bitcast=True)
                    half = tl.where(
                        x != x,
                        nan.to(tl.int32) & 0xFFFF,
                        (bits >> 16) & 0xFFFF,
                    )
                    tl.store(pointer + offsets, half.to(tl.int16), mask=mask)
                    x = (half << 16).to(tl.float32, bitcast=True)
                else:
                    half = x.to(tl.float16)
                    tl.store(pointer + offsets, half, mask=mask)
                    x = half.to(tl.float32)
                if slot == 0:
                    z = x
                else:
                    w = x

        # variable -= m * alpha / (sqrt(v) + epsilon)
        z = z * alpha
        w = tl.sqrt_rn(w)
        w = w + epsilon
        z = tl.div_rn(z, w)
        x = tl.load(variable_ptr + offsets, mask=mask, other=0.0)
        tl.store(variable_ptr + offsets, x - z, mask=mask)

    return adam_16bit


def _make_float8_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adam_float8(
        variable_ptr,
        grad_ptr,
        momentum_ptr,
        momentum_scale_ptr,
        velocity_ptr,
        velocity_scale_ptr,
        table_ptr,
        alpha_ptr,
        seed_ptr,
        draw,
        size,
        one_minus_beta_1,
        one_minus_beta_2,
        epsilon,
        exponent,
        carry,
        low,
        high,
        STOCHASTIC: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        MIN_NORMAL_EXPONENT: tl.constexpr,
        NAN_CODE: tl.constexpr,
        SIGN: tl.constexpr,
    ):
        # A tile of ROWS blocks of BLOCK_SIZE elements, one scale a block.
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        offsets = rows[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]
        mask = offsets < size
        row_mask = rows * BLOCK_SIZE < size
        alpha = tl.load(alpha_ptr)
        g = tl.load(grad_ptr + offsets, mask=mask, other=0.0)

        # Each slot decoded: its code's value times its block's scale.
        codes = tl.load(momentum_ptr + offsets, mask=mask, other=0)
        m = tl.load(table_ptr + codes.to(tl.int32), mask=mask, other=0.0)
        scale = tl.load(momentum_scale_ptr + rows, mask=row_mask, other=1.0)
        m = m * scale[:, None]
        codes = tl.load(velocity_ptr + offsets, mask=mask, other=0)
        w = tl.load(table_ptr + codes.to(tl.int32), mask=mask, other=0.0)
        scale = tl.load(velocity_scale_ptr + rows, mask=row_mask, other=1.0)
        w = w * scale[:, None]
        # m += (g - m) * (1 - beta_1)
        y = g - m
        y = y * one_minus_beta_1
        m = m + y
        # v += (g * g - v) * (1 - beta_2), v stored as its square root.
        v = w * w
        y = g * g
        y = y - v
        y = y * one_minus_beta_2
        v = v + y
        w = tl.sqrt_rn(v)

        # Each slot encoded (`state_formats.quantize`): its block's scale
        # from the block's amax (a NaN counts as inf), the values divided
        # by it, their E4M3 codes by `e4m3_e5m2.e4m3_code_program` step for
        # step; the second moment's rounded stochastically where asked.
        # The update goes on with the float32 moments.
        for slot in tl.static_range(2):
            if slot == 0:
                value = m
                codes_ptr = momentum_ptr
                scale_ptr = momentum_scale_ptr
            else:
                value = w
                codes_ptr = velocity_ptr
                scale_ptr = velocity_scale_ptr
            magnitude = tl.where(mask, tl.abs(value), 0.0)
            nan = tl.max((magnitude != magnitude).to(tl.int32), axis=1)
            amax = tl.max(
                tl.where(magnitude != magnitude, 0.0, magnitude), axis=1
            )
            amax = tl.where(nan > 0, float("inf"), amax)
            bits = tl.minimum(amax.to(tl.int32, bitcast=True), 0x7F800000)
            biased = (bits + carry) >> 23
            biased = tl.minimum(tl.maximum(biased - exponent, low), high)
            scale = (biased << 23).to(tl.float32, bitcast=True)
            scale = tl.where(amax == 0.0, 1.0, scale)
            finite = (amax == amax) & (amax != float("inf"))
            scale = tl.where(finite, scale, amax)
            tl.store(scale_ptr + rows, scale, mask=row_mask)
            y = tl.div_rn(value, scale[:, None])
            bits = y.to(tl.int32, bitcast=True)
            i0 = bits & 0x7FFFFFFF
            i1 = tl.maximum(i0 >> 23, MIN_NORMAL_EXPONENT)
            i2 = ((i1 + 1) >> 8) * NAN_CODE
            bits = ((bits >> 24) & SIGN) | i2
            steps = i0.to(tl.float32, bitcast=True) * ((257 - i1) << 23).to(
                tl.float32, bitcast=True
            )
            if STOCHASTIC and slot == 1:
                # 24 random bits as a float32 in [0, 1): the hash of the
                # element's index plus the store's key (the hash of its
                # draw), the hash's right shifts logical.
                h = tl.load(seed_ptr) * -1640531527 + tl.load(seed_ptr + 1)
                h = h + draw
                for hashed in tl.static_range(2):
                    if hashed == 1:
                        h = offsets + h
                    h = h ^ (h.to(tl.uint32, bitcast=True) >> 16).to(
                        tl.int32, bitcast=True
                    )
                    h = h * 0x7FEB352D
                    h = h ^ (h.to(tl.uint32, bitcast=True) >> 15).to(
                        tl.int32, bitcast=True
                    )
                    h = h * -2073254261
                    h = h ^ (h.to(tl.uint32, bitcast=True) >> 16).to(
                        tl.int32, bitcast=True
                    )
                uniform = ((h >> 8) & 0xFFFFFF).to(tl.float32)
                uniform = uniform * 5.9604644775390625e-08
                steps = tl.floor(steps + uniform)
            steps = steps + 8388608.0
            i2 = steps.to(tl.int32, bitcast=True) - 0x4B000000
            i2 = i2 + (i1 - MIN_NORMAL_EXPONENT) * 8
            i2 = tl.minimum(tl.maximum(i2, 0), 126) | bits
            tl.store(codes_ptr + offsets, i2.to(tl.uint8), mask=mask)

        # variable -= m * alpha / (sqrt(v) + epsilon)
        z = m * alpha
        w = w + epsilon
        z = tl.div_rn(z, w)
        x = tl.load(variable_ptr + offsets, mask=mask, other=0.0)
        tl.store(variable_ptr + offsets, x - z, mask=mask)

    return adam_float8

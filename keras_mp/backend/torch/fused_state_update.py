"""Torch's fused in-place update of 16-bit optimizer state.

`FusedStateUpdate`: for Keras's Adam, AdamW, SGD and RMSprop on PyTorch,
the per-variable `update_step` with 16-bit slots, run as a few multi-tensor
calls per batch of elements over cache-sized scratch buffers, bit-identical
to that path. What `keras.ops` cannot express; the batches it runs over are
in `fused_batches.py`.
"""

from keras import ops

from keras_mp import _keras_internals
from keras_mp import _random_bits
from keras_mp.backend.torch import float8_codes
from keras_mp.backend.torch import fused_batches

# Whether the fused PyTorch update below may run (tests turn it off to
# compare it with the per-variable path it replaces).
FUSED_TORCH_UPDATES = True

# Elements per batch of the fused PyTorch update: each batch runs every step
# of the update over scratch buffers of this size (5 of them, 5 MiB in
# all), so the ~60 passes of a stochastically rounded Adam step work on
# data in the CPU's caches instead of main memory, and the per-call cost of
# eager PyTorch (a few microseconds) is paid ~60 times a batch, not ~60
# times a variable.
_BATCH_ELEMENTS = 1 << 18
# On an accelerator each eager call costs a kernel launch (microseconds)
# whatever its size, and caches do not decide: batches of 4M elements
# (5 buffers of 16 MiB) take most variables whole.
_ACCELERATOR_BATCH_ELEMENTS = 1 << 22


def batch_elements(device):
    """Elements per batch of the fused update on a torch `device`."""
    return (
        _BATCH_ELEMENTS
        if device.type == "cpu"
        else (_ACCELERATOR_BATCH_ELEMENTS)
    )


class FusedStateUpdate:
    """The update of Keras's PyTorch Adam, AdamW, SGD or RMSprop on
    low-precision slots, bit-identical to the per-variable path.

    The per-variable path (`update_step` under a float32 autocast scope,
    each slot store computed in float32 and rounded by the wrapper's
    hooks) costs two to five times Keras's own float32 update on PyTorch:
    dozens of eager `keras.ops` calls per variable, each allocating a full
    size result. This runs the same arithmetic, in the same order and with
    the same float32 roundings, in batches of `_BATCH_ELEMENTS` elements
    over persistent scratch buffers, with in-place PyTorch ops (and
    `torch._foreach_*` where a batch spans several variables):

    - a slot is upcast into a buffer, updated there, and stored rounded:
      to nearest with PyTorch's cast, or stochastically with the bits of
      `stochastic_round_to_bfloat16` (the same hash of the same element
      index and key, the keys drawn from the same seed generator in the
      same order: one per slot store, variable by variable);
    - the update of the variable reads the rounded slot, as `update_step`
      does when it reads the slot variable back.

    Weights and slots come out bit for bit as on the per-variable path,
    NaNs included, with one exception: once a NaN reaches float16 state
    (bfloat16 stores every NaN alike), its payload bits may differ, as
    PyTorch's vector and scalar loops give NaNs different payloads and a
    lane's place in a batch is not its place in its variable.

    It declines (returns False, and the per-variable path runs) for any
    other optimizer class, an `update_step` replaced on the instance, a
    variable that is not float32 (16-bit variables keep Keras's 16-bit
    update), slots not in `state_dtype`, and inside a stateless scope
    (where updates must not touch the variables' tensors in place).

    Args:
        optimizer: The Keras optimizer whose slots are in `state_dtype`.
        state_dtype: "bfloat16" or "float16".
        stochastic_rounding: Whether bfloat16 stores round stochastically.
        seed_generator: A callable returning the `keras.random.SeedGenerator`
            of stochastic rounding (created when the wrapper is built).
        update_step: The `update_step` the wrapper set on the optimizer; any
            other found there at update time means someone changed the
            update, and the per-variable path runs.
    """

    def __init__(
        self,
        optimizer,
        state_dtype,
        stochastic_rounding,
        seed_generator,
        update_step,
        float8_codes=None,
        scales_of=None,
    ):
        import torch

        self._optimizer = optimizer
        self._state_dtype = {
            "bfloat16": torch.bfloat16,
            "float16": torch.float16,
            "float8": torch.uint8,
        }[state_dtype]
        # float8 state: the codec, and each codes slot's scales variable.
        self._float8 = float8_codes
        self._scales_of = scales_of
        self._stochastic_rounding = stochastic_rounding
        self._seed_generator = seed_generator
        self._update_step = update_step
        # Per device: scratch buffers, and layouts keyed by the sizes.
        self._buffers = {}
        self._layouts = {}

    def __call__(self, grads, variables, learning_rate):
        import torch

        if not FUSED_TORCH_UPDATES or _keras_internals.in_stateless_scope():
            return False
        optimizer = self._optimizer
        if optimizer.__dict__.get("update_step") is not self._update_step:
            return False
        state = _keras_internals.torch_builtin_update_state(optimizer)
        if state is None:
            return False
        kind, slot_lists, variable_index = state
        if self._float8 is not None and (
            kind != "adam" or len(slot_lists) != 2
        ):
            # float8 state holds Adam's moments; with amsgrad the update
            # runs per variable (`float8_state.Float8Adam`).
            return False
        with _keras_internals.without_autocast():
            tensors = [variable.value for variable in variables]
            slots = []
            for variable in variables:
                index = variable_index(variable)
                variable_slots = [slot_list[index] for slot_list in slot_lists]
                if any(slot is None for slot in variable_slots):
                    return False
                if self._float8 is not None:
                    # Each slot as its codes and their block scales.
                    scales = [self._scales_of(slot) for slot in variable_slots]
                    if any(
                        s is None or not s.value.is_contiguous() for s in scales
                    ):
                        return False
                    slots.append(
                        [
                            (slot.value, s.value)
                            for slot, s in zip(variable_slots, scales)
                        ]
                    )
                    continue
                slots.append([slot.value for slot in variable_slots])
        device = tensors[0].device if tensors else None
        for tensor, variable_slots in zip(tensors, slots):
            if (
                tensor.dtype != torch.float32
                or not tensor.is_contiguous()
                or tensor.device != device
            ):
                return False
            for slot in variable_slots:
                if self._float8 is not None:
                    slot = slot[0]
                if (
                    slot.dtype != self._state_dtype
                    or slot.shape != tensor.shape
                    or not slot.is_contiguous()
                ):
                    return False
        flat_grads = []
        for grad, tensor in zip(grads, tensors):
            if (
                not isinstance(grad, torch.Tensor)
                or grad.shape != tensor.shape
                or grad.device != device
            ):
                return False
            # `update_step` casts the gradient to the variable's dtype.
            flat_grads.append(grad.to(torch.float32).reshape(-1))
        layout = self._layout([tensor.numel() for tensor in tensors], device)
        run = {
            "adam": self._adam,
            "sgd": self._sgd,
            "rmsprop": self._rmsprop,
        }[kind](learning_rate)
        # float8 state: one stochastically rounded store per variable, the
        # second moment's (`float8_state.Float8Adam._store`).
        keys = self._keys(
            layout, 1 if self._float8 is not None else len(slot_lists)
        )
        flat_tensors = [tensor.view(-1) for tensor in tensors]
        if self._float8 is None:
            flat_slots = [[slot.view(-1) for slot in s] for s in slots]
        else:
            flat_slots = [
                [_Float8Slot(codes.view(-1), scales) for codes, scales in s]
                for s in slots
            ]
        for batch in layout.batches:
            segments = batch.segments
            grad_views = [flat_grads[i][a:b] for i, a, b in segments]
            variable_views = [flat_tensors[i][a:b] for i, a, b in segments]
            slot_views = [
                [flat_slots[i][k][a:b] for i, a, b in segments]
                for k in range(len(slot_lists))
            ]
            batch_keys = (
                None
                if keys is None
                else [k[batch.first : batch.last] for k in keys]
            )
            run(batch, grad_views, variable_views, slot_views, batch_keys)
        return True

    # ------------------------------------------------------------ layout
    def _layout(self, sizes, device):
        key = (tuple(sizes), device)
        layout = self._layouts.get(key)
        if layout is None:
            elements = batch_elements(device)
            if self._float8 is not None:
                # One variable a batch, in whole blocks of 128.
                elements = max(BLOCK, elements // BLOCK * BLOCK)
            layout = fused_batches.Layout(
                sizes, elements, device, shared=self._float8 is None
            )
            self._ensure_buffers(layout.largest_batch, device)
            layout.bind(self._buffers[device])
            self._layouts[key] = layout
        return layout

    def _ensure_buffers(self, size, device):
        import torch

        buffers = self._buffers.get(device)
        if buffers is not None and buffers["size"] >= size:
            return
        # Buffers of an earlier, smaller layout are replaced: the views of
        # the layouts on this device are rebound.
        self._buffers[device] = buffers = {
            "size": size,
            # x, y, z, w; float8 state adds four, viewed as int32 (the
            # scratch of its decode and encode).
            "float": [
                torch.empty(size, dtype=torch.float32, device=device)
                for _ in range(4 if self._float8 is None else 8)
            ],
            "index": torch.arange(size, dtype=torch.int32, device=device),
        }
        for (_, on), layout in self._layouts.items():
            if on == device:
                layout.bind(buffers)

    # -------------------------------------------------- stochastic keys
    def _keys(self, layout, slots_per_variable):
        """Per slot, the keys of each segment's first element; None without
        stochastic rounding or slots.

        `stochastic_round_to_bfloat16` draws one seed per slot store
        (`SeedGenerator.next`: the state, then the state plus [0, 1]) and
        hashes `seed[0] * -1640531527 + seed[1]` into the key that is
        added to each element's index. The stores run variable by variable,
        slot by slot, so the j-th draw of this step is the state plus
        [0, j]: all keys come from one small computation, and the state
        moves on by the number of draws, as after that many `next` calls.
        """
        import torch

        if not self._stochastic_rounding or not slots_per_variable:
            return None
        seed_state = self._seed_generator().state
        state = seed_state.value
        draws = layout.variables * slots_per_variable
        base = state[0] * -1640531527 + state[1]
        draw = torch.arange(draws, dtype=torch.int32, device=base.device).view(
            layout.variables, slots_per_variable
        )
        keys = _random_bits.hash32(base + draw)
        seed_state.assign(state + layout.increment(draws))
        # Each segment's first element is element `start` of its variable
        # and sits at `offset` in the batch's index buffer.
        per_segment = (
            keys.index_select(0, layout.segment_variables)
            + (layout.segment_shifts[:, None])
        )
        return [column.unbind() for column in per_segment.t()]

    # ---------------------------------------------------- load and store
    def _load(self, batch, out, slot_views, square=False):
        """The slots' float32 values into `out`: upcast, or for float8
        decoded (`square`: the codes hold a square root)."""
        import torch

        if self._float8 is None:
            torch._foreach_copy_(batch.views(out), slot_views)
            return
        codes, scales = slot_views[0]
        self._float8.decode(codes, scales, out, batch.ints(batch.buffers[4]))
        if square:
            out.mul_(out)

    def _store(self, batch, source, result, scratch, slot_views, keys):
        """Stores float32 `source` in the slots, rounded, and leaves in
        `result` the rounded value upcast (what `update_step` reads back).

        Stochastic: `stochastic_round_to_bfloat16`'s bits, in place. The
        NaN test (`where(isnan(value), value, truncated)` there) is done
        on the bits: `(bits & 0x7FFFFFFF) + 0x7FFFFF` overflows exactly
        for NaNs, whose lanes become all ones (a NaN) before the low half
        is cut off; PyTorch's cast stores every NaN alike, so the slot
        gets the same bits.
        """
        import torch

        if self._float8 is not None:
            # float8: `result` is `source` itself (Adam's update reads the
            # float32 moments, not their codes); one segment a batch.
            result.copy_(source)
            codes, scales = slot_views[0]
            ints = [batch.ints(buffer) for buffer in batch.buffers[4:]]
            self._float8.encode(
                source,
                codes,
                scales,
                scratch,
                ints,
                batch.index,
                None if keys is None else keys[0],
            )
            return
        if keys is None:
            torch._foreach_copy_(slot_views, batch.views(source))
            torch._foreach_copy_(batch.views(result), slot_views)
            return
        bits = batch.ints(source)
        noise = batch.ints(result)
        temporary = batch.ints(scratch)
        noise.copy_(batch.index)
        torch._foreach_add_(batch.int_views(result), keys)
        fused_batches.hash32_in_place(noise, temporary, low_bits_only=True)
        noise.bitwise_and_(0xFFFF)
        noise.add_(bits)
        bits.bitwise_and_(0x7FFFFFFF)
        bits.add_(0x7FFFFF)
        bits.bitwise_right_shift_(31)
        noise.bitwise_or_(bits)
        noise.bitwise_and_(-65536)
        torch._foreach_copy_(slot_views, batch.views(result))

    # ----------------------------------------------------- update rules
    def _adam(self, learning_rate):
        """Adam's `update_step`, float32 (`alpha` as it computes it)."""
        import torch

        optimizer = self._optimizer
        dtype = "float32"
        lr = ops.cast(learning_rate, dtype)
        local_step = ops.cast(optimizer.iterations + 1, dtype)
        beta_1_power = ops.power(ops.cast(optimizer.beta_1, dtype), local_step)
        beta_2_power = ops.power(ops.cast(optimizer.beta_2, dtype), local_step)
        alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        one_minus_beta_1 = 1 - optimizer.beta_1
        one_minus_beta_2 = 1 - optimizer.beta_2
        epsilon = optimizer.epsilon
        amsgrad = optimizer.amsgrad

        float8 = self._float8 is not None

        def run(batch, grads, variable_views, slot_views, keys):
            x, y, z, w = batch.buffers[:4]
            m, v = slot_views[0], slot_views[1]
            key = (lambda k: None) if keys is None else keys.__getitem__
            # m += (g - m) * (1 - beta_1)
            self._load(batch, x, m)
            torch._foreach_copy_(batch.views(y), grads)
            y.sub_(x)
            y.mul_(one_minus_beta_1)
            x.add_(y)
            # float8 rounds the first moment to nearest; its one key per
            # variable is the second moment's.
            self._store(batch, x, z, w, m, None if float8 else key(0))
            # v += (g * g - v) * (1 - beta_2)
            self._load(batch, x, v, square=True)
            torch._foreach_copy_(batch.views(y), grads)
            y.mul_(y)
            y.sub_(x)
            y.mul_(one_minus_beta_2)
            x.add_(y)
            if float8:
                # The codes hold sqrt(v), which the update divides by.
                x.sqrt_()
                self._store(batch, x, w, y, v, key(0))
            else:
                self._store(batch, x, w, y, v, key(1))
            if amsgrad:
                # v_hat = maximum(v_hat, v); v = v_hat
                torch._foreach_copy_(batch.views(x), slot_views[2])
                # Per variable: PyTorch's maximum gives a NaN other bits in
                # its vector loop than in its tail, and float16 stores keep
                # them; per variable the loop splits where Keras's does.
                torch._foreach_maximum_(batch.views(x), batch.views(w))
                self._store(batch, x, w, y, slot_views[2], key(2))
            # variable -= m * alpha / (sqrt(v) + epsilon)
            z.mul_(alpha)
            if not float8:
                w.sqrt_()
            w.add_(epsilon)
            z.div_(w)
            torch._foreach_sub_(variable_views, batch.views(z))

        return run

    def _sgd(self, learning_rate):
        """SGD's `update_step`, float32."""
        import torch

        optimizer = self._optimizer
        lr = ops.cast(learning_rate, "float32")
        momentum = ops.cast(optimizer.momentum, "float32")
        with_momentum = optimizer.momentum != 0
        nesterov = optimizer.nesterov

        def run(batch, grads, variable_views, slot_views, keys):
            x, y, z, w = batch.buffers[:4]
            torch._foreach_copy_(batch.views(y), grads)
            y.mul_(lr)
            if not with_momentum:
                # variable -= g * lr
                torch._foreach_sub_(variable_views, batch.views(y))
                return
            # m = m * momentum - g * lr
            torch._foreach_copy_(batch.views(x), slot_views[0])
            x.mul_(momentum)
            x.sub_(y)
            self._store(
                batch, x, z, w, slot_views[0], None if keys is None else keys[0]
            )
            if nesterov:
                # variable += m * momentum - g * lr
                z.mul_(momentum)
                z.sub_(y)
            # else: variable += m
            torch._foreach_add_(variable_views, batch.views(z))

        return run

    def _rmsprop(self, learning_rate):
        """RMSprop's `update_step`, float32."""
        import torch

        optimizer = self._optimizer
        lr = ops.cast(learning_rate, "float32")
        rho = optimizer.rho
        one_minus_rho = 1 - rho
        epsilon = optimizer.epsilon
        centered = optimizer.centered
        momentum = optimizer.momentum

        def run(batch, grads, variable_views, slot_views, keys):
            x, y, z, w = batch.buffers[:4]
            key = (lambda k: None) if keys is None else keys.__getitem__
            # velocity = rho * velocity + (1 - rho) * g * g
            torch._foreach_copy_(batch.views(x), slot_views[0])
            x.mul_(rho)
            torch._foreach_copy_(batch.views(y), grads)
            y.mul_(y)
            y.mul_(one_minus_rho)
            x.add_(y)
            self._store(batch, x, z, w, slot_views[0], key(0))
            if centered:
                # average = rho * average + (1 - rho) * g
                torch._foreach_copy_(batch.views(x), slot_views[1])
                x.mul_(rho)
                torch._foreach_copy_(batch.views(y), grads)
                y.mul_(one_minus_rho)
                x.add_(y)
                self._store(batch, x, w, y, slot_views[1], key(1))
                # denominator = velocity - average * average + epsilon
                w.mul_(w)
                z.sub_(w)
            z.add_(epsilon)
            # increment = lr * g / sqrt(denominator)
            z.sqrt_()
            torch._foreach_copy_(batch.views(y), grads)
            y.mul_(lr)
            y.div_(z)
            if momentum > 0:
                # m = momentum * m + increment; variable -= m
                torch._foreach_copy_(batch.views(x), slot_views[-1])
                x.mul_(momentum)
                x.add_(y)
                self._store(
                    batch, x, z, w, slot_views[-1], key(len(slot_views) - 1)
                )
                y = z
            # variable -= increment (or m)
            torch._foreach_sub_(variable_views, batch.views(y))

        return run


# Elements per block scale of float8 state.
BLOCK = float8_codes.BLOCK_SIZE


class _Float8Slot:
    """A float8 slot's flat codes and its block scales, sliced together (a
    slice starts on a block: one variable a batch, in whole blocks)."""

    def __init__(self, codes, scales):
        self._codes = codes
        self._scales = scales

    def __getitem__(self, part):
        blocks = slice(part.start // BLOCK, -(-part.stop // BLOCK))
        return self._codes[part], self._scales[blocks]

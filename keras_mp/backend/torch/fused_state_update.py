"""Torch's fused in-place update of 16-bit and float8 optimizer state.

`FusedStateUpdate`: for Keras's Adam, AdamW, SGD and RMSprop on PyTorch,
the per-variable `update_step` with 16-bit slots (and float8 state's Adam),
run as a few multi-tensor calls per batch of elements over cache-sized
scratch buffers, bit-identical to that path. What `keras.ops` cannot
express. The rules are not written here: it runs the rules of
`keras_mp.optimizers.update_rules` (passed in, as this floor is below
theirs) on `_BatchLanes`; the batches it runs over are in
`fused_batches.py`.
"""

from keras_mp import _keras_internals
from keras_mp import _random_bits
from keras_mp.backend.torch import fused_batches
from keras_mp.backend.torch import update_kernels

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
    size result. This runs the same rule (`update_rules`: the same
    arithmetic, in the same order and with the same float32 roundings) in
    batches of `_BATCH_ELEMENTS` elements
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
        rules: The rules by kind ("adam", "sgd", "rmsprop"):
            `update_rules.RULES`.
        storage: How the format stores the slots (`update_rules.Storage`).
        float8_codes: float8 state's codec (`float8_codes.Float8Codes`), or
            None for 16-bit state.
        scales_of: float8 state: a codes slot's scales variable.
    """

    def __init__(
        self,
        optimizer,
        state_dtype,
        stochastic_rounding,
        seed_generator,
        update_step,
        rules,
        storage,
        float8_codes=None,
        scales_of=None,
    ):
        import torch

        self._optimizer = optimizer
        self._rules = rules
        self._storage = storage
        self._state_name = state_dtype
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
        # The draw indices of stochastic rounding's keys, and the seed's
        # increment, by (variables, draws per variable, device): made once,
        # not copied each step.
        self._draw_tensors = {}

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
        rule = self._rules[kind]
        names = rule.slots(optimizer)
        if len(names) != len(slot_lists):
            return False
        constants = rule.constants(optimizer, learning_rate, _BatchLanes.scalar)
        # Adam on CUDA: one Triton kernel per variable where it serves.
        if kind == "adam" and self._kernel_update(
            tensors, flat_grads, slots, constants, names
        ):
            return True
        layout = self._layout([tensor.numel() for tensor in tensors], device)
        keys = self._keys(layout, self._storage.stochastic_stores(names))
        flat_tensors = [tensor.view(-1) for tensor in tensors]
        if self._float8 is None:
            flat_slots = [[slot.view(-1) for slot in s] for s in slots]
        else:
            flat_slots = [
                [
                    _Float8Slot(codes.view(-1), scales, self._float8.block_size)
                    for codes, scales in s
                ]
                for s in slots
            ]
        for batch in layout.batches:
            segments = batch.segments
            lanes = _BatchLanes(
                self,
                batch,
                names,
                views=(
                    [flat_grads[i][a:b] for i, a, b in segments],
                    [flat_tensors[i][a:b] for i, a, b in segments],
                    [
                        [flat_slots[i][k][a:b] for i, a, b in segments]
                        for k in range(len(names))
                    ],
                ),
                keys=(
                    None
                    if keys is None
                    else [k[batch.first : batch.last] for k in keys]
                ),
            )
            rule.run(lanes, constants)
        return True

    # ------------------------------------------------------------ layout
    def _layout(self, sizes, device):
        key = (tuple(sizes), device)
        layout = self._layouts.get(key)
        if layout is None:
            elements = batch_elements(device)
            if self._float8 is not None:
                # One variable a batch, in whole blocks of 128.
                block = self._float8.block_size
                elements = max(block, elements // block * block)
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

    # ---------------------------------------------------- Triton kernel
    def _kernel_update(self, tensors, grads, slots, constants, names):
        """Adam's update by `update_kernels.adam`, one Triton kernel per
        variable: True where it ran (the seed moved on by its draws), else
        False (nothing written, the seed where it was)."""
        stochastic = self._storage.stochastic_stores(names)
        stochastic = stochastic if self._stochastic_rounding else 0
        # The kernels round every 16-bit slot stochastically, or none, and
        # float8 state's second moments alone (`float8_state.STORAGE`).
        expected = 1 if self._float8 is not None else len(names)
        if stochastic not in (0, expected) or not update_kernels.serves(
            tensors[0], self._state_name, stochastic
        ):
            return False
        seed = None
        if stochastic:
            seed_state = self._seed_generator().state
            seed = seed_state.value
        done = update_kernels.adam(
            [tensor.view(-1) for tensor in tensors],
            grads,
            [
                [
                    slot.view(-1)
                    if self._float8 is None
                    else (slot[0].view(-1), slot[1])
                    for slot in s
                ]
                for s in slots
            ],
            constants["alpha"],
            (
                constants["one_minus_beta_1"],
                constants["one_minus_beta_2"],
                constants["epsilon"],
            ),
            seed,
            self._state_name,
            self._float8,
        )
        if not done:
            return False
        if seed is not None:
            # The state moves on by the draws, as after that many `next`
            # calls: in place, after the kernels that read it.
            _, increment = self._draw_tensors_for(
                len(tensors), stochastic, seed.device
            )
            seed.add_(increment)
        return True

    # -------------------------------------------------- stochastic keys
    def _draw_keys(self, variables, slots_per_variable, device):
        """This step's keys of stochastic rounding, one row per variable and
        a column per slot, and the seed state after drawing them (not
        assigned here).

        `stochastic_round_to_bfloat16` draws one seed per slot store
        (`SeedGenerator.next`: the state, then the state plus [0, 1]) and
        hashes `seed[0] * -1640531527 + seed[1]` into the key that is
        added to each element's index. The stores run variable by variable,
        slot by slot, so the j-th draw of this step is the state plus
        [0, j]: all keys come from one small computation, and the state
        moves on by the number of draws, as after that many `next` calls.
        """
        draw, increment = self._draw_tensors_for(
            variables, slots_per_variable, device
        )
        state = self._seed_generator().state.value
        base = state[0] * -1640531527 + state[1]
        return _random_bits.hash32(base + draw), state + increment

    def _draw_tensors_for(self, variables, slots_per_variable, device):
        """The draws' indices `[variables, slots_per_variable]` and the
        seed state's increment `[0, draws]`, int32, made once per device."""
        import torch

        draws = variables * slots_per_variable
        key = (variables, slots_per_variable, device)
        tensors = self._draw_tensors.get(key)
        if tensors is None:
            tensors = self._draw_tensors[key] = (
                torch.arange(draws, dtype=torch.int32, device=device).view(
                    variables, slots_per_variable
                ),
                torch.tensor([0, draws], dtype=torch.int32, device=device),
            )
        return tensors

    def _keys(self, layout, slots_per_variable):
        """Per slot, the keys of each segment's first element (`_draw_keys`,
        the seed moved on); None without stochastic rounding or slots."""
        if not self._stochastic_rounding or not slots_per_variable:
            return None
        keys, next_state = self._draw_keys(
            layout.variables, slots_per_variable, layout.device
        )
        self._seed_generator().state.assign(next_state)
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


class _Float8Slot:
    """A float8 slot's flat codes and its block scales, sliced together (a
    slice starts on a block: one variable a batch, in whole blocks)."""

    def __init__(self, codes, scales, block):
        self._codes = codes
        self._scales = scales
        self._block = block

    def __getitem__(self, part):
        block = self._block
        blocks = slice(part.start // block, -(-part.stop // block))
        return self._codes[part], self._scales[blocks]


class _BatchLanes:
    """The lanes a rule of `keras_mp.optimizers.update_rules` runs on: one
    batch's scratch buffers as its registers, each step a torch in-place
    call (`torch._foreach_*` over the batch's segments where it touches the
    optimizer's tensors)."""

    def __init__(self, update, batch, names, views, keys):
        self._update, self._batch, self._names = update, batch, names
        # The batch's segments of the gradients, variables and each slot.
        self._grads, self._variables, self._slots = views
        self._keys = keys
        # Stochastically rounded stores so far: the index of the next key.
        self._draws = 0
        self.storage = update._storage
        self.registers = tuple(batch.buffers[:4])

    @staticmethod
    def scalar(number):
        """A Python hyperparameter, multiplied by as it is (torch rounds it
        to float32 for a float32 tensor, as `keras.ops` casts it)."""
        return number

    def gradient(self, register):
        import torch

        torch._foreach_copy_(self._batch.views(register), self._grads)

    def load(self, name, register):
        self._update._load(
            self._batch,
            register,
            self._slots[self._names.index(name)],
            square=self.storage.is_root(name),
        )

    def store(self, name, source, readback, scratch):
        key = None
        if self.storage.is_stochastic(name):
            if self._keys is not None:
                key = self._keys[self._draws]
            self._draws += 1
        self._update._store(
            self._batch,
            source,
            readback,
            scratch,
            self._slots[self._names.index(name)],
            key,
        )

    def maximum(self, register, other):
        import torch

        # Per variable: PyTorch's maximum gives a NaN other bits in its
        # vector loop than in its tail, and float16 stores keep them; per
        # variable the loop splits where Keras's does.
        torch._foreach_maximum_(
            self._batch.views(register), self._batch.views(other)
        )

    def add_to_variable(self, register):
        import torch

        torch._foreach_add_(self._variables, self._batch.views(register))

    def subtract_from_variable(self, register):
        import torch

        torch._foreach_sub_(self._variables, self._batch.views(register))

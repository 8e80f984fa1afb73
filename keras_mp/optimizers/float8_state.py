"""Adam's update on float8 state.

`state_dtype="float8"` keeps each moment of Keras's Adam or AdamW as E4M3
codes with per-block scales (`state_formats.Float8BlockState`). Each step
decodes the moments to float32, computes Adam's update in float32 as Keras
does (`update_rules.Adam`, the one writing of the rule in keras_mp), and
stores the new moments as codes again: the first moment rounded to
nearest, the second stochastically (by default). Keras's own `update_step`
cannot give these bits: it reads each moment back after storing it (here
the weight's update uses the float32 moments), and it stores `v` itself.

The second moment is stored as its square root (COAT's dynamic range
transform `x -> |x|**k` with a fixed `k = 1/2`): `v` spans the square of
the gradients' range, `sqrt(v)` the same range as the first moment, so in
a block where `m` is representable `sqrt(v)` is too and `m / sqrt(v)`
never meets a `v` flushed to zero. On PyTorch the same rule of Adam and
AdamW without amsgrad runs in place, bit for bit, in the fused update of
every state dtype (`backend/torch/fused_state_update.py`);
`keras_mp.testing.float8_state_reference` is its NumPy oracle.
"""

import keras

from keras_mp.optimizers import update_rules

# Slots of `keras.optimizers.Adam`/`AdamW` the codes hold, and whether the
# slot is a second moment: stored as its square root, and stochastically
# rounded (where `stochastic_rounding` is on). Measured on the transformer of
# `guides/precision_and_memory.py` (JAX, 160 steps, eval loss, two seeds,
# float32 Adam 0.5298): square root and stochastic rounding of `v` only,
# +0.0012/+0.0025 nats; `v` itself instead of its root, +0.0030/+0.0040;
# every slot rounded to nearest, +0.0198 (`v` stalls); every slot
# stochastically rounded, -0.037/-0.018 (the noise on `m` changes the run).
ADAM_SLOTS = {"momentum": False, "velocity": True, "velocity_hat": True}

# How the rule sees the codes: the second moments stored as their square
# root and rounded stochastically; the update goes on with the float32
# moments it stored, not their codes. Only the second moments are rounded
# stochastically: Adam moves `v` by `(1 - beta_2) * (g**2 - v)` a step, far
# below half an E4M3 step (1/16 of the value), so rounded to nearest `v`
# would stall. The first moment moves by `(1 - beta_1) * (g - m)`, mostly
# above it, and the noise of stochastic rounding (which an EMA of
# `beta_1 = 0.9` averages only over a few steps) cost more than rounding
# to nearest in the measurements above.
SECOND_MOMENTS = [name for name, root in ADAM_SLOTS.items() if root]
STORAGE = update_rules.Storage(
    roots=SECOND_MOMENTS, stochastic=SECOND_MOMENTS, reads_back=False
)


def supports(optimizer):
    """Whether `optimizer` is Keras's Adam or AdamW, with Keras's update."""
    return (
        isinstance(optimizer, keras.optimizers.Adam)
        and type(optimizer).update_step is keras.optimizers.Adam.update_step
    )


class Float8Adam:
    """Adam's update of the float8 slots of one optimizer.

    Args:
        optimizer: The Keras Adam or AdamW whose slots these are.
        slots: Its `state_slots.StateSlots`, in `Float8BlockState`.

    Raises:
        ValueError: for another optimizer than Keras's Adam and AdamW.
    """

    def __init__(self, optimizer, slots):
        if not supports(optimizer):
            raise ValueError(
                "state_dtype='float8' holds the moments of Keras's Adam and "
                "AdamW (E4M3 codes with block scales, updated by keras_mp's "
                "float32 copy of their update). Received: inner optimizer "
                f"{optimizer.name!r} of class {type(optimizer).__name__}. "
                "Use state_dtype='bfloat16' for other optimizers."
            )
        self._optimizer = optimizer
        self._slots = slots

    def check_slot(self, name, initializer):
        """Refuses a slot this update does not hold, before it is made."""
        if name not in ADAM_SLOTS or initializer != "zeros":
            raise ValueError(
                "state_dtype='float8' holds Adam's moments only (slots "
                f"{sorted(ADAM_SLOTS)}, starting at zero). Received: a slot "
                f"{name!r} of {self._optimizer.name!r} with initializer "
                f"{initializer!r}. Use state_dtype='bfloat16'."
            )

    def update_step(self, gradient, variable, learning_rate):
        """Keras's Adam `update_step` in float32 on the decoded moments
        (`update_rules.Adam`, with `keras.ops`): the weight's update uses
        the float32 moments computed here, before they are stored in 8
        bits."""
        update_rules.keras_update(
            update_rules.Adam,
            self._optimizer,
            self._slots,
            STORAGE,
            gradient,
            variable,
            learning_rate,
        )


def is_second_moment(path):
    """Whether the slot variable at `path` is Adam's second moment (its
    codes hold the square root), from Keras's slot names."""
    return any(path.endswith(f"_{name}") for name in SECOND_MOMENTS)

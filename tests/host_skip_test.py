"""The PyTorch skip, decided on the host (default) or on the device.

By default a torch step checks and unscales the gradients in one fused pass,
reads the flag on the host and runs the inner optimizer or not; with
`skip_on_device=True` every variable is saved and selected after the update.
Both must leave every variable bit for bit on a skipped step, and the
default's finite steps must be Keras's LossScaleOptimizer's, bit for bit.
"""

import keras
import ml_dtypes
import numpy as np
import pytest
from keras import ops

import keras_mp
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import to_numpy

pytestmark = pytest.mark.backends("torch")

PATHS = pytest.mark.parametrize(
    "skip_on_device", [False, True], ids=["host", "device"]
)
POISONS = pytest.mark.parametrize(
    "poison", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"]
)

INNER = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
    "rmsprop": lambda: keras.optimizers.RMSprop(
        0.01, momentum=0.5, centered=True
    ),
    "adagrad": lambda: keras.optimizers.Adagrad(0.01),
    "ema": lambda: keras.optimizers.Adam(0.01, use_ema=True),
}


def _variables():
    rng = np.random.default_rng(0)
    return [
        keras.Variable(rng.normal(size=shape).astype("float32"), name=name)
        for shape, name in (((3, 4), "kernel"), ((4,), "bias"))
    ]


def _grads(step, poison=None):
    rng = np.random.default_rng(step + 1)
    grads = [
        rng.normal(size=shape).astype("float32") for shape in ((3, 4), (4,))
    ]
    if poison is not None:
        grads[step % 2].flat[step % 3] = poison
    return grads


def _scaled_step(optimizer, grads, variables):
    """The Keras 3 loop: gradients of `scale_loss(loss)`, then `apply`."""
    scale = float(to_numpy(optimizer.scale_loss(1.0)))
    optimizer.apply([ops.array(g * scale) for g in grads], variables)


def _plant_negative_zeros(variables):
    """-0.0 in the first entry of every float variable: a select or a copy
    that went through arithmetic would turn it into +0.0."""
    for variable in variables:
        if keras.backend.is_float_dtype(variable.dtype) and variable.shape:
            value = to_numpy(variable).copy()
            value.flat[0] = -0.0
            variable.assign(value)


def _optimizer(inner, skip_on_device, **kwargs):
    return keras_mp.LossScaleOptimizer(
        inner,
        loss_scale=keras_mp.DynamicLossScale(2.0**10, increment_period=1000),
        skip_on_device=skip_on_device,
        **kwargs,
    )


@PATHS
@POISONS
@pytest.mark.parametrize("finite_steps", [0, 3], ids=["step0", "stepk"])
@pytest.mark.parametrize("inner", list(INNER))
def test_skipped_step_leaves_weights_and_every_slot_bit_identical(
    inner, finite_steps, poison, skip_on_device
):
    variables = _variables()
    optimizer = _optimizer(INNER[inner](), skip_on_device)
    optimizer.build(variables)
    for step in range(finite_steps):
        _scaled_step(optimizer, _grads(step), variables)
    state = variables + optimizer.inner_optimizer.variables
    _plant_negative_zeros(state)
    before = [to_numpy(v).copy() for v in state]
    _scaled_step(optimizer, _grads(finite_steps, poison), variables)
    for variable, value in zip(state, before):
        assert_bitwise_equal(variable, value, variable.path)
    assert int(to_numpy(optimizer.iterations)) == finite_steps
    assert int(to_numpy(optimizer.skipped_steps)) == 1
    assert float(to_numpy(optimizer.loss_scale())) == 2.0**9


@PATHS
@POISONS
@pytest.mark.parametrize("poisoned_micro_step", [0, 1])
def test_discarded_accumulation_window_leaves_state_and_empties_buffers(
    poisoned_micro_step, poison, skip_on_device
):
    variables = _variables()
    optimizer = _optimizer(
        keras.optimizers.Adam(0.01, gradient_accumulation_steps=2),
        skip_on_device,
    )
    optimizer.build(variables)
    for step in range(4):  # two applied windows
        _scaled_step(optimizer, _grads(step), variables)
    base = optimizer.inner_optimizer
    buffers = base._accumulated_gradients
    slots = [
        v
        for v in variables + base.variables
        if all(v is not b for b in buffers)
    ]
    _plant_negative_zeros(slots)
    before = [to_numpy(v).copy() for v in slots]
    for micro_step in range(2):
        poisoned = poison if micro_step == poisoned_micro_step else None
        _scaled_step(optimizer, _grads(4 + micro_step, poisoned), variables)
    for variable, value in zip(slots, before):
        assert_bitwise_equal(variable, value, variable.path)
    for buffer in buffers:
        assert not np.any(to_numpy(buffer))
    assert int(to_numpy(optimizer.iterations)) == 2
    assert int(to_numpy(optimizer.skipped_steps)) == 1
    # One window, one update of the scale.
    assert float(to_numpy(optimizer.loss_scale())) == 2.0**9


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def _backward_step(model, optimizer, step):
    # The loop of Keras's torch guides: `.grad` filled by `backward()`.
    rng = np.random.default_rng(step)
    x = ops.array(rng.normal(size=(8, 4)).astype("float32"))
    y = ops.array(rng.normal(size=(8, 1)).astype("float32"))
    model.zero_grad()
    loss = ops.mean(ops.square(model(x) - y))
    optimizer.scale_loss(loss).backward()
    variables = model.trainable_variables
    import torch

    with torch.no_grad():
        optimizer.apply([v.value.grad for v in variables], variables)


@pytest.mark.parametrize("inner", ["adam", "sgd_momentum"])
def test_fifty_finite_steps_equal_keras_loss_scale_optimizer_bit_for_bit(
    inner,
):
    results = []
    for cls in (keras.optimizers.LossScaleOptimizer, keras_mp):
        model = _model()
        if cls is keras_mp:
            optimizer = keras_mp.LossScaleOptimizer(
                INNER[inner](),
                loss_scale=keras_mp.DynamicLossScale(
                    2.0**10, increment_period=10
                ),
            )
        else:
            optimizer = cls(
                INNER[inner](), initial_scale=2.0**10, dynamic_growth_steps=10
            )
        for step in range(50):
            _backward_step(model, optimizer, step)
        scale = float(to_numpy(optimizer.scale_loss(1.0)))
        results.append(
            (
                [to_numpy(v) for v in model.weights],
                [to_numpy(v) for v in optimizer.inner_optimizer.variables],
                scale,
            )
        )
    (weights, slots, scale), (mp_weights, mp_slots, mp_scale) = results
    # The scale grew five times (every 10 finite steps), in both.
    assert scale == mp_scale == 2.0**15
    for expected, actual in zip(weights + slots, mp_weights + mp_slots):
        assert_bitwise_equal(actual, expected)


@PATHS
def test_skip_at_step_zero_then_finite_steps_equals_never_seeing_the_batch(
    skip_on_device,
):
    weights = []
    for bad_batch in (True, False):
        variables = _variables()
        # Without the bad batch the scale starts where the skip leaves it.
        optimizer = keras_mp.LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            loss_scale=keras_mp.DynamicLossScale(
                2.0**10 if bad_batch else 2.0**9, increment_period=3
            ),
            skip_on_device=skip_on_device,
        )
        if bad_batch:
            _scaled_step(optimizer, _grads(0, np.nan), variables)
        for step in range(1, 8):
            _scaled_step(optimizer, _grads(step), variables)
        weights.append(
            [
                to_numpy(v)
                for v in variables + optimizer.inner_optimizer.variables
            ]
        )
        assert int(to_numpy(optimizer.iterations)) == 7
    for seen, never in zip(*weights):
        assert_bitwise_equal(seen, never)


@PATHS
def test_scale_grows_exactly_at_the_nth_finite_step_in_a_row(skip_on_device):
    variables = _variables()
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01),
        loss_scale=keras_mp.DynamicLossScale(8.0, increment_period=4),
        skip_on_device=skip_on_device,
    )
    scales = []
    for step, bad in enumerate("FFFFFFNFFFFF"):
        poison = np.inf if bad == "N" else None
        _scaled_step(optimizer, _grads(step, poison), variables)
        scales.append(float(to_numpy(optimizer.loss_scale())))
    # Doubles at the 4th finite step, halves at the overflow, and doubles
    # again only at the 4th finite step after it.
    assert scales == [8, 8, 8, 16, 16, 16, 8, 8, 8, 8, 16, 16]


def test_gradients_in_dot_grad_are_unscaled_in_place_others_left_alone():
    import torch

    model = _model()
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.0), loss_scale=keras_mp.DynamicLossScale(8.0)
    )
    variables = model.trainable_variables
    _backward_step(model, optimizer, 0)
    # As torch.amp's GradScaler.unscale_ does: `.grad` now holds the
    # gradients of the unscaled loss (8 is a power of two: exact).
    unscaled = [v.value.grad.clone() for v in variables]
    model.zero_grad()
    rng = np.random.default_rng(0)  # the batch of `_backward_step(..., 0)`
    x = ops.array(rng.normal(size=(8, 4)).astype("float32"))
    y = ops.array(rng.normal(size=(8, 1)).astype("float32"))
    optimizer.scale_loss(ops.mean(ops.square(model(x) - y))).backward()
    for variable, grad in zip(variables, unscaled):
        np.testing.assert_array_equal(
            to_numpy(variable.value.grad), to_numpy(grad) * 8.0
        )
    # Tensors that are not a variable's `.grad` keep their values.
    mine = [v.value.grad.clone() for v in variables]
    kept = [g.clone() for g in mine]
    optimizer.scale_loss(1.0)
    with torch.no_grad():
        optimizer.apply(mine, variables)
    for grad, copy in zip(mine, kept):
        assert torch.equal(grad, copy)


def test_check_and_unscale_handles_each_dtype_in_its_own_group():
    import torch

    from keras_mp.backend import gradients

    values = np.array([3.0, -0.0, 2.0**-20, 6e4], "float32")
    grads, variables = [], []
    for dtype in ("float16", "bfloat16", "float32"):
        grads.append(ops.convert_to_tensor(values, dtype))
        variables.append(keras.Variable(np.zeros(4), dtype=dtype))
    inverse = ops.convert_to_tensor(2.0**-10, "float32")
    result, is_finite = gradients.unscale_and_check_finite(
        grads, variables, inverse, [True, True, False]
    )
    assert bool(is_finite)
    for grad, dtype in zip(result, (np.float16, ml_dtypes.bfloat16)):
        # Each value times 2**-10 in float32, rounded once to its dtype.
        expected = (
            values.astype(dtype).astype("float32") * np.float32(2.0**-10)
        ).astype(dtype)
        assert_bitwise_equal(
            to_numpy(grad).view(np.uint16), expected.view(np.uint16)
        )
    assert_bitwise_equal(result[2], values)  # checked, not unscaled
    for poison in (np.inf, -np.inf, np.nan):
        bad = torch.tensor([1.0, poison], dtype=torch.bfloat16)
        _, is_finite = gradients.unscale_and_check_finite(
            grads + [bad], variables + [variables[1]], inverse, [True] * 4
        )
        assert not bool(is_finite)


@PATHS
def test_transform_gradients_override_sees_unscaled_gradients(skip_on_device):
    seen = []

    class Recording(keras_mp.LossScaleOptimizer):
        def transform_gradients(self, grads_and_vars):
            grads_and_vars = super().transform_gradients(grads_and_vars)
            seen.append([to_numpy(g).copy() for g, _ in grads_and_vars])
            return grads_and_vars

    variables = _variables()
    optimizer = Recording(
        keras.optimizers.SGD(0.1),
        loss_scale=keras_mp.DynamicLossScale(2.0**10),
        skip_on_device=skip_on_device,
    )
    _scaled_step(optimizer, _grads(0), variables)
    for grad, expected in zip(seen[0], _grads(0)):
        np.testing.assert_array_equal(grad, expected)


@PATHS
@pytest.mark.parametrize("inner", ["adam", "sgd_momentum"])
def test_entry_points_agree_through_an_overflow(inner, skip_on_device):
    # apply, apply_gradients, minimize and stateless_apply: one update
    # (stateless_apply with skip_on_device never takes torch's fused Adam,
    # whose arithmetic differs from Keras's within
    # `backend/torch/fused_adam.py`'s tolerance).
    import torch

    grads_per_step = [_grads(0), _grads(1, np.nan), _grads(2)]
    results = {}
    for entry in ("apply", "apply_gradients", "minimize", "stateless_apply"):
        variables = _variables()
        optimizer = _optimizer(INNER[inner](), skip_on_device)
        optimizer.build(variables)
        for grads in grads_per_step:
            scale = float(to_numpy(optimizer.loss_scale()))
            scaled = [ops.array(g * scale) for g in grads]
            if entry == "apply":
                optimizer.scale_loss(1.0)
                optimizer.apply(scaled, variables)
            elif entry == "apply_gradients":
                optimizer.scale_loss(1.0)
                optimizer.apply_gradients(zip(scaled, variables))
            elif entry == "minimize":
                # A loss whose gradient is `grads`: sum(v * g).
                constants = [torch.as_tensor(g) for g in grads]

                def loss(constants=constants, variables=variables):
                    return sum(
                        ops.sum(v.value * c)
                        for v, c in zip(variables, constants)
                    )

                optimizer.minimize(loss, variables)
            else:
                optimizer.scale_loss(1.0)
                values = [v.value.clone() for v in variables]
                state = [v.value.clone() for v in optimizer.variables]
                new_values, new_state = optimizer.stateless_apply(
                    state, scaled, values
                )
                for variable, value in zip(variables, new_values):
                    variable.assign(value)
                for variable, value in zip(optimizer.variables, new_state):
                    variable.assign(value)
        results[entry] = [
            to_numpy(v) for v in variables + optimizer.inner_optimizer.variables
        ]
        assert int(to_numpy(optimizer.skipped_steps)) == 1
        assert int(to_numpy(optimizer.iterations)) == 2
    fused = skip_on_device and inner == "adam"
    for entry, values in results.items():
        for value, expected in zip(values, results["apply"]):
            np.testing.assert_allclose(
                value,
                expected,
                rtol=2e-5 if fused and entry == "stateless_apply" else 1e-6,
                err_msg=entry,
            )


@PATHS
def test_stateless_apply_leaves_its_inputs_alone(skip_on_device):
    variables = _variables()
    optimizer = _optimizer(keras.optimizers.Adam(0.01), skip_on_device)
    optimizer.build(variables)
    values = [v.value.clone() for v in variables]
    state = [v.value.clone() for v in optimizer.variables]
    copies = [to_numpy(v).copy() for v in values + state]
    optimizer.scale_loss(1.0)
    new_values, _ = optimizer.stateless_apply(
        state, [ops.array(g * 2.0**10) for g in _grads(0)], values
    )
    for value, copy in zip(values + state, copies):
        assert_bitwise_equal(value, copy)
    assert not np.array_equal(to_numpy(new_values[0]), copies[0])


@PATHS
def test_accumulation_micro_step_reads_its_flags_once_or_never(skip_on_device):
    from keras_mp.testing import count_host_syncs

    variables = _variables()
    optimizer = _optimizer(
        keras.optimizers.Adam(0.01, gradient_accumulation_steps=2),
        skip_on_device,
    )
    optimizer.build(variables)
    reads = []
    for step, poison in enumerate([None, None, np.nan, None]):
        with count_host_syncs() as syncs:
            _scaled_step_without_reading(optimizer, _grads(step, poison))
        reads.append(sum(syncs.values()))
    # Keras's own accumulation reads whether a micro-step ends the window
    # (a Python `if`) each time the inner optimizer runs: on the device
    # path every micro-step (the update runs, then is selected away), by
    # default not at the end of the discarded window. keras_mp adds, by
    # default, one transfer of the micro-step's finite flag, whether the
    # inner optimizer runs and whether the window ends.
    keras_reads = [1, 1, 1, 1 if skip_on_device else 0]
    ours = 0 if skip_on_device else 1
    assert reads == [k + ours for k in keras_reads]
    assert int(to_numpy(optimizer.iterations)) == 1
    assert int(to_numpy(optimizer.skipped_steps)) == 1


def _scaled_step_without_reading(optimizer, grads):
    # `_scaled_step` reads the scale to scale the gradients; here the
    # scale is known (no overflow before the last window).
    optimizer.scale_loss(1.0)
    optimizer.apply(
        [ops.array(g * 2.0**10) for g in grads], optimizer._trainable_variables
    )


FUSED = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adam_weight_decay": lambda: keras.optimizers.Adam(0.01, weight_decay=0.1),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "amsgrad": lambda: keras.optimizers.AdamW(0.01, amsgrad=True),
}


@pytest.mark.parametrize("inner", list(FUSED))
def test_opt_in_adam_is_torch_fused_kernel_within_its_stated_tolerance(
    inner, monkeypatch
):
    from keras_mp.backend.torch import fused_adam

    calls = []
    update = fused_adam.update
    monkeypatch.setattr(
        fused_adam, "update", lambda *a: calls.append(1) or update(*a)
    )
    results = []
    for skip_on_device in (False, True):
        variables = _variables()
        optimizer = keras_mp.LossScaleOptimizer(
            FUSED[inner](),
            loss_scale=keras_mp.DynamicLossScale(2.0**10, increment_period=10),
            skip_on_device=skip_on_device,
        )
        for step in range(50):
            poison = np.inf if step == 20 else None
            _scaled_step(optimizer, _grads(step, poison), variables)
        results.append(
            (
                [to_numpy(v) for v in variables],
                [to_numpy(v) for v in optimizer.variables],
            )
        )
    assert len(calls) == 50
    (weights, state), (fused_weights, fused_state) = results
    # Torch adds epsilon after the bias correction (see
    # `backend/torch/fused_adam.py`): each update (here 0.01 at most per
    # entry) differs from Keras's by a relative epsilon / (sqrt(v) + epsilon),
    # below 2e-5 for these gradients of order 0.01 to 1, so 49 updates
    # stay within 1e-5 of Keras's weights; the moments differ by float32
    # rounding (torch's `lerp`), the counters and the scale not at all.
    for expected, actual in zip(weights, fused_weights):
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
    for expected, actual in zip(state, fused_state):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-12)


def test_opt_in_fused_adam_skip_reads_nothing_and_keeps_every_bit():
    from keras_mp.testing import count_host_syncs

    variables = _variables()
    optimizer = _optimizer(
        keras.optimizers.AdamW(0.01, weight_decay=0.1, amsgrad=True), True
    )
    optimizer.build(variables)
    for step in range(3):
        _scaled_step(optimizer, _grads(step), variables)
    state = variables + optimizer.inner_optimizer.variables
    _plant_negative_zeros(state)
    before = [to_numpy(v).copy() for v in state]
    grads = [ops.array(g * 2.0**10) for g in _grads(3, np.nan)]
    with count_host_syncs() as syncs:
        optimizer.scale_loss(1.0)
        optimizer.apply(grads, variables)
    assert dict(syncs) == {}
    for variable, value in zip(state, before):
        assert_bitwise_equal(variable, value, variable.path)
    assert int(to_numpy(optimizer.iterations)) == 3


@pytest.mark.parametrize("poison", [None, np.nan], ids=["finite", "nan"])
def test_the_scales_update_is_queued_before_the_host_read(poison, monkeypatch):
    """The loss scale's update takes the device flag: it runs before the
    step's one host read, so on a GPU its kernels are launched while the
    backward still runs (after the read the device would wait for each
    launch). The scale still moves as the step's flag says."""
    from keras_mp import loss_scale
    from keras_mp.optimizers import host_skip

    order = []
    read = host_skip._read_on_host
    update = loss_scale.DynamicLossScale.update

    def reading(flags):
        order.append("read")
        return read(flags)

    def updating(self, is_finite):
        order.append("update")
        return update(self, is_finite)

    monkeypatch.setattr(host_skip, "_read_on_host", reading)
    monkeypatch.setattr(loss_scale.DynamicLossScale, "update", updating)
    optimizer = _optimizer(keras.optimizers.Adam(0.01), False)
    variables = _variables()
    _scaled_step(optimizer, _grads(0, poison), variables)
    assert order == ["update", "read"]
    expected = 2.0**10 if poison is None else 2.0**9
    assert float(to_numpy(optimizer.loss_scale())) == expected
    assert int(to_numpy(optimizer.skipped_steps)) == int(poison is not None)

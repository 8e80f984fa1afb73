"""Optimizer state precision: `state_dtype`, stochastic rounding, master
weights (`OptimizerWrapper` and `LossScaleOptimizer`)."""

import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_mp
from keras_mp.optimizers.state_formats import stochastic_round_to_bfloat16
from keras_mp.testing import apply_as_fit
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import to_numpy

BACKEND = keras.backend.backend()

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.01),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "lion": lambda: keras.optimizers.Lion(0.001),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
}


def _dtype(variable):
    return keras.backend.standardize_dtype(variable.dtype)


def _slots(optimizer):
    """The inner optimizer's variables created from trainable variables."""
    return [
        v
        for v in optimizer.inner_optimizer.variables
        if tuple(v.shape) != () and "iteration" not in v.path
    ]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_slots_are_bfloat16_and_updates_track_float32_state(name):
    keras.utils.set_random_seed(3)
    grads = [
        ops.convert_to_tensor(np.linspace(-1, 1, 12).reshape(3, 4), "float32"),
        ops.convert_to_tensor([0.5, -0.25], "float32"),
    ]
    results = {}
    for state_dtype in (None, "bfloat16"):
        variables = [
            keras.Variable(np.ones((3, 4), "float32"), name="kernel"),
            keras.Variable(np.zeros((2,), "float32"), name="bias"),
        ]
        optimizer = keras_mp.OptimizerWrapper(
            OPTIMIZERS[name](), state_dtype=state_dtype
        )
        for _ in range(3):
            apply_as_fit(optimizer, grads, variables)
        slots = _slots(optimizer)
        assert slots, "the optimizer created no slot"
        expected = "bfloat16" if state_dtype else "float32"
        assert {_dtype(s) for s in slots} == {expected}
        assert {_dtype(v) for v in variables} == {"float32"}
        results[state_dtype] = [to_numpy(v) for v in variables]
    for reference, low in zip(results[None], results["bfloat16"]):
        moved = np.abs(reference - 1.0).max() + np.abs(reference).max()
        assert moved > 0
        # bfloat16 keeps 8 significant bits of each moment.
        np.testing.assert_allclose(low, reference, rtol=0.02, atol=2e-3)


def test_stochastic_rounding_picks_a_neighbour_with_the_right_odds():
    # 1 + 0.3 ulp: bfloat16's neighbours are 1 and 1 + 2**-7.
    value = 1.0 + 0.3 * 2**-7
    x = ops.full((20000,), value, "float32")
    rounded = to_numpy(
        ops.cast(
            stochastic_round_to_bfloat16(x, keras.random.SeedGenerator(5)),
            "float32",
        )
    )
    assert set(np.unique(rounded)) == {1.0, 1.0 + 2**-7}
    assert abs(rounded.mean() - value) < 1.5e-4
    negative = to_numpy(
        ops.cast(
            stochastic_round_to_bfloat16(-x, keras.random.SeedGenerator(5)),
            "float32",
        )
    )
    assert abs(negative.mean() + value) < 1.5e-4
    special = ops.convert_to_tensor([np.inf, -np.inf, np.nan, 0.0, 2.0])
    out = to_numpy(
        ops.cast(
            stochastic_round_to_bfloat16(
                special, keras.random.SeedGenerator(1)
            ),
            "float32",
        )
    )
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2])
    assert list(out[3:]) == [0.0, 2.0]


def _fit_regression(state_dtype=None, stochastic_rounding=None, steps=200):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * 16, 8)).astype("float32")
    w = rng.normal(size=(8, 1)).astype("float32")
    y = x @ w + 3.0 + 0.1 * rng.normal(size=(steps * 16, 1)).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(0.05),
        state_dtype=state_dtype,
        stochastic_rounding=stochastic_rounding,
    )
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    return float(model.evaluate(x[:1024], y[:1024], verbose=0)), optimizer


def test_bfloat16_state_with_stochastic_rounding_reaches_float32_loss():
    # Targets carry noise of variance 0.01, the loss floor.
    float32_loss, _ = _fit_regression()
    loss, optimizer = _fit_regression("bfloat16")
    assert optimizer.get_config()["stochastic_rounding"] is True
    assert float32_loss < 0.02
    # Stated tolerance: within 10% of the float32-state loss.
    assert loss < 1.1 * float32_loss, (loss, float32_loss)


def _momentum_travel(state_dtype, stochastic_rounding, steps=1200):
    """Distance a float32 variable travels under SGD(momentum=0.999) and a
    constant gradient: the momentum grows by `(1 - 0.999)` of its distance
    to its limit each step, an increment below half a bfloat16 step once
    the momentum is a third of the way there."""
    keras.utils.set_random_seed(0)
    variable = keras.Variable(np.zeros((64,), "float32"))
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.SGD(1.0, momentum=0.999),
        state_dtype=state_dtype,
        stochastic_rounding=stochastic_rounding,
    )
    grad = ops.full((64,), 1e-3, "float32")
    if BACKEND == "jax":
        optimizer.build([variable])

        @__import__("jax").jit
        def run(opt_values, values):
            def body(_, carry):
                return tuple(
                    optimizer.stateless_apply(carry[1], [grad], carry[0])
                )

            return __import__("jax").lax.fori_loop(
                0, steps, body, (values, opt_values)
            )

        values, _ = run(
            [v.value for v in optimizer.variables], [variable.value]
        )
        return -float(np.mean(to_numpy(values[0])))
    for _ in range(steps):
        optimizer.apply([grad], [variable])
    return -float(np.mean(to_numpy(variable)))


def test_round_to_nearest_state_stalls_on_tiny_updates_stochastic_does_not():
    exact = 1200 - 0.999 * (1 - 0.999**1200) / 0.001  # about 501
    float32 = _momentum_travel(None, None)
    nearest = _momentum_travel("bfloat16", False)
    stochastic = _momentum_travel("bfloat16", True)
    assert abs(float32 - exact) < 0.01 * exact
    assert nearest < 0.6 * exact, nearest
    assert abs(stochastic - exact) < 0.05 * exact, stochastic


def test_stochastic_rounding_repeats_with_the_same_seed():
    def run(seed):
        keras.utils.set_random_seed(seed)
        variable = keras.Variable(np.ones((50,), "float32"))
        optimizer = keras_mp.OptimizerWrapper(
            keras.optimizers.Adam(0.01), state_dtype="bfloat16"
        )
        grad = ops.convert_to_tensor(np.linspace(0.1, 1.0, 50), "float32")
        for _ in range(3):
            apply_as_fit(optimizer, [grad], [variable])
        return [to_numpy(v) for v in optimizer.variables]

    first, again, other = run(1), run(1), run(2)
    for a, b in zip(first, again):
        assert_bitwise_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(first[2:4], other[2:4]))


@pytest.mark.parametrize("master_weights", [False, True])
def test_skipped_step_leaves_weights_slots_and_seed_state_bit_identical(
    master_weights,
):
    keras.utils.set_random_seed(0)
    dtype = "bfloat16" if master_weights else "float32"
    variable = keras.Variable(np.linspace(1, 2, 8), dtype=dtype)
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        loss_scale=keras_mp.DynamicLossScale(4),
        state_dtype="bfloat16",
        master_weights=master_weights,
    )
    grad = ops.convert_to_tensor(np.linspace(-4, 4, 8), dtype)
    optimizer.scale_loss(1.0)
    apply_as_fit(optimizer, [grad], [variable])
    before = [to_numpy(v) for v in [variable] + optimizer.variables]
    poisoned = ops.where(ops.arange(8) == 3, np.inf, grad)
    optimizer.scale_loss(1.0)
    apply_as_fit(optimizer, [ops.cast(poisoned, dtype)], [variable])
    after = [to_numpy(v) for v in [variable] + optimizer.variables]
    assert int(to_numpy(optimizer.skipped_steps)) == 1
    paths = [variable.path] + [v.path for v in optimizer.variables]
    for path, old, new in zip(paths, before, after):
        if "loss_scale" in path or "skipped_steps" in path:
            continue
        assert_bitwise_equal(new, old)
    assert any("seed_generator_state" in p for p in paths)
    assert any("_master" in p for p in paths) == master_weights


def _tiny_updates(optimizer, steps=100):
    variable = keras.Variable(np.ones((16,), "bfloat16"), dtype="bfloat16")
    # Each step moves the variable by 1e-4, a fortieth of bfloat16's
    # half-step at 1.0 (2**-8): rounded into the variable, it is lost.
    grad = ops.ones((16,), "bfloat16")
    for _ in range(steps):
        if isinstance(optimizer, keras_mp.LossScaleOptimizer):
            optimizer.scale_loss(1.0)
            grad_in = ops.cast(
                ops.multiply(ops.cast(grad, "float32"), optimizer.loss_scale()),
                "bfloat16",
            )
        else:
            grad_in = grad
        apply_as_fit(optimizer, [grad_in], [variable])
    return variable


def test_master_weights_keep_tiny_updates_that_bfloat16_variables_lose():
    plain = _tiny_updates(keras.optimizers.SGD(1e-4))
    assert_bitwise_equal(plain, np.ones((16,), "bfloat16"))
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(1e-4),
        loss_scale=keras_mp.DynamicLossScale(2, increment_period=10**6),
        master_weights=True,
    )
    variable = _tiny_updates(optimizer)
    assert _dtype(variable) == "bfloat16"
    (master,) = [v for v in optimizer.variables if v.path.endswith("_master")]
    assert _dtype(master) == "float32"
    np.testing.assert_allclose(to_numpy(master), 0.99, rtol=1e-5)
    np.testing.assert_array_equal(
        to_numpy(ops.cast(variable, "float32")),
        to_numpy(ops.cast(ops.cast(master, "bfloat16"), "float32")),
    )
    # The inner optimizer works on the float32 masters.
    assert optimizer.inner_optimizer._trainable_variables[0] is master


def test_master_weights_follow_a_variable_assigned_from_outside():
    variable = keras.Variable(np.ones((4,), "bfloat16"), dtype="bfloat16")
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.SGD(0.5), master_weights=True
    )
    apply_as_fit(optimizer, [ops.ones((4,), "bfloat16")], [variable])
    np.testing.assert_array_equal(to_numpy(ops.cast(variable, "float32")), 0.5)
    variable.assign(ops.full((4,), 3.0, "bfloat16"))
    apply_as_fit(optimizer, [ops.ones((4,), "bfloat16")], [variable])
    np.testing.assert_array_equal(to_numpy(ops.cast(variable, "float32")), 2.5)


def test_master_weights_warn_when_every_variable_is_float32():
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.SGD(0.1), master_weights=True
    )
    with pytest.warns(UserWarning, match="master_weights=True .* no effect"):
        optimizer.build([keras.Variable(np.ones((2,), "float32"))])


def test_pure_bfloat16_model_trains_in_fit_with_state_dtype_and_masters():
    keras.utils.set_random_seed(0)
    with keras_mp.policy_scope(keras_mp.Policy("bfloat16")):
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)]
        )
    assert {_dtype(v) for v in model.trainable_variables} == {"bfloat16"}
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        state_dtype="bfloat16",
        master_weights=True,
    )
    model.compile(optimizer, "mse")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.7 * losses[0], losses
    masters = [v for v in optimizer.variables if v.path.endswith("_master")]
    assert len(masters) == 4
    assert {_dtype(v) for v in _slots(optimizer)} == {"bfloat16"}
    for variable in model.trainable_variables:
        master = optimizer._master_variables[id(variable)]
        np.testing.assert_array_equal(
            to_numpy(ops.cast(variable, "float32")),
            to_numpy(ops.cast(ops.cast(master, "bfloat16"), "float32")),
        )


def _trained_model(optimizer, path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer, "mse")
    x = np.random.default_rng(1).normal(size=(8, 3)).astype("float32")
    model.fit(x, np.ones((8, 2)), epochs=1, batch_size=4, verbose=0)
    model.save_weights(path)
    return model


def _restored(optimizer, path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer, "mse")
    optimizer.build(model.trainable_variables)
    model.load_weights(path)
    return model


def test_float32_state_loads_into_bfloat16_state_and_back_with_a_warning(
    tmp_path,
):
    path = str(tmp_path / "float32.weights.h5")
    source = _trained_model(
        keras_mp.OptimizerWrapper(keras.optimizers.Adam(0.1)), path
    )
    float32_slots = [to_numpy(v) for v in _slots(source.optimizer)]
    target = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(0.1), state_dtype="bfloat16"
    )
    with pytest.warns(UserWarning, match="from float32 to bfloat16 .rounded"):
        _restored(target, path)
    for slot, value in zip(_slots(target), float32_slots):
        assert _dtype(slot) == "bfloat16"
        np.testing.assert_array_equal(
            to_numpy(ops.cast(slot, "float32")),
            to_numpy(ops.cast(ops.cast(value, "bfloat16"), "float32")),
        )
    back_path = str(tmp_path / "bfloat16.weights.h5")
    target_model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    target_model.compile(target, "mse")
    target_model.set_weights(source.get_weights())
    target_model.save_weights(back_path)
    back = keras_mp.OptimizerWrapper(keras.optimizers.Adam(0.1))
    with pytest.warns(UserWarning, match="from bfloat16 to float32 .exactly"):
        _restored(back, back_path)
    for slot, value in zip(_slots(back), _slots(target)):
        assert _dtype(slot) == "float32"
        np.testing.assert_array_equal(
            to_numpy(slot), to_numpy(ops.cast(value, "float32"))
        )


def test_same_dtype_checkpoint_loads_silently(tmp_path):
    path = str(tmp_path / "state.weights.h5")
    source = _trained_model(
        keras_mp.OptimizerWrapper(
            keras.optimizers.Adam(0.1), state_dtype="bfloat16"
        ),
        path,
    )
    target = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(0.1), state_dtype="bfloat16"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _restored(target, path)
    assert not [w for w in caught if "Converted" in str(w.message)]
    for a, b in zip(source.optimizer.variables, target.variables):
        assert_bitwise_equal(to_numpy(b), to_numpy(a))


def test_failed_set_weights_leaves_bfloat16_state_intact():
    variable = keras.Variable(np.ones((4,), "float32"))
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(0.1), state_dtype="bfloat16"
    )
    apply_as_fit(optimizer, [ops.ones((4,))], [variable])
    before = optimizer.get_weights()
    wrong_shape = [np.zeros_like(w) for w in before]
    wrong_shape[2] = np.zeros((5,), "float32")
    with pytest.raises(ValueError, match="shape"):
        optimizer.set_weights(wrong_shape)
    with pytest.raises(ValueError, match="Expected 5 values"):
        optimizer.set_weights(before[:-1])
    for a, b in zip(before, optimizer.get_weights()):
        assert_bitwise_equal(b, a)


def test_get_config_round_trips_state_arguments():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(0.1),
        loss_scale=8,
        state_dtype="float16",
        stochastic_rounding=False,
        master_weights=True,
    )
    config = optimizer.get_config()
    assert config["state_dtype"] == "float16"
    assert config["stochastic_rounding"] is False
    assert config["master_weights"] is True
    restored = keras_mp.LossScaleOptimizer.from_config(config)
    assert restored.get_config() == config
    wrapper = keras_mp.OptimizerWrapper(
        keras.optimizers.SGD(0.1), state_dtype="bfloat16"
    )
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(wrapper))
    assert restored.get_config()["state_dtype"] == "bfloat16"
    assert restored.get_config()["stochastic_rounding"] is True


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"state_dtype": "int8"}, ValueError, "state_dtype='int8'"),
        ({"state_dtype": "float64"}, ValueError, "state_dtype='float64'"),
        ({"state_dtype": "bf16"}, ValueError, "state_dtype='bf16'"),
        (
            {"state_dtype": "float32", "stochastic_rounding": True},
            ValueError,
            "bfloat16 and float8 optimizer state only",
        ),
        ({"stochastic_rounding": True}, ValueError, "state_dtype=None"),
        (
            {"state_dtype": "bfloat16", "stochastic_rounding": "yes"},
            TypeError,
            "stochastic_rounding='yes'",
        ),
        ({"master_weights": 1}, TypeError, "master_weights=1"),
    ],
)
def test_bad_state_arguments_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        keras_mp.OptimizerWrapper(keras.optimizers.Adam(), **kwargs)
    with pytest.raises(error, match=match):
        keras_mp.LossScaleOptimizer(keras.optimizers.Adam(), **kwargs)


def test_state_dtype_needs_an_unbuilt_optimizer_and_one_wrapper_setting_it():
    built = keras.optimizers.Adam()
    built.build([keras.Variable(np.ones((2,), "float32"))])
    with pytest.raises(ValueError, match="must not be built yet"):
        keras_mp.OptimizerWrapper(built, state_dtype="bfloat16")
    # Nothing half-applied: the optimizer can still be wrapped.
    assert keras_mp.OptimizerWrapper(built).inner_optimizer is built
    inner = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(), state_dtype="bfloat16"
    )
    with pytest.raises(ValueError, match="already sets them"):
        keras_mp.LossScaleOptimizer(inner, master_weights=True)
    assert keras_mp.LossScaleOptimizer(inner).inner_optimizer is inner


@pytest.mark.parametrize("state_dtype", ["float32", "float16"])
def test_float32_and_float16_state_round_to_nearest(state_dtype):
    variable = keras.Variable(np.ones((4,), "float32"))
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(0.5), state_dtype=state_dtype
    )
    assert optimizer.get_config()["stochastic_rounding"] is False
    apply_as_fit(optimizer, [ops.ones((4,))], [variable])
    assert {_dtype(s) for s in _slots(optimizer)} == {state_dtype}
    assert not any("seed" in v.path for v in optimizer.variables)
    np.testing.assert_allclose(to_numpy(variable), 0.5, rtol=1e-3)


def test_ema_and_gradient_accumulators_keep_the_variable_dtype():
    variable = keras.Variable(np.ones((4,), "float32"))
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(0.1, use_ema=True, gradient_accumulation_steps=2),
        state_dtype="bfloat16",
    )
    optimizer.build([variable])
    dtypes = {
        v.path.rsplit("_", 1)[-1]: _dtype(v)
        for v in optimizer.inner_optimizer.variables
        if tuple(v.shape) == (4,)
    }
    assert dtypes == {
        "average": "float32",
        "accumulator": "float32",
        "momentum": "bfloat16",
        "velocity": "bfloat16",
    }


@pytest.mark.backends("torch")
def test_torch_bulk_updates_are_routed_through_update_step():
    from keras_mp import _keras_internals

    inner = keras.optimizers.Adam(0.1)
    # Keras's torch Adam updates in bulk, bypassing `assign`.
    assert isinstance(inner, _keras_internals.torch_parallel_optimizer_class())
    optimizer = keras_mp.OptimizerWrapper(inner, state_dtype="bfloat16")
    variable = keras.Variable(np.ones((4,), "float32"))
    calls = []
    update_step = inner.update_step
    inner.__dict__["update_step"] = lambda *args: (
        calls.append(1),
        update_step(*args),
    )
    optimizer.apply([ops.ones((4,))], [variable])
    assert calls == [1]


# Keras's PyTorch optimizers that keras_mp updates with its fused PyTorch
# path, in configurations covering every branch of their update rules;
# weight decay, clipping, EMA and gradient accumulation run around it.
FUSED_OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adam_amsgrad": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
    "adamw_clip_ema_accumulation": lambda: keras.optimizers.AdamW(
        0.01,
        weight_decay=0.01,
        clipnorm=1.0,
        use_ema=True,
        gradient_accumulation_steps=2,
    ),
    "sgd": lambda: keras.optimizers.SGD(0.01),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.SGD(
        0.01, momentum=0.9, nesterov=True
    ),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "rmsprop_centered_momentum": lambda: keras.optimizers.RMSprop(
        0.01, momentum=0.5, centered=True
    ),
}


# The 16-bit state settings the fused update and the rules are checked in.
STATE_SETTINGS = [("bfloat16", True), ("bfloat16", False), ("float16", False)]


def _trained_wrapper(name, state_dtype, stochastic_rounding, hook=None):
    """`_train_mixed_shapes` of `FUSED_OPTIMIZERS[name]` in an
    `OptimizerWrapper` keeping `state_dtype` (`hook(wrapper)` first, where
    given): every variable's value, and the wrapper's variables' paths."""
    # The stochastic rounding seed is drawn when the wrapper is created.
    keras.utils.set_random_seed(1)
    optimizer = keras_mp.OptimizerWrapper(
        FUSED_OPTIMIZERS[name](),
        state_dtype=state_dtype,
        stochastic_rounding=stochastic_rounding,
    )
    if hook is not None:
        hook(optimizer)
    return [to_numpy(v) for v in _train_mixed_shapes(optimizer)], [
        v.path for v in optimizer.variables
    ]


def _record_fused_updates(monkeypatch):
    """Records what each fused update returned (True: it ran)."""
    from keras_mp.backend.torch import fused_state_update

    results = []
    call = fused_state_update.FusedStateUpdate.__call__

    def recorded(self, *args):
        results.append(call(self, *args))
        return results[-1]

    monkeypatch.setattr(
        fused_state_update.FusedStateUpdate, "__call__", recorded
    )
    return results


def _train_mixed_shapes(optimizer, steps=4):
    """A few steps on variables of assorted shapes (a scalar, sizes that
    fill no vector register), with gradients spanning 8 decades and, at the
    third step, NaN and infinite gradients. Returns every variable."""
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    shapes = [(3, 5), (7,), (), (300,), (41, 3)]
    variables = [
        keras.Variable(rng.normal(size=shape).astype("float32"))
        for shape in shapes
    ]
    for step in range(steps):
        grads = [
            rng.normal(size=shape).astype("float32")
            * np.float32(10.0 ** rng.integers(-6, 2))
            for shape in shapes
        ]
        if step == 2:
            grads[3][[5, 7, 299]] = [np.nan, -np.inf, np.inf]
        optimizer.apply([ops.convert_to_tensor(g) for g in grads], variables)
    return variables + optimizer.variables


@pytest.mark.backends("torch")
@pytest.mark.parametrize("name", sorted(FUSED_OPTIMIZERS))
@pytest.mark.parametrize("state_dtype, stochastic_rounding", STATE_SETTINGS)
def test_torch_fused_update_is_bit_identical_to_the_update_step_path(
    monkeypatch, name, state_dtype, stochastic_rounding
):
    from keras_mp.backend.torch import fused_state_update

    # Batches of 64 elements: the (300,) variable spans several batches and
    # the small ones share batches, as large and small variables do in a
    # real model with the default batch size.
    monkeypatch.setattr(fused_state_update, "_BATCH_ELEMENTS", 64)
    results = _record_fused_updates(monkeypatch)

    def trained(fused):
        monkeypatch.setattr(fused_state_update, "FUSED_TORCH_UPDATES", fused)
        return _trained_wrapper(name, state_dtype, stochastic_rounding)

    fused, paths = trained(True)
    assert results and all(results)
    results.clear()
    generic, _ = trained(False)
    assert results and not any(results)
    # Plain SGD has no slots; every other one keeps some in `state_dtype`.
    assert any(state_dtype == str(v.dtype) for v in fused) == (name != "sgd")
    for path, a, b in zip(["variables"] * 5 + paths, fused, generic):
        if state_dtype == "float16" and a.dtype.kind == "f":
            # float16 stores keep a NaN's payload bits, and PyTorch's
            # vector and scalar loops give NaNs different ones, so once a
            # NaN reached float16 state its payload follows where a lane
            # sits in a batch; every other value, and where NaNs are, match.
            assert_bitwise_equal(np.isnan(a), np.isnan(b), path)
            a, b = np.nan_to_num(a, nan=0.0), np.nan_to_num(b, nan=0.0)
        assert_bitwise_equal(a, b, path)


@pytest.mark.parametrize("name", sorted(FUSED_OPTIMIZERS))
@pytest.mark.parametrize("state_dtype, stochastic_rounding", STATE_SETTINGS)
def test_update_rules_through_keras_ops_give_keras_update_step_bits(
    monkeypatch, name, state_dtype, stochastic_rounding
):
    # keras_mp writes each optimizer rule it runs once (`update_rules`):
    # float8 state and PyTorch's fused update run it. Run with `keras.ops`
    # on 16-bit state instead of Keras's own `update_step`, it gives Keras's
    # bits on every backend, every branch of each rule included.
    from keras_mp.backend.torch import fused_state_update
    from keras_mp.optimizers import update_rules

    monkeypatch.setattr(fused_state_update, "FUSED_TORCH_UPDATES", False)
    rule = update_rules.RULES[name.split("_")[0].replace("adamw", "adam")]
    calls = []

    def run_the_rule(optimizer):
        inner = optimizer.inner_optimizer
        slots = optimizer._state_slots

        def update_step(gradient, variable, learning_rate):
            calls.append(variable)
            update_rules.keras_update(
                rule,
                inner,
                slots,
                update_rules.Storage(),
                gradient,
                variable,
                learning_rate,
            )

        inner.__dict__["update_step"] = update_step

    ours, paths = _trained_wrapper(
        name, state_dtype, stochastic_rounding, run_the_rule
    )
    assert calls
    keras_own, _ = _trained_wrapper(name, state_dtype, stochastic_rounding)
    assert any(state_dtype == str(v.dtype) for v in ours) == (name != "sgd")
    for path, a, b in zip(["variables"] * 5 + paths, ours, keras_own):
        assert_bitwise_equal(a, b, path)


@pytest.mark.backends("torch")
def test_torch_fused_update_with_master_weights_matches_the_generic_path(
    monkeypatch,
):
    from keras_mp.backend.torch import fused_state_update

    results = _record_fused_updates(monkeypatch)

    def trained(fused):
        monkeypatch.setattr(fused_state_update, "FUSED_TORCH_UPDATES", fused)
        keras.utils.set_random_seed(0)
        optimizer = keras_mp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-3),
            state_dtype="bfloat16",
            master_weights=True,
        )
        variable = _tiny_updates(optimizer, steps=5)
        return [to_numpy(v) for v in [variable] + optimizer.variables]

    fused = trained(True)
    assert results and all(results)
    for a, b in zip(fused, trained(False)):
        assert_bitwise_equal(a, b)


@pytest.mark.backends("torch")
@pytest.mark.parametrize(
    "case",
    ["lion", "adagrad", "nadam", "update_step_replaced", "bfloat16_variable"],
)
def test_torch_fused_update_leaves_other_updates_to_update_step(
    monkeypatch, case
):
    results = _record_fused_updates(monkeypatch)
    inner = {
        "lion": lambda: keras.optimizers.Lion(0.001),
        "adagrad": lambda: keras.optimizers.Adagrad(0.05),
        "nadam": lambda: keras.optimizers.Nadam(0.01),
    }.get(case, lambda: keras.optimizers.Adam(0.01))()
    optimizer = keras_mp.OptimizerWrapper(inner, state_dtype="bfloat16")
    dtype = "bfloat16" if case == "bfloat16_variable" else "float32"
    variable = keras.Variable(np.ones((4,)), dtype=dtype)
    calls = []
    if case == "update_step_replaced":
        update_step = inner.update_step
        inner.__dict__["update_step"] = lambda *args: (
            calls.append(1),
            update_step(*args),
        )
    optimizer.apply([ops.ones((4,), dtype=dtype)], [variable])
    # Lion, Adagrad and Nadam are Keras PyTorch bulk optimizers too, but
    # not in the fused path: declined there, they run per variable.
    assert results == [False]
    assert calls == ([1] if case == "update_step_replaced" else [])
    # The per-variable path ran: it updated the bfloat16 slots.
    assert {_dtype(s) for s in _slots(optimizer)} == {"bfloat16"}
    assert all(np.any(to_numpy(s) != 0) for s in _slots(optimizer))


@pytest.mark.backends("torch")
def test_torch_fused_update_declines_inside_a_stateless_scope(monkeypatch):
    results = _record_fused_updates(monkeypatch)
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(0.01), state_dtype="bfloat16"
    )
    variable = keras.Variable(np.ones((4,), "float32"))
    optimizer.build([variable])
    before = [to_numpy(v) for v in [variable] + optimizer.variables]
    new_variables, new_state = optimizer.stateless_apply(
        [v.value for v in optimizer.variables],
        [ops.ones((4,))],
        [variable.value],
    )
    assert results == [False]
    # Nothing was updated in place; the new values came back.
    for old, current in zip(before, [variable] + optimizer.variables):
        assert_bitwise_equal(to_numpy(current), old)
    assert not np.array_equal(to_numpy(new_variables[0]), before[0])


@pytest.mark.backends("torch")
@pytest.mark.parametrize("stochastic_rounding", [True, False])
def test_torch_fused_update_makes_no_host_sync(
    monkeypatch, stochastic_rounding
):
    from keras_mp.testing import count_host_syncs

    results = _record_fused_updates(monkeypatch)
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(0.01, amsgrad=True),
        state_dtype="bfloat16",
        stochastic_rounding=stochastic_rounding,
    )
    variables = [
        keras.Variable(np.ones(shape, "float32")) for shape in [(70,), (3, 2)]
    ]
    grads = [ops.ones((70,)), ops.ones((3, 2))]
    optimizer.apply(grads, variables)
    with count_host_syncs() as syncs:
        for _ in range(3):
            optimizer.apply(grads, variables)
    assert results == [True] * 4
    assert sum(syncs.values()) == 0, syncs


def _fit_bfloat16_state(optimizer, **compile_kwargs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(50, 8),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer, "mse", **compile_kwargs)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(64, 5))
    y = rng.normal(size=(64, 1)).astype("float32")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return [to_numpy(v) for v in model.weights + optimizer.variables]


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("name", ["Adam", "SGD", "Adafactor", "Lion"])
def test_tensorflow_16_bit_state_update_is_the_same_in_graph_and_eager(name):
    # Without XLA the update of 16-bit slots runs as one XLA-compiled
    # function (sparse Embedding gradients included), from a graph step or
    # an eager one alike. (A step compiled whole with XLA also computes the
    # gradients with other kernels, so its bits may differ.)
    def trained(**compile_kwargs):
        keras.utils.set_random_seed(0)
        optimizer = keras_mp.LossScaleOptimizer(
            getattr(keras.optimizers, name)(0.01), state_dtype="bfloat16"
        )
        return _fit_bfloat16_state(optimizer, **compile_kwargs)

    graph = trained()
    for path, a, b in zip(range(len(graph)), trained(run_eagerly=True), graph):
        assert_bitwise_equal(a, b, f"variable {path}")
    assert all(np.isfinite(v.astype("float32")).all() for v in graph)
    assert all(
        np.isfinite(v.astype("float32")).all()
        for v in trained(jit_compile=True)
    )


@pytest.mark.backends("tensorflow")
def test_tensorflow_custom_optimizer_with_16_bit_state_is_not_compiled():
    import tensorflow as tf

    class HostClippedSGD(keras.optimizers.SGD):
        # An operation XLA cannot compile: compiling this update would fail
        # at the first step.
        def update_step(self, gradient, variable, learning_rate):
            gradient = tf.numpy_function(
                lambda g: np.clip(g, -1, 1), [gradient], gradient.dtype
            )
            gradient = tf.reshape(gradient, variable.shape)
            super().update_step(gradient, variable, learning_rate)

    optimizer = keras_mp.OptimizerWrapper(
        HostClippedSGD(0.01, momentum=0.9), state_dtype="bfloat16"
    )
    values = _fit_bfloat16_state(optimizer)
    assert all(np.isfinite(v.astype("float32")).all() for v in values)
    assert {str(v.dtype) for v in optimizer.inner_optimizer.momentums} == {
        "bfloat16"
    }


@pytest.mark.parametrize(
    "inner",
    [
        lambda: keras.optimizers.Adam(1e-3),
        lambda: keras.optimizers.AdamW(1e-3),
        lambda: keras.optimizers.RMSprop(1e-3),
    ],
    ids=["Adam", "AdamW", "RMSprop"],
)
def test_float16_state_of_squared_gradients_warns_at_build(inner):
    # (1 - beta_2) * g**2 flushes to zero in float16 for g under ~8e-3:
    # the second moment stays 0 and the update is lr * m / epsilon.
    variable = keras.Variable(np.ones((4,), "float32"))
    optimizer = keras_mp.OptimizerWrapper(inner(), state_dtype="float16")
    with pytest.warns(UserWarning, match="state_dtype='float16'.*'bfloat16'"):
        optimizer.build([variable])
    if isinstance(optimizer.inner_optimizer, keras.optimizers.Adam):
        apply_as_fit(optimizer, [ops.full((4,), 1e-3)], [variable])
        moved = 1.0 - to_numpy(variable)
        # What the warning is about: Adam's first step moves a weight by
        # about the learning rate, 1e-3; with the second moment flushed to
        # 0 it moves by 1e-3 * sqrt(1e-3) / 0.1 * 1e-4 / 1e-7 = 0.316.
        assert np.all(moved > 100 * 1e-3)


@pytest.mark.parametrize(
    "inner, state_dtype",
    [
        (lambda: keras.optimizers.SGD(0.1, momentum=0.9), "float16"),
        (lambda: keras.optimizers.Adam(1e-3), "bfloat16"),
    ],
    ids=["SGD-float16", "Adam-bfloat16"],
)
def test_float16_state_of_momentum_alone_and_bfloat16_do_not_warn(
    inner, state_dtype
):
    optimizer = keras_mp.OptimizerWrapper(inner(), state_dtype=state_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.build([keras.Variable(np.ones((4,), "float32"))])

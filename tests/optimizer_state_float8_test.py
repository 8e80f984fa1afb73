"""`state_dtype="float8"`: Adam's moments as E4M3 codes with block scales."""

import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_mp
from keras_mp.optimizers import state_formats
from keras_mp.testing import apply_as_fit
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import bytes_per_parameter
from keras_mp.testing import float8_state_reference as reference
from keras_mp.testing import to_numpy


def _random_state(rng, shape):
    """Valid codes (no NaN) and power-of-two scales for a slot of `shape`."""
    codes = rng.integers(0, 256, size=shape).astype(np.uint8)
    codes = np.where((codes & 0x7F) == 0x7F, codes - 1, codes).astype(np.uint8)
    blocks = -(-int(np.prod(shape)) // 128)
    scales = np.ldexp(1.0, rng.integers(-12, -4, size=blocks))
    return codes, scales.astype(np.float32)


@pytest.mark.parametrize("shape", [(5, 61), (3, 256)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_matches_the_numpy_oracle_bit_for_bit(stochastic, shape):
    rng = np.random.default_rng(0)
    # Values across E4M3's normal and subnormal range within a block, a
    # size that is not a multiple of the block and one that is (no
    # padding), zeros and a negative zero.
    x = rng.normal(size=shape) * np.exp2(rng.integers(-14, 4, size=shape))
    x[0, :3] = [0.0, -0.0, 1e-30]
    x = x.astype(np.float32)
    seed = np.array([7, 11], np.int32) if stochastic else None
    codes, scales = state_formats.quantize(
        ops.convert_to_tensor(x),
        None if seed is None else ops.convert_to_tensor(seed),
    )
    expected_codes, expected_scales = reference.quantize(x, seed)
    assert_bitwise_equal(to_numpy(codes), expected_codes)
    assert_bitwise_equal(to_numpy(scales), expected_scales)
    decoded = state_formats.dequantize(codes, scales)
    assert_bitwise_equal(
        to_numpy(decoded), reference.dequantize(expected_codes, expected_scales)
    )
    # Within half an E4M3 step (1/16 of the value), or of the subnormal
    # step 2**-9 of the block's scale below 2**-6 of it (stochastic: a step).
    atol = float(np.max(expected_scales)) * 2.0**-9
    np.testing.assert_allclose(to_numpy(decoded), x, rtol=0.13, atol=atol)


def test_every_code_decodes_as_ml_dtypes_does():
    codes = np.arange(256, dtype=np.uint8).reshape(2, 128)
    scales = np.array([1.0, 2.0**-20], np.float32)
    decoded = to_numpy(
        state_formats.dequantize(
            ops.convert_to_tensor(codes), ops.convert_to_tensor(scales)
        )
    )
    expected = reference.dequantize(codes, scales)
    np.testing.assert_array_equal(np.isnan(decoded), np.isnan(expected))
    finite = ~np.isnan(expected)
    assert_bitwise_equal(decoded[finite], expected[finite])
    # The NaN codes decode to float32's quiet NaN, with the code's sign.
    assert_bitwise_equal(
        decoded[~finite].view(np.uint32),
        np.array([0x7FC00000, 0xFFC00000], np.uint32),
    )


def test_stochastic_rounding_is_unbiased_to_the_e4m3_grid():
    # The block scale 2**-8 puts 1.03 at 263.68, between E4M3's 256 and 288
    # (1.0 and 1.125 once scaled): rounded up 24% of the time.
    x = ops.full((128 * 64,), 1.03)
    codes, scales = state_formats.quantize(x, ops.convert_to_tensor([3, 4]))
    decoded = to_numpy(state_formats.dequantize(codes, scales))
    assert set(np.unique(decoded)) == {1.0, 1.125}
    assert abs(decoded.mean() - 1.03) < 0.002


@pytest.mark.parametrize("amsgrad", [False, True])
def test_one_adam_step_matches_the_numpy_oracle_bit_for_bit(amsgrad):
    rng = np.random.default_rng(1)
    shapes = [(3, 100), (5,)]
    weights = [rng.normal(size=s).astype(np.float32) for s in shapes]
    grads = [(rng.normal(size=s) * 1e-2).astype(np.float32) for s in shapes]
    variables = [keras.Variable(w) for w in weights]
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(0.01, amsgrad=amsgrad), state_dtype="float8"
    )
    optimizer.build(variables)
    names = ("momentum", "velocity") + (("velocity_hat",) if amsgrad else ())
    # Keras makes each slot for every variable in turn: by variable.
    slots = [
        [
            v
            for v in optimizer.inner_optimizer.variables
            if v.path.endswith(name)
        ][i]
        for i in range(len(shapes))
        for name in names
    ]
    per_variable = len(names)
    states = []
    for i, shape in enumerate(shapes):
        state = []
        for slot in slots[per_variable * i : per_variable * (i + 1)]:
            codes, scales = _random_state(rng, shape)
            slot.assign(codes)
            optimizer._state_slots.stored(slot)[1].assign(scales)
            state += [codes, scales]
        states.append(state)
    seed_state = next(
        v for v in optimizer.variables if "seed_generator_state" in v.path
    )
    seed = to_numpy(seed_state).astype(np.int64)
    apply_as_fit(
        optimizer, [ops.convert_to_tensor(g) for g in grads], variables
    )
    draws = per_variable - 1
    for i, (variable, weight, grad) in enumerate(
        zip(variables, weights, grads)
    ):
        # Each variable's `v` (and then `v_hat`) takes the next seed of the
        # generator.
        seeds = (seed + [0, draws * i]).astype(np.int32)
        expected_weight, expected_state = reference.adam_step(
            weight,
            grad,
            states[i],
            0,
            0.01,
            seeds,
            amsgrad_seeds=(seed + [0, draws * i + 1]).astype(np.int32),
        )
        if keras.backend.backend() == "jax":
            assert_bitwise_equal(to_numpy(variable), expected_weight)
        else:
            # PyTorch's float32 CPU sqrt is not correctly rounded (a last-bit
            # difference to NumPy's in about one value of six), nor is
            # TensorFlow's XLA division: the weights' update differs from
            # the oracle's by a few units in the last place. The codes and
            # scales below still match bit for bit.
            np.testing.assert_allclose(
                to_numpy(variable), expected_weight, rtol=1e-6, atol=1e-8
            )
        actual = []
        for slot in slots[per_variable * i : per_variable * (i + 1)]:
            scales = optimizer._state_slots.stored(slot)[1]
            actual += [to_numpy(slot), to_numpy(scales)]
        for got, want in zip(actual, expected_state):
            assert_bitwise_equal(got, want)


def test_skipped_step_leaves_codes_and_scales_bit_identical():
    variable = keras.Variable(np.linspace(1, 2, 300).astype("float32"))
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        loss_scale=keras_mp.DynamicLossScale(4),
        state_dtype="float8",
    )
    grad = ops.convert_to_tensor(np.linspace(-4, 4, 300), "float32")
    apply_as_fit(optimizer, [grad], [variable], scale_loss=True)
    before = [to_numpy(v) for v in [variable] + optimizer.variables]
    poisoned = ops.where(ops.arange(300) == 3, np.nan, grad)
    apply_as_fit(optimizer, [poisoned], [variable], scale_loss=True)
    after = [to_numpy(v) for v in [variable] + optimizer.variables]
    assert int(to_numpy(optimizer.skipped_steps)) == 1
    paths = [variable.path] + [v.path for v in optimizer.variables]
    assert (
        sum(p.endswith(("momentum_scale", "velocity_scale")) for p in paths)
        == 2
    )
    for path, old, new in zip(paths, before, after):
        if "loss_scale" in path or "skipped_steps" in path:
            continue
        assert_bitwise_equal(new, old)


def test_state_bytes_per_parameter_are_about_a_quarter_of_float32():
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(256)])
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(), state_dtype="float8"
    )
    optimizer.build(model.trainable_variables)
    memory = bytes_per_parameter(model.weights, optimizer)
    # Two moments of one byte, a float32 scale per 128 of each; the bias's
    # 256 values take two blocks; the step counter and the seed state.
    params = 256 * 257
    others = sum(
        int(np.prod(v.shape)) * np.dtype(str(v.dtype)).itemsize
        for v in optimizer.variables
        if not v.path.endswith(("momentum", "velocity", "_scale"))
    )
    state = 2 * params + 2 * 4 * (512 + 2) + others
    assert memory["state"] == pytest.approx(state / params)
    assert others <= 32
    assert memory["state"] < 2.1
    assert memory["weights"] == 4.0
    plain = keras.optimizers.Adam()
    plain.build(model.trainable_variables)
    assert bytes_per_parameter(model.weights, plain)["state"] > 8.0


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    return x, x @ rng.normal(size=(8, 1)).astype("float32")


def _fit(optimizer, epochs=20, **compile_kwargs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)]
    )
    model.compile(optimizer, "mse", **compile_kwargs)
    history = model.fit(*_data(), batch_size=16, epochs=epochs, verbose=0)
    return model, history.history["loss"]


@pytest.mark.parametrize(
    "inner", ["adam", "adamw_accumulated"], ids=["adam", "adamw_accumulated"]
)
def test_fit_with_loss_scale_optimizer_tracks_float32_adam(inner):
    def make():
        if inner == "adam":
            return keras.optimizers.Adam(0.01)
        return keras.optimizers.AdamW(
            0.01, weight_decay=0.01, gradient_accumulation_steps=2
        )

    _, reference_loss = _fit(keras_mp.LossScaleOptimizer(make()))
    model, loss = _fit(
        keras_mp.LossScaleOptimizer(make(), state_dtype="float8")
    )
    assert loss[-1] < 0.5 * loss[0]
    assert abs(loss[-1] - reference_loss[-1]) < 0.1 * reference_loss[0]
    codes = [
        v for v in model.optimizer.variables if v.path.endswith("velocity")
    ]
    assert codes and all(str(v.dtype) == "uint8" for v in codes)


def test_master_weights_with_float8_state_train_a_bfloat16_model():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The global policy 'bfloat16'")
        with keras_mp.policy_scope(keras_mp.Policy("bfloat16")):
            model, loss = _fit(
                keras_mp.OptimizerWrapper(
                    keras.optimizers.Adam(0.01),
                    state_dtype="float8",
                    master_weights=True,
                )
            )
    assert loss[-1] < 0.5 * loss[0]
    assert any(v.path.endswith("_master") for v in model.optimizer.variables)


def _slot_values(optimizer):
    """Adam's moments as float32 values, whatever the state dtype."""
    slots = optimizer._state_slots
    if slots is not None and slots.format.name != "float8":
        slots = None
    values = []
    for variable in optimizer.inner_optimizer.variables:
        if not variable.path.endswith(("momentum", "velocity")):
            continue
        if slots is None:
            values.append(to_numpy(ops.cast(variable, "float32")))
            continue
        scales = to_numpy(slots.stored(variable)[1])
        value = reference.dequantize(to_numpy(variable), scales)
        if variable.path.endswith("velocity"):
            value = value * value
        values.append(value)
    return values


def _restored(optimizer, path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer, "mse")
    optimizer.build(model.trainable_variables)
    model.load_weights(path)
    return model


def test_checkpoint_round_trip_float8_to_float32_to_float8_warns(tmp_path):
    keras.utils.set_random_seed(0)
    source = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    source.compile(
        keras_mp.OptimizerWrapper(
            keras.optimizers.Adam(0.1), state_dtype="float8"
        ),
        "mse",
    )
    x = np.random.default_rng(1).normal(size=(8, 3)).astype("float32")
    source.fit(x, np.ones((8, 2)), epochs=2, batch_size=4, verbose=0)
    float8_path = str(tmp_path / "float8.weights.h5")
    source.save_weights(float8_path)
    float8_values = _slot_values(source.optimizer)
    codes = [
        to_numpy(v)
        for v in source.optimizer.variables
        if v.path.endswith(("momentum", "velocity", "_scale"))
    ]

    float32 = keras_mp.OptimizerWrapper(keras.optimizers.Adam(0.1))
    with pytest.warns(UserWarning, match="from float8 to float32"):
        middle = _restored(float32, float8_path)
    for got, want in zip(_slot_values(float32), float8_values):
        np.testing.assert_array_equal(got, want)
    float32_path = str(tmp_path / "float32.weights.h5")
    middle.save_weights(float32_path)

    back = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(0.1), state_dtype="float8"
    )
    with pytest.warns(UserWarning, match="from float32 to float8"):
        _restored(back, float32_path)
    restored = [
        to_numpy(v)
        for v in back.variables
        if v.path.endswith(("momentum", "velocity", "_scale"))
    ]
    # Decoded, squared, then the square root taken again: the codes come
    # back exactly, as each code's value does.
    assert len(restored) == len(codes) == 8
    for got, want in zip(restored, codes):
        assert_bitwise_equal(got, want)


def test_float8_checkpoint_loads_into_bfloat16_state():
    keras.utils.set_random_seed(0)
    variables = [keras.Variable(np.ones((3, 2), "float32"))]
    source = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(0.1), state_dtype="float8"
    )
    apply_as_fit(source, [ops.full((3, 2), 0.3)], variables)
    target = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(0.1), state_dtype="bfloat16"
    )
    target.build(variables)
    with pytest.warns(UserWarning, match="from float8 to float32"):
        target._restore(
            inner_values=[
                to_numpy(v) for v in source._base_optimizer().variables
            ]
        )
        target._restore(
            wrapper_values=[to_numpy(v) for v in source.variables[-1:]]
        )
    for got, want in zip(_slot_values(target), _slot_values(source)):
        np.testing.assert_allclose(got, want, rtol=2**-8)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: keras.optimizers.SGD(0.1, momentum=0.9), "class SGD"),
        (lambda: keras.optimizers.Nadam(), "class Nadam"),
    ],
)
def test_optimizers_whose_slots_float8_cannot_hold_raise_naming_the_fix(
    make, match
):
    with pytest.raises(ValueError, match=f"{match}.*state_dtype='bfloat16'"):
        keras_mp.OptimizerWrapper(make(), state_dtype="float8")


def test_bad_float8_arguments_raise():
    with pytest.raises(ValueError, match="'float8'"):
        keras_mp.OptimizerWrapper(
            keras.optimizers.Adam(), state_dtype="float8_e5m2"
        )
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(), state_dtype="float8", stochastic_rounding=False
    )
    assert optimizer.get_config()["state_dtype"] == "float8"
    assert optimizer.get_config()["stochastic_rounding"] is False


@pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="PyTorch's in-place update"
)
@pytest.mark.parametrize("stochastic", [True, False])
def test_torch_in_place_update_is_bit_identical_to_keras_ops(
    stochastic, monkeypatch
):
    from keras_mp.backend.torch import fused_state_update

    # Batches of 256 elements: the 1000-element slot spans four, the last
    # one with a short block; the 3-element slot is one short block.
    monkeypatch.setattr(fused_state_update, "_BATCH_ELEMENTS", 256)
    ran = []
    call = fused_state_update.FusedStateUpdate.__call__
    monkeypatch.setattr(
        fused_state_update.FusedStateUpdate,
        "__call__",
        lambda self, *args: ran.append(call(self, *args)) or ran[-1],
    )
    rng = np.random.default_rng(3)
    shapes = [(10, 100), (3,), (2, 128)]
    weights = [rng.normal(size=s).astype(np.float32) for s in shapes]
    grads = [
        [
            (rng.normal(size=s) * np.exp2(rng.integers(-20, 2, size=s))).astype(
                np.float32
            )
            for s in shapes
        ]
        for _ in range(3)
    ]
    results = []
    for fused in (True, False):
        monkeypatch.setattr(fused_state_update, "FUSED_TORCH_UPDATES", fused)
        keras.utils.set_random_seed(0)
        variables = [keras.Variable(w) for w in weights]
        optimizer = keras_mp.OptimizerWrapper(
            keras.optimizers.Adam(0.01),
            state_dtype="float8",
            stochastic_rounding=stochastic,
        )
        for step in grads:
            apply_as_fit(
                optimizer, [ops.convert_to_tensor(g) for g in step], variables
            )
        results.append(
            [to_numpy(v) for v in variables]
            + [to_numpy(v) for v in optimizer.variables]
        )
    # Three fused steps, then three the fused update declined.
    assert ran == [True] * 3 + [False] * 3
    for got, want in zip(*results):
        assert_bitwise_equal(got, want)

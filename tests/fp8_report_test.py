"""FP8 statistics (`keras_mp._fp8.stats`), `keras_mp.fp8.report` and the
`keras_mp.callbacks.FP8Report` callback.

The statistics of one `fp8.dot` call are the gradient of its carrier; they
are checked against counts made here with NumPy and the `ml_dtypes` oracle
(`keras_mp.testing.fp8_reference`), the amax bin from `np.frexp`.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_mp
import keras_mp.testing
from keras_mp import fp8
from keras_mp._fp8 import stats as fp8_stats
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import fp8_reference as reference
from keras_mp.testing import to_numpy

SHAPE = (3, 515)


# ------------------------------------------------------------ the reference
def _reference_bin(amax):
    """The bin of `amax` from `np.frexp`: amax = m * 2**e, m in [0.5, 1),
    so its float32 biased exponent is e - 1 + 127 and its mantissa is above
    0.75 where m > 0.875."""
    amax = float(amax)
    if not np.isfinite(amax):
        return 510
    if amax < 2.0**-126:
        return 0
    mantissa, exponent = np.frexp(amax)
    return 2 * (exponent - 1 + 127) + int(mantissa > 0.875)


def _reference_row(x, fmt, granularity, axis=-1, block_shape=None):
    x = np.asarray(x, np.float32)
    full, _ = reference.element_scales(x, fmt, granularity, axis, block_shape)
    codes = reference.encode(x, full, fmt).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        y = x / full
    fmax = reference.FORMATS[fmt][1]
    row = np.zeros(515)
    magnitudes = np.abs(np.where(np.isnan(x), np.inf, x))
    row[_reference_bin(magnitudes.max())] = 1
    row[512] = x.size
    row[513] = np.sum((x != 0) & (codes == 0))
    row[514] = np.sum(np.isfinite(y) & (np.abs(y) > fmax))
    return row


def _reference_stats(x, w, g, granularity):
    if granularity == "block":
        rows = [
            _reference_row(x, "e4m3", "block", -1),
            _reference_row(w, "e4m3", "block", block_shape=(128, 128)),
            _reference_row(g, "e5m2", "block", -1),
        ]
    else:
        rows = [
            _reference_row(x, "e4m3", granularity, -1),
            _reference_row(w, "e4m3", granularity, 0),
            _reference_row(g, "e5m2", granularity, -1),
        ]
    return np.stack(rows)


# ------------------------------------------------------- the carrier's grad
def _gradients(function, inputs, g):
    """The gradients of `function(*inputs)` for output gradient `g`."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        def step(g, *tensors):
            out, vjp = jax.vjp(function, *tensors)
            return vjp(ops.cast(g, out.dtype))

        # One compiled step: op by op, JAX compiles each op on its own.
        return jax.jit(step)(
            ops.convert_to_tensor(g),
            *[ops.convert_to_tensor(t) for t in inputs],
        )
    if backend == "tensorflow":
        import tensorflow as tf

        tensors = [tf.convert_to_tensor(t) for t in inputs]
        with tf.GradientTape() as tape:
            tape.watch(tensors)
            out = function(*tensors)
        g = tf.cast(tf.convert_to_tensor(g), out.dtype)
        return tape.gradient(out, tensors, output_gradients=g)
    tensors = [
        ops.convert_to_tensor(t).detach().clone().requires_grad_(True)
        for t in inputs
    ]
    out = function(*tensors)
    out.backward(ops.convert_to_tensor(g).to(out.dtype))
    return [t.grad for t in tensors]


def _carrier_gradient(recipe, x, w, g):
    def function(x, w, carrier):
        return fp8.dot(x, w, recipe, stats=carrier)

    carrier = np.zeros(SHAPE, "float32")
    return to_numpy(_gradients(function, [x, w, carrier], g)[2])


def _operands(m, k, n, seed=0):
    """Rows and columns spanning 16 binades, a few exact zeros, and values
    small enough to flush."""
    rng = np.random.default_rng(seed)

    def spread(rows, columns, axis):
        values = rng.normal(size=(rows, columns))
        size = (rows, 1) if axis == 0 else (1, columns)
        values = values * np.exp2(rng.uniform(-8, 8, size))
        values[0, :3] = 0.0
        # Flushed whatever the granularity: a row's and a column's
        # neighbour 1e-7 times as large.
        values[1, 5] = values[1, 6] * 1e-7
        values[5, 1] = values[6, 1] * 1e-7
        return values.astype("float32")

    return spread(m, k, 0), spread(k, n, 1), spread(m, n, 0)


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "block"])
def test_the_carrier_gradient_is_numpys_count(granularity):
    m, k, n = (16, 128, 256) if granularity == "block" else (16, 48, 32)
    x, w, g = _operands(m, k, n)
    recipe = fp8.Recipe(granularity=granularity, stats=True)
    got = _carrier_gradient(recipe, x, w, g)
    want = _reference_stats(x, w, g, granularity)
    np.testing.assert_array_equal(got, want)
    # Something to count: these operands flush values at every granularity.
    assert got[:, 513].sum() > 0


def test_the_carrier_gradient_of_an_einsum_and_of_3d_inputs():
    x, w, g = _operands(12, 32, 16, seed=1)
    recipe = fp8.Recipe(stats=True)

    def function(x, w, carrier):
        x3 = ops.reshape(x, (3, 4, 32))
        w3 = ops.reshape(w, (32, 2, 8))
        return fp8.einsum("abc,cde->abde", x3, w3, recipe, stats=carrier)

    carrier = np.zeros(SHAPE, "float32")
    got = to_numpy(
        _gradients(function, [x, w, carrier], g.reshape(3, 4, 2, 8))[2]
    )
    np.testing.assert_array_equal(got, _reference_stats(x, w, g, "tensorwise"))


def test_an_inf_or_nan_output_gradient_lands_in_the_non_finite_bins():
    x, w, g = _operands(16, 32, 16)
    recipe = fp8.Recipe(stats=True)
    for bad in (np.inf, -np.inf, np.nan):
        g_bad = g.copy()
        g_bad[3, 5] = bad
        got = _carrier_gradient(recipe, x, w, g_bad)
        # NaN counts as inf in the amax: bin 510 either way.
        assert np.flatnonzero(got[2, :512]).tolist() == [510]
        assert got[2, 512] == g.size
        np.testing.assert_array_equal(
            got[:2], _reference_stats(x, w, g, "tensorwise")[:2]
        )


def test_without_a_carrier_dot_is_unchanged_and_a_bad_carrier_raises():
    x, w, _ = _operands(16, 32, 16)
    carrier = np.zeros(SHAPE, "float32")
    assert_bitwise_equal(
        to_numpy(fp8.dot(x, w, stats=carrier)), to_numpy(fp8.dot(x, w))
    )
    with pytest.raises(ValueError, match="carrier of shape"):
        fp8.dot(x, w, stats=np.zeros((3, 4), "float32"))


def test_a_gemm_called_twice_sums_counts_and_keeps_the_highest_bin():
    x, w, g = _operands(16, 32, 16)
    x2 = x * 1024.0
    recipe = fp8.Recipe(stats=True)

    def twice(x, x2, w, carrier):
        return fp8.dot(x, w, recipe, stats=carrier) + fp8.dot(
            x2, w, recipe, stats=carrier
        )

    carrier = np.zeros(SHAPE, "float32")
    got = to_numpy(_gradients(twice, [x, x2, w, carrier], g)[3])
    first = _reference_stats(x, w, g, "tensorwise")
    second = _reference_stats(x2, w, g, "tensorwise")
    np.testing.assert_array_equal(got, first + second)
    highest = np.flatnonzero(got[0, :512]).max()
    assert highest == max(
        np.flatnonzero(first[0, :512])[0], np.flatnonzero(second[0, :512])[0]
    )
    assert got[0, 512] == 2 * x.size


def test_remove_loss_scale_moves_the_gradient_bins_and_keeps_the_rest():
    stats = np.zeros(SHAPE, "float32")
    stats[:, 300] = 1.0
    stats[2, 100] = 2.0
    stats[2, 10] = 1.0  # moved below bin 0: clamped there
    stats[2, 510] = 1.0  # inf stays
    stats[:, 512:] = [[7, 1, 0], [8, 2, 0], [9, 3, 1]]
    got = to_numpy(fp8_stats.remove_loss_scale(stats, np.float32(2.0**15)))
    np.testing.assert_array_equal(got[:2], stats[:2])
    want = np.zeros(515, "float32")
    want[[270, 70, 0, 510]] = [1, 2, 1, 1]
    want[512:] = [9, 3, 1]
    np.testing.assert_array_equal(got[2], want)
    # A loss scale below 1 moves them up, clamped at the last finite bin.
    up = to_numpy(fp8_stats.remove_loss_scale(stats, np.float32(2.0**-110)))
    assert np.flatnonzero(up[2, :512]).tolist() == [230, 320, 509, 510]


# --------------------------------------------------------------- in models
def _stats_policy(name="float32", **fields):
    return keras_mp.Policy(name, fp8=fp8.Recipe(stats=True, **fields))


def _carrier(layer):
    found = [v for v in layer.weights if v.path.endswith("fp8_stats")]
    return found[0] if found else None


def _two_layer_model(policy, units=16, inputs=32, name="fp8"):
    x = keras.Input((inputs,))
    h = keras.layers.Dense(units, dtype=policy, name=name)(x)
    return keras.Model(x, keras.layers.Dense(1, name="head")(h))


def test_the_carrier_is_a_zero_trainable_overwritten_float32_variable():
    model = _two_layer_model(_stats_policy("mixed_bfloat16"))
    rows = keras_mp.explain_precision(model, print_fn=None)
    assert rows[1]["layer"] == "fp8"
    assert rows[1]["fp8"] == "current/tensorwise/hybrid +stats"
    carrier = _carrier(model.get_layer("fp8"))
    assert carrier.path == "fp8/fp8_stats"
    assert carrier.trainable and carrier.overwrite_with_gradient
    assert carrier.dtype == "float32" and tuple(carrier.shape) == SHAPE
    assert not to_numpy(carrier).any()
    assert _carrier(model.get_layer("head")) is None


def test_a_model_without_stats_has_the_same_trainable_weights():
    keras_mp.set_global_policy("mixed_bfloat16")
    plain = [v.path for v in _two_layer_model(None).trainable_weights]
    keras_mp.set_global_policy(None)
    policy = keras_mp.Policy("mixed_bfloat16", fp8=fp8.Recipe())
    with_fp8 = [v.path for v in _two_layer_model(policy).trainable_weights]
    assert with_fp8 == plain


def test_the_output_layer_loses_its_carrier_when_the_model_is_built():
    keras_mp.set_global_policy("float32", fp8=fp8.Recipe(stats=True))
    x = keras.Input((32,))
    hidden = keras.layers.Dense(32, name="hidden")
    output = keras.layers.Dense(16, name="output")
    model = keras.Model(x, output(hidden(x)))
    assert output.dtype_policy.fp8 is None
    assert _carrier(output) is None
    assert _carrier(hidden) is not None
    paths = [v.path for v in model.trainable_weights]
    assert paths == [
        "hidden/kernel",
        "hidden/bias",
        "hidden/fp8_stats",
        "output/kernel",
        "output/bias",
    ]
    model.compile(keras.optimizers.SGD(0.01), loss="mse")
    x, y = np.ones((8, 32), "float32"), np.zeros((8, 16), "float32")
    model.train_on_batch(x, y)
    assert to_numpy(_carrier(hidden))[:, 512].tolist() == [256, 1024, 256]


def test_a_path_rule_gives_an_already_built_layer_its_carrier():
    """Path rules apply when the model is built, after its layers were."""
    rules = keras_mp.precision_rules({"hidden": _stats_policy()})
    keras_mp.set_global_policy("float32", float32_islands=rules)
    x = keras.Input((32,))
    hidden = keras.layers.Dense(32, name="hidden")
    model = keras.Model(x, keras.layers.Dense(1, name="head")(hidden(x)))
    assert hidden.dtype_policy.fp8.stats
    assert _carrier(hidden) is not None
    model.compile(keras.optimizers.SGD(0.01), loss="mse")
    model.train_on_batch(np.ones((8, 32), "float32"), np.zeros((8, 1)))
    assert to_numpy(_carrier(hidden))[:, 512].tolist() == [256, 1024, 256]


def test_fit_holds_each_steps_statistics_in_the_carrier():
    keras.utils.set_random_seed(0)
    model = _two_layer_model(_stats_policy(granularity="rowwise"))
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    x = np.random.default_rng(0).normal(size=(8, 32)).astype("float32")
    layer = model.get_layer("fp8")
    model.train_on_batch(x, np.zeros((8, 1), "float32"))
    got = to_numpy(_carrier(layer))
    want = _reference_row(x, "e4m3", "rowwise", -1)
    np.testing.assert_array_equal(got[0], want)
    kernel_before_step = got[1]
    assert np.flatnonzero(kernel_before_step[:512]).size == 1
    # A weight decay or a learning rate never touches the carrier.
    model.train_on_batch(x * 4, np.zeros((8, 1), "float32"))
    np.testing.assert_array_equal(
        to_numpy(_carrier(layer))[0], _reference_row(x * 4, "e4m3", "rowwise")
    )


@pytest.mark.parametrize("wrapped", [False, True], ids=["keras", "keras_mp"])
def test_an_accumulation_window_keeps_every_micro_steps_bins(wrapped):
    # Keras's optimizer takes the max of overwritten gradients over the
    # window and assigns it at the last micro-step; keras_mp's wrapper
    # passes the carrier to it as it is.
    keras.utils.set_random_seed(0)
    model = _two_layer_model(_stats_policy())
    optimizer = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=2)
    if wrapped:
        optimizer = keras_mp.OptimizerWrapper(optimizer)
    model.compile(optimizer, loss="mse")
    x = np.random.default_rng(1).normal(size=(16, 32)).astype("float32")
    x[:8] *= 100  # the first micro-batch holds the largest inputs
    layer = model.get_layer("fp8")
    model.train_on_batch(x[:8], np.zeros((8, 1), "float32"))
    # Mid-window: nothing assigned yet.
    assert not to_numpy(_carrier(layer)).any()
    model.train_on_batch(x[8:], np.zeros((8, 1), "float32"))
    got = to_numpy(_carrier(layer))[0]
    first = _reference_row(x[:8], "e4m3", "tensorwise")
    second = _reference_row(x[8:], "e4m3", "tensorwise")
    np.testing.assert_array_equal(got, np.maximum(first, second))
    bins = np.flatnonzero(got[: fp8_stats.HISTOGRAM_BINS])
    assert bins.size == 2 and first[bins[-1]] == 1


def test_statistics_change_no_number_of_the_training():
    def trained(stats):
        keras.utils.set_random_seed(0)
        policy = keras_mp.Policy(
            "mixed_bfloat16", fp8=fp8.Recipe(granularity="rowwise", stats=stats)
        )
        model = _two_layer_model(policy)
        model.compile(keras.optimizers.AdamW(1e-2), loss="mse")
        rng = np.random.default_rng(0)
        x = rng.normal(size=(8, 32)).astype("float32")
        for _ in range(3):
            model.train_on_batch(x, rng.normal(size=(8, 1)).astype("float32"))
        return [w for w in model.weights if not w.path.endswith("fp8_stats")]

    for got, want in zip(trained(True), trained(False), strict=True):
        assert got.path == want.path
        assert_bitwise_equal(to_numpy(got), to_numpy(want), got.path)


def test_a_layer_called_twice_in_a_step_sums_its_counts():
    shared = keras.layers.Dense(32, dtype=_stats_policy(), name="shared")
    x = keras.Input((32,))
    model = keras.Model(x, keras.layers.Dense(1)(shared(shared(x))))
    model.compile(keras.optimizers.SGD(0.01), loss="mse")
    data = np.random.default_rng(0).normal(size=(8, 32)).astype("float32")
    model.train_on_batch(data, np.zeros((8, 1), "float32"))
    got = to_numpy(_carrier(shared))
    assert got[:, 512].tolist() == [2 * 256, 2 * 1024, 2 * 256]
    assert got[:, :512].sum(axis=1).tolist() == [2, 2, 2]


def _float16_step(scaled):
    keras.utils.set_random_seed(0)
    policy = keras_mp.Policy(
        "mixed_float16", loss_scale=None, fp8=fp8.Recipe(stats=True)
    )
    model = _two_layer_model(policy)
    optimizer = keras.optimizers.SGD(0.01)
    if scaled:
        optimizer = keras_mp.LossScaleOptimizer(optimizer)
    # Unscaled: SGD as it is, not the skipping wrapper `compile` gives a
    # model with FP8 layers by default.
    model.compile(optimizer, loss="mse", auto_scale_loss=scaled)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 32)).astype("float32")
    model.train_on_batch(x, rng.normal(size=(16, 1)).astype("float32"))
    return model, to_numpy(_carrier(model.get_layer("fp8")))


def test_under_loss_scaling_the_gradient_row_is_loss_scale_free():
    scaled_model, scaled = _float16_step(True)
    assert float(to_numpy(scaled_model.optimizer.loss_scale())) == 2.0**15
    assert int(to_numpy(scaled_model.optimizer.skipped_steps)) == 0
    plain_model, plain = _float16_step(False)
    assert not isinstance(plain_model.optimizer, keras_mp.LossScaleOptimizer)
    np.testing.assert_array_equal(scaled, plain)
    assert plain[2, 512] == 16 * 16


@pytest.mark.parametrize("loop", ["fit", "get_unscaled_gradients"])
def test_both_loop_styles_store_the_statistics_loss_scale_free(loop):
    """`fit` scales the loss and lets the optimizer unscale; an RFC 293
    loop unscales every gradient itself, the carrier's counts too."""
    model = _two_layer_model(_stats_policy())
    layer = model.get_layer("fp8")
    variables = [layer.kernel, _carrier(layer)]
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build(variables)
    scale = 2.0**15
    stats = np.zeros(SHAPE, "float32")
    stats[:, [300, 280, 240]] = np.eye(3, dtype="float32")
    stats[:, 512:] = [[256, 3, 0], [512, 1, 0], [128, 5, 0]]
    scaled = stats.copy()
    scaled[2, 240], scaled[2, 270] = 0.0, 1.0  # 2 * log2(scale) bins up
    kernel_gradient = np.full((32, 16), scale, "float32")
    if loop == "fit":
        keras_mp.testing.apply_as_fit(
            optimizer, [kernel_gradient, scaled], variables, scale_loss=True
        )
    else:
        grads = optimizer.get_unscaled_gradients(
            [
                ops.convert_to_tensor(kernel_gradient),
                ops.convert_to_tensor(scaled),
            ]
        )
        optimizer.apply_gradients(zip(grads, variables))
    np.testing.assert_array_equal(to_numpy(variables[1]), stats)


def test_an_inf_output_gradient_skips_the_step_and_keeps_the_carrier():
    """As in fp8_layers_test: targets of 1e4 make the float16 output
    gradient of the FP8 layer overflow under a loss scale of 2**15."""
    keras_mp.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    policy = keras_mp.Policy("mixed_float16", fp8=fp8.Recipe(stats=True))
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(16, dtype=policy, name="fp8_out"),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-3), loss="mse")
    optimizer = model.optimizer
    x = np.random.default_rng(0).normal(size=(8, 32)).astype("float32")
    model.train_on_batch(x, np.full((8, 16), 0.1, "float32"))
    carrier = _carrier(model.get_layer("fp8_out"))
    before = to_numpy(carrier)
    assert before[:, 512].tolist() == [256, 512, 128]
    state = [*model.weights, *optimizer.inner_optimizer.variables]
    values = [to_numpy(v) for v in state]
    model.train_on_batch(x, np.full((8, 16), 1e4, "float32"))
    assert int(to_numpy(optimizer.skipped_steps)) == 1
    for value, variable in zip(values, state, strict=True):
        assert_bitwise_equal(to_numpy(variable), value, variable.path)
    assert_bitwise_equal(to_numpy(carrier), before)


def test_weights_and_keras_files_round_trip_the_carrier(tmp_path):
    def trained(steps):
        keras.utils.set_random_seed(0)
        model = _two_layer_model(_stats_policy())
        model.compile(keras.optimizers.Adam(1e-2), loss="mse")
        x = np.random.default_rng(0).normal(size=(8, 32)).astype("float32")
        for _ in range(steps):
            model.train_on_batch(x, np.zeros((8, 1), "float32"))
        return model

    model = trained(2)
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    fresh = trained(0)
    fresh.load_weights(path)
    assert [w.path for w in fresh.weights] == [w.path for w in model.weights]
    for got, want in zip(fresh.get_weights(), model.get_weights(), strict=True):
        assert_bitwise_equal(got, want)
    assert to_numpy(_carrier(fresh.get_layer("fp8"))).any()
    keras_path = str(tmp_path / "model.keras")
    model.save(keras_path)
    restored = keras.models.load_model(keras_path)
    assert restored.get_layer("fp8").dtype_policy.fp8.stats
    assert [w.path for w in restored.weights] == [w.path for w in model.weights]
    for got, want in zip(
        restored.get_weights(), model.get_weights(), strict=True
    ):
        assert_bitwise_equal(got, want)


def test_weights_saved_with_or_without_statistics_load_either_way(tmp_path):
    def model(stats):
        keras.utils.set_random_seed(0)
        return _two_layer_model(_stats_policy() if stats else None)

    with_stats = model(True)
    with_stats.compile(keras.optimizers.SGD(0.1), loss="mse")
    x = np.random.default_rng(0).normal(size=(8, 32)).astype("float32")
    with_stats.train_on_batch(x, np.ones((8, 1), "float32"))
    path = str(tmp_path / "stats.weights.h5")
    with_stats.save_weights(path)
    without = model(False)
    without.load_weights(path)
    for got, want in zip(
        without.get_weights(),
        [w for w in with_stats.weights if not w.path.endswith("fp8_stats")],
        strict=True,
    ):
        assert_bitwise_equal(got, to_numpy(want))
    path = str(tmp_path / "plain.weights.h5")
    without.save_weights(path)
    fresh = model(True)
    fresh.load_weights(path)
    carrier = _carrier(fresh.get_layer("fp8"))
    assert not to_numpy(carrier).any()  # Nothing was counted in that file.
    for got, want in zip(
        [w for w in fresh.weights if w is not carrier],
        without.weights,
        strict=True,
    ):
        assert_bitwise_equal(to_numpy(got), to_numpy(want))


# ------------------------------------------------------------------ report
def _outlier_data(rows=256, channels=512, outlier=7):
    """As the guide's section 3: one channel 1000x the others."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, channels)).astype("float32")
    x[:, outlier] *= 1000.0
    return x


def _trained_on_outliers(granularity):
    keras.utils.set_random_seed(0)
    x = _outlier_data()
    model = _two_layer_model(
        _stats_policy(granularity=granularity), inputs=x.shape[1]
    )
    model.compile(keras.optimizers.SGD(1e-6), loss="mse")
    model.train_on_batch(x, np.zeros((len(x), 1), "float32"))
    return model, x


def test_report_flags_tensorwise_underflow_of_an_outlier_channel():
    tensorwise, x = _trained_on_outliers("tensorwise")
    rowwise, _ = _trained_on_outliers("rowwise")
    found = fp8.report(tensorwise)
    assert [(r.layer, r.tensor) for r in found] == [
        ("fp8", "input"),
        ("fp8", "kernel"),
        ("fp8", "output_gradient"),
    ]
    flagged = found.flagged(flushed=0.01)
    assert [(r.layer, r.tensor) for r in flagged] == [("fp8", "input")]
    codes = reference.quantize(x, "e4m3", "tensorwise")[0].astype("float32")
    flushed = np.sum((x != 0) & (codes == 0)) / x.size
    assert flagged[0].flushed == flushed > 0.01
    assert flagged[0].count == x.size
    row_input = fp8.report(rowwise)[0]
    codes = reference.quantize(x, "e4m3", "rowwise")[0].astype("float32")
    assert row_input.flushed == np.sum((x != 0) & (codes == 0)) / x.size
    assert row_input.flushed < flagged[0].flushed
    # The amax is its bin's range; the scale that amax gets, exactly.
    amax = np.abs(x).max()
    assert flagged[0].amax_low <= amax < flagged[0].amax_high
    assert flagged[0].scale == float(reference.scale(amax, "e4m3"))
    assert flagged[0].saturated == 0.0
    table = str(found)
    assert "output_gradient" in table and "e5m2" in table


def test_report_notes_layers_that_have_no_statistics_yet_or_are_frozen():
    model = _two_layer_model(_stats_policy())
    found = fp8.report(model)
    assert list(found) == [] and found.notes == [
        ("fp8", "no training step yet")
    ]
    model.get_layer("fp8").trainable = False
    found = fp8.report(model)
    assert "frozen" in found.notes[0][1]
    assert "frozen" in str(found)


def test_report_raises_with_the_fix():
    keras_mp.set_global_policy("float32")
    with pytest.raises(ValueError, match=r"has none.*Recipe\(stats=True\)"):
        fp8.report(_two_layer_model(None))
    policy = keras_mp.Policy("float32", fp8=True)
    with pytest.raises(
        ValueError, match=r"Use `keras_mp.fp8.Recipe\(stats=True\)`"
    ):
        fp8.report(_two_layer_model(policy))


def test_recipe_stats_is_a_bool_and_round_trips():
    with pytest.raises(TypeError, match="stats=True"):
        fp8.Recipe(stats="yes")
    with pytest.raises(TypeError, match="stats=True"):
        fp8.Recipe(stats=1)
    recipe = fp8.Recipe(
        granularity="block", formats="e4m3", margin=2, stats=True
    )
    assert recipe.get_config()["stats"] is True
    assert fp8.Recipe.from_config(recipe.get_config()) == recipe
    assert recipe != fp8.Recipe(granularity="block", formats="e4m3", margin=2)
    assert hash(recipe) != hash(
        fp8.Recipe(granularity="block", formats="e4m3", margin=2)
    )
    assert "stats=True" in repr(recipe)
    # A config written before `stats` existed still loads.
    config = recipe.get_config()
    del config["stats"]
    assert fp8.Recipe.from_config(config).stats is False
    policy = keras_mp.Policy("mixed_bfloat16", fp8=recipe)
    assert keras_mp.Policy.from_config(policy.get_config()).fp8 == recipe


# ---------------------------------------------------------------- callback
def test_the_callback_prints_over_threshold_and_is_silent_otherwise():
    x = _outlier_data()
    printed = []
    for flushed in (0.01, 0.5):
        keras.utils.set_random_seed(0)
        model = _two_layer_model(_stats_policy(), inputs=x.shape[1])
        model.compile(keras.optimizers.SGD(1e-6), loss="mse")
        callback = keras_mp.callbacks.FP8Report(
            flushed=flushed, print_fn=printed.append
        )
        model.fit(
            x,
            np.zeros((len(x), 1), "float32"),
            batch_size=len(x),
            epochs=2,
            verbose=0,
            callbacks=[callback],
        )
        if flushed == 0.01:
            assert len(printed) == 2
            assert printed[0].startswith("Epoch 1: FP8 values over threshold")
            assert "fp8" in printed[0] and "input" in printed[0]
        else:
            assert len(printed) == 2  # nothing more


def test_the_callback_every_n_batches():
    x = _outlier_data(rows=64)
    printed = []
    model = _two_layer_model(_stats_policy(), inputs=x.shape[1])
    model.compile(keras.optimizers.SGD(1e-6), loss="mse")
    callback = keras_mp.callbacks.FP8Report(
        flushed=0.0, every=2, print_fn=printed.append
    )
    model.fit(
        x,
        np.zeros((64, 1), "float32"),
        batch_size=16,
        epochs=1,
        verbose=0,
        callbacks=[callback],
    )
    assert [line.split(":")[0] for line in printed] == ["Batch 2", "Batch 4"]


def test_the_callback_checks_its_arguments_and_the_model():
    for kwargs in (
        {"saturated": -0.1},
        {"flushed": 2},
        {"flushed": True},
        {"every": "step"},
        {"every": 0},
        {"print_fn": "print"},
    ):
        with pytest.raises(ValueError, match="Received"):
            keras_mp.callbacks.FP8Report(**kwargs)
    policy = keras_mp.Policy("float32", fp8=True)
    model = _two_layer_model(policy)
    model.compile(keras.optimizers.SGD(0.01), loss="mse")
    with pytest.raises(ValueError, match=r"Recipe\(stats=True\)"):
        model.fit(
            np.ones((4, 32), "float32"),
            np.ones((4, 1), "float32"),
            verbose=0,
            callbacks=[keras_mp.callbacks.FP8Report()],
        )


_DATA_PARALLEL = """
import json
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import keras
import numpy as np

import keras_mp
from keras_mp import fp8
from keras_mp._fp8 import stats

rng = np.random.default_rng(0)
x = rng.normal(size=(32, 64)).astype("float32")
x[16:] *= 100  # the second device's half of the batch holds the largest inputs
y = rng.normal(size=(32, 4)).astype("float32")


def carrier(distribution):
    keras.distribution.set_distribution(distribution)
    keras_mp.set_global_policy("mixed_bfloat16", fp8=fp8.Recipe(stats=True))
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(64, name="up")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(4, name="out")(hidden))
        model.compile(keras.optimizers.Adam(1e-3), "mse")
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        value = stats.layer_carrier(model.get_layer("up"))
        return keras.ops.convert_to_numpy(value).tolist()
    finally:
        keras_mp.set_global_policy(None)
        keras.distribution.set_distribution(None)


devices = keras.distribution.list_devices("cpu")
assert len(devices) == 2, devices
one = carrier(None)
two = carrier(keras.distribution.DataParallel(devices=devices))
print("RESULT " + json.dumps({"one": one, "two": two}))
"""


@pytest.mark.backends("jax")
@pytest.mark.slow
def test_data_parallel_statistics_are_the_global_batchs_as_on_one_device():
    # The carrier's gradient is summed over the batch's shards: the highest
    # bin is the global amax (held by the second device's rows) and the
    # counts are the global batch's, bit for bit one device's.
    import json

    out = keras_mp.testing.run_python(
        _DATA_PARALLEL, env={"KERAS_BACKEND": "jax"}
    )
    line = [row for row in out.splitlines() if row.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT ") :])
    one = np.asarray(result["one"], "float32")
    two = np.asarray(result["two"], "float32")
    assert_bitwise_equal(two, one)
    row = fp8_stats.TENSORS.index("input")
    assert one[row, fp8_stats.COUNT] == 32 * 64
    top_bin = np.nonzero(one[row, : fp8_stats.FINITE_BINS])[0].max()
    # 2 * biased exponent (+1 above 1.75 * 2**k): an amax of 100x the
    # standard normal's is in [2**8, 2**9).
    assert 2 * (127 + 8) <= top_bin < 2 * (127 + 9), top_bin

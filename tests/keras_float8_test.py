"""Keras 3.15's float8 training bugs that give no error (issue 22, K1-K7),
each next to keras_mp's FP8 (current scaling) in the same situation.

Each Keras half runs Keras's own `model.quantize("float8")` and asserts
the wrong value Keras produces, measured on Keras 3.15.1: the same
behaviour on TensorFlow, JAX and PyTorch. When a Keras release fixes one,
its test fails: the docstring says what to change then (assert the right
value, or drop the Keras half where a version check would do, and note
the fixed version under issue 22). Each keras_mp half checks its
numbers against the NumPy / ml_dtypes oracle (`keras_mp.testing.
fp8_reference`).

Keras's float8 layer keeps `inputs_`, `kernel_` and `outputs_grad_`
`scale` (shape ()) and `amax_history` (shape (1024,)) variables, which
the optimizer overwrites with their "gradient".
"""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import fp8
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import fp8_reference as reference
from keras_mp.testing import to_numpy

# Keras warns that `model.quantize` skips a Sequential's InputLayer.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Layer InputLayer does not have a `quantize`:UserWarning"
)

E4M3_MAX = 448.0
HISTORY = 1024


def _rng(seed=0):
    return np.random.default_rng(seed)


def _fp8_layers(model):
    """Names of the model's layers that run their GEMM in FP8."""
    rows = keras_mp.explain_precision(model, print_fn=None)
    return [
        row["layer"].split("/")[-1] for row in rows if "/" in row.get("fp8", "")
    ]


def _fp8_policy(compute="float32"):
    return keras_mp.Policy(compute, fp8=fp8.Recipe())


def _value(variable):
    return to_numpy(variable).astype(np.float64)


def _assert_matches_oracle_forward(out, x, layer):
    """`out` is the oracle's tensorwise FP8 GEMM of `x` and the layer's
    kernel (each tensor scaled by its own amax), plus the bias."""
    kernel = to_numpy(layer.kernel)
    g = np.zeros((x.shape[0], kernel.shape[1]), "float32")
    value, bound = reference.gemms(x, kernel, g, "tensorwise")["out"]
    expected = value + to_numpy(layer.bias)
    error = np.abs(to_numpy(out).astype(np.float64) - expected)
    assert (error <= reference.accumulation_error() * bound).all()


def _shared_layer_model(dtype=None):
    """One Dense called twice in the step: on the input and on its own
    output."""
    x = keras.Input((16,))
    shared = keras.layers.Dense(16, name="shared", dtype=dtype)
    return keras.Model(x, shared(shared(x)))


def test_k1_a_layer_called_twice_per_step():
    """K1. Keras sums the two calls' amax "gradients": after 2 steps (both
    at scale 1.0, see K4) the history holds a1 + a2, the amaxes of the two
    calls' inputs, and the scale is 2 * (a1 + a2) / 448, where
    max(a1, a2) / 448 is right: 3.64x too large on TensorFlow, 3.91x on
    JAX, 4.00x on PyTorch (the seeded kernels differ by backend; 4x when
    a1 = a2). A Keras fix makes the first assertions fail: then assert
    `history[0] == max(a1, a2)` and `scale == max(a1, a2) / 448`.

    keras_mp keeps no scale: each call quantizes with its own amax, here
    amaxes 1000x apart, and matches the oracle call by call (one scale
    shared by both calls would put the small call 2e-3 of its sum of
    |products| off, against the 1e-6 allowed)."""
    keras.utils.set_random_seed(0)
    model = _shared_layer_model()
    model.quantize("float8")
    model.compile(keras.optimizers.SGD(0.0), loss="mse")
    x = _rng().normal(size=(8, 16)).astype("float32")
    for _ in range(2):
        model.train_on_batch(x, np.zeros((8, 16), "float32"))
    layer = model.get_layer("shared")
    scale = _value(layer.inputs_scale)
    history = _value(layer.inputs_amax_history)

    def at_scale_one(t):
        return reference.encode(t, np.float32(1.0), "e4m3").astype(np.float64)

    first = np.abs(x).max()
    hidden = at_scale_one(x) @ at_scale_one(to_numpy(layer.kernel))
    second = np.abs(hidden + to_numpy(layer.bias)).max()
    np.testing.assert_allclose(history[0], first + second, rtol=1e-6)
    np.testing.assert_allclose(scale, 2 * history[0] / E4M3_MAX, rtol=1e-6)
    assert 3.5 < scale / (max(first, second) / E4M3_MAX) <= 4.0

    keras.utils.set_random_seed(0)
    inputs = [keras.Input((16,)), keras.Input((16,))]
    shared = keras.layers.Dense(16, name="shared", dtype=_fp8_policy())
    model = keras.Model(inputs, [shared(inputs[0]), shared(inputs[1])])
    assert _fp8_layers(model) == ["shared"]
    assert len(shared.weights) == 2
    large = _rng(1).normal(size=(8, 16)).astype("float32")
    small = (1e-3 * _rng(2).normal(size=(8, 16))).astype("float32")
    outputs = model.predict_on_batch([large, small])
    _assert_matches_oracle_forward(outputs[0], large, shared)
    _assert_matches_oracle_forward(outputs[1], small, shared)


def _frozen_then_head(dtype=None):
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(16, name="frozen", dtype=dtype),
            keras.layers.Dense(4, name="head"),
        ]
    )


def _tiny_inputs():
    return (1e-3 * _rng(3).normal(size=(64, 16))).astype("float32")


def test_k2_a_frozen_fp8_layer_never_calibrates():
    """K2. Keras's frozen float8 layer (`trainable=False`) gets no
    "gradient", so its input scale stays 1.0 and its amax history 0 after
    4 steps; at scale 1.0, 68 % of these 1e-3-sized inputs flush to zero
    in E4M3 (every backend; 69 % in the research probe's sample). A Keras
    fix makes the scale assertion fail: then assert that the scale is
    `amax / 448` of the inputs.

    keras_mp's frozen layer quantizes each call with the inputs' own amax:
    its output is the oracle's and no input flushes."""
    x = _tiny_inputs()
    y = _rng(4).normal(size=(64, 4)).astype("float32")
    keras.utils.set_random_seed(0)
    model = _frozen_then_head()
    model.quantize("float8")
    model.get_layer("frozen").trainable = False
    model.compile(keras.optimizers.SGD(0.01), loss="mse")
    for _ in range(4):
        model.train_on_batch(x, y)
    layer = model.get_layer("frozen")
    assert _value(layer.inputs_scale) == 1.0
    assert not _value(layer.inputs_amax_history).any()
    assert _value(layer.kernel_scale) == 1.0
    # Keras's frozen layer computes with those codes: 694 of 1024 are 0.
    codes = reference.encode(x, np.float32(1.0), "e4m3").astype(np.float64)
    assert np.sum(codes == 0) == 694
    kernel = reference.encode(to_numpy(layer.kernel), np.float32(1.0), "e4m3")
    expected = codes @ kernel.astype(np.float64) + to_numpy(layer.bias)
    bound = np.abs(codes) @ np.abs(kernel.astype(np.float64))
    error = np.abs(to_numpy(layer(x)).astype(np.float64) - expected)
    assert (error <= reference.accumulation_error() * bound).all()

    keras.utils.set_random_seed(0)
    model = _frozen_then_head(dtype=_fp8_policy())
    assert _fp8_layers(model) == ["frozen"]
    layer = model.get_layer("frozen")
    layer.trainable = False
    model.compile(keras.optimizers.SGD(0.01), loss="mse")
    for _ in range(4):
        model.train_on_batch(x, y)
    _assert_matches_oracle_forward(layer(x), x, layer)
    codes, _ = reference.quantize(x, "e4m3", "tensorwise")
    assert not (codes.astype("float32") == 0).any()


def _loss_scaled_keras_history(initial_scale):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(16, name="fp8", dtype="mixed_float16"),
            keras.layers.Dense(4, dtype="mixed_float16"),
        ]
    )
    model.quantize("float8")
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.0), initial_scale=initial_scale
    )
    model.compile(optimizer, loss="mse")
    rng = _rng(5)
    x = rng.normal(size=(8, 16)).astype("float32")
    y = rng.normal(size=(8, 4)).astype("float32")
    model.train_on_batch(x, y)
    return _value(model.get_layer("fp8").outputs_grad_amax_history).max()


def _loss_scaled_keras_mp_weights(loss_scale):
    keras.utils.set_random_seed(0)
    policy = _fp8_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(16, dtype=policy, name="hidden"),
            keras.layers.Dense(16, dtype=policy, name="out"),
        ]
    )
    assert _fp8_layers(model) == ["hidden", "out"]
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        loss_scale=keras_mp.FixedLossScale(loss_scale),
    )
    model.compile(optimizer, loss="mse")
    rng = _rng(5)
    x = rng.normal(size=(8, 16)).astype("float32")
    y = rng.normal(size=(8, 16)).astype("float32")
    model.train_on_batch(x, y)
    return [to_numpy(w) for w in model.weights]


def test_k3_the_output_gradient_amax_is_stored_loss_scaled():
    """K3. Under mixed_float16 with Keras's LossScaleOptimizer at 2**15,
    Keras stores the output-gradient amax in loss-scaled units: exactly
    32768x the amax stored at a loss scale of 1 (every backend). A Keras
    fix makes the ratio 1: then assert that.

    keras_mp stores no amax, and a loss scale changes no FP8 code (current
    scaling divides it out with the amax): one step at a loss scale of
    2**15 and one at 1 give bit-identical weights."""
    ratio = _loss_scaled_keras_history(2.0**15) / _loss_scaled_keras_history(
        1.0
    )
    assert ratio == 2.0**15

    scaled = _loss_scaled_keras_mp_weights(2.0**15)
    unscaled = _loss_scaled_keras_mp_weights(1.0)
    assert len(scaled) == 4
    for got, want in zip(scaled, unscaled, strict=True):
        assert_bitwise_equal(got, want)


def _scales(layer):
    names = ("inputs_scale", "kernel_scale", "outputs_grad_scale")
    return [float(_value(getattr(layer, name))) for name in names]


def test_k4_the_first_two_steps_run_at_scale_one():
    """K4. Keras's three scales are 1.0 before step 1 and still 1.0 before
    step 2 (the new scale comes from the history before this step's amax
    enters it), so steps 1 and 2 run at scale 1.0; only step 3 uses a
    measured scale (every backend). A Keras fix makes the second check
    fail: then assert scales from step 1's amaxes before step 2.

    keras_mp's first step already uses the oracle's scales: its loss at
    step 1, on 1e-3-sized inputs that scale 1.0 would mostly flush, is the
    oracle's."""
    x = _tiny_inputs()
    y = np.zeros((64, 16), "float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16)])
    model.quantize("float8")
    model.compile(keras.optimizers.SGD(0.0), loss="mse")
    layer = model.layers[0]
    before = []
    for _ in range(3):
        before.append(_scales(layer))
        model.train_on_batch(x, y)
    assert before[0] == before[1] == [1.0, 1.0, 1.0]
    assert all(s != 1.0 for s in before[2])

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(16, dtype=_fp8_policy(), name="d"),
        ]
    )
    assert _fp8_layers(model) == ["d"]
    model.compile(keras.optimizers.SGD(0.0), loss="mse")
    layer = model.layers[0]
    loss = float(to_numpy(model.train_on_batch(x, y)))
    kernel = to_numpy(layer.kernel)
    g = np.zeros_like(y)
    out = reference.gemms(x, kernel, g, "tensorwise")["out"][0]
    expected = np.mean((out + to_numpy(layer.bias)) ** 2)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    codes, _ = reference.quantize(x, "e4m3", "tensorwise")
    at_scale_one = reference.encode(x, np.float32(1.0), "e4m3")
    assert np.sum(at_scale_one.astype("float32") == 0) == 694
    assert not (codes.astype("float32") == 0).any()


def _dense_32(dtype=None):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, name="d", dtype=dtype)]
    )


def _dense_32_then_head(seed=0):
    """keras_mp's global FP8 rules leave the output layer out: "d" is the
    model's FP8 layer."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, name="d"),
            keras.layers.Dense(4, name="head"),
        ]
    )
    return model, _fp8_layers(model)


def test_k5_a_reloaded_model_orders_its_weights_differently(tmp_path):
    """K5. After a `.keras` reload, Keras's float8 scale variables come
    before the kernel in `weights`, so `set_weights(get_weights())`
    between the reloaded and a freshly quantized model raises (every
    backend). A Keras fix makes `pytest.raises` fail: then assert the
    round trip.

    keras_mp's order survives a reload: tested in
    `fp8_layers_test.py::TestCheckpoints::
    test_weights_file_and_set_weights_between_fresh_and_reloaded`."""
    fresh = _dense_32()
    fresh.quantize("float8")
    path = str(tmp_path / "model.keras")
    fresh.save(path)
    reloaded = keras.models.load_model(path)
    assert fresh.weights[0].name == "kernel"
    assert reloaded.weights[0].name == "inputs_scale"
    with pytest.raises(ValueError, match=r"shape \(16, 32\)"):
        fresh.set_weights(reloaded.get_weights())
    with pytest.raises(ValueError, match=r"shape \(16, 32\)"):
        reloaded.set_weights(fresh.get_weights())


def test_k6_an_fp8_checkpoint_loads_without_fp8(tmp_path):
    """K6. A `.weights.h5` of Keras's float8 model does not load into the
    same model without float8: "expected 2 variables, but received 8"
    (every backend). A Keras fix makes `pytest.raises` fail: then assert
    that the kernel and bias load.

    keras_mp's FP8 checkpoint (`set_global_policy("mixed_bfloat16",
    fp8=...)`, one step trained) loads into the model built under
    `"mixed_bfloat16"` without FP8, every weight bit for bit."""
    quantized = _dense_32()
    quantized.quantize("float8")
    path = str(tmp_path / "keras.weights.h5")
    quantized.save_weights(path)
    with pytest.raises(ValueError, match="expected 2 variables"):
        _dense_32().load_weights(path)

    keras_mp.set_global_policy("mixed_bfloat16", fp8=fp8.Recipe())
    model, fp8_layers = _dense_32_then_head()
    assert fp8_layers == ["d"]
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
    rng = _rng(6)
    x = rng.normal(size=(8, 16)).astype("float32")
    model.train_on_batch(x, rng.normal(size=(8, 4)).astype("float32"))
    path = str(tmp_path / "keras_mp.weights.h5")
    model.save_weights(path)
    keras_mp.set_global_policy("mixed_bfloat16")
    plain, fp8_layers = _dense_32_then_head(seed=1)
    assert fp8_layers == []
    assert not np.array_equal(
        to_numpy(plain.weights[0]), to_numpy(model.weights[0])
    )
    plain.load_weights(path)
    for got, want in zip(plain.weights, model.weights, strict=True):
        assert_bitwise_equal(to_numpy(got), to_numpy(want))


def test_k7_fp8_state_counts_as_trainable_parameters():
    """K7. Keras's float8 Dense adds 6 trainable variables, 3 * 1024 + 3
    parameters, to `trainable_weights` and `count_params` (every backend).
    A Keras fix makes these counts those of the plain model: then assert
    that.

    keras_mp's current-scaling Dense (`set_global_policy(
    "mixed_bfloat16", fp8=...)`) adds none; with `Recipe(stats=True)`
    it adds exactly one trainable (3, 515) statistics carrier, which the
    optimizer overwrites (1545 parameters)."""
    plain = _dense_32()
    quantized = _dense_32()
    quantized.quantize("float8")
    assert len(quantized.trainable_weights) == len(plain.trainable_weights) + 6
    extra = quantized.count_params() - plain.count_params()
    assert extra == 3 * HISTORY + 3

    plain, _ = _dense_32_then_head()
    keras_mp.set_global_policy("mixed_bfloat16", fp8=fp8.Recipe())
    model, fp8_layers = _dense_32_then_head()
    assert fp8_layers == ["d"]
    assert len(model.trainable_weights) == len(plain.trainable_weights)
    assert model.count_params() == plain.count_params()
    keras_mp.set_global_policy("mixed_bfloat16", fp8=fp8.Recipe(stats=True))
    model, fp8_layers = _dense_32_then_head()
    assert fp8_layers == ["d"]
    extra = [
        (w.path.split("/", 1)[1], tuple(w.shape))
        for w in model.trainable_weights
        if w.name not in ("kernel", "bias")
    ]
    assert extra == [("d/fp8_stats", (3, 515))]
    assert model.count_params() == plain.count_params() + 3 * 515

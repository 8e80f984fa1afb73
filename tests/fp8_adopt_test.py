"""`keras_mp.fp8.adopt` (issue 22, item 2): a model Keras quantized with
`model.quantize("float8")` taken over by keras_mp's delayed FP8 scaling,
its amax histories kept."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import fp8
from keras_mp import fp8_layers
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import fp8_reference as reference
from keras_mp.testing import to_numpy

# Keras warns that `model.quantize` skips a Sequential's InputLayer.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Layer InputLayer does not have a `quantize`:UserWarning"
)

FEATURES = 16
UNITS = 32
KERAS_NAMES = (
    "inputs_scale",
    "inputs_amax_history",
    "kernel_scale",
    "kernel_amax_history",
    "outputs_grad_scale",
    "outputs_grad_amax_history",
)
KERAS_HISTORIES = KERAS_NAMES[1::2]


def _newest_first(ring):
    """Keras's ring as a list, apart from the library: Keras writes the
    newest amax at index 0 after rolling by -1, so the one before it sits
    at the end, and so on backwards."""
    ring = list(ring)
    return np.array([ring[0], *reversed(ring[1:])], np.float32)


def _keras_rows(layer):
    return np.stack(
        [_newest_first(to_numpy(getattr(layer, n))) for n in KERAS_HISTORIES]
    )


def _state(layer):
    return {
        name: to_numpy(v) for name, v in fp8_layers.delayed_state(layer).items()
    }


def _data(step, scale=1.0):
    """Inputs whose amax changes from step to step, some with a mantissa
    above 1.75 (the bin's upper half)."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(8, FEATURES)) * scale * (1.0 + 0.45 * step)
    return x.astype("float32"), rng.normal(size=(8, 4)).astype("float32")


def _keras_float8_model(steps, dtype=None, seed=0):
    """A Dense and an EinsumDense that `model.quantize("float8")` made,
    trained `steps` steps by Keras."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(UNITS, name="d"),
            keras.layers.EinsumDense("ab,bc->ac", 4, name="e", dtype=dtype),
        ]
    )
    model.quantize("float8")
    model.compile(keras.optimizers.SGD(0.01), loss="mse")
    for step in range(steps):
        model.train_on_batch(*_data(step))
    return model


def _fp8_column(model):
    rows = keras_mp.explain_precision(model, print_fn=None)
    return {row["layer"].split("/")[-1]: row["fp8"] for row in rows}


def test_adopt_keeps_kerass_histories_newest_first_as_bins_with_te_scales():
    """After 4 Keras steps, each layer's `fp8_amax_history` is Keras's
    three histories (input, kernel, output gradient) newest first, each
    amax as its bin's value, bit for bit; `fp8_steps` is 1 and `fp8_scale`
    is the oracle's power-of-two scale of each row's max (E4M3, E4M3,
    E5M2). The layers keep the dtypes they were quantized from and run
    keras_mp's delayed FP8."""
    model = _keras_float8_model(steps=4, dtype="mixed_bfloat16")
    expected = {
        name: reference.history_value(_keras_rows(model.get_layer(name)))
        for name in ("d", "e")
    }
    adopted = fp8.adopt(model)
    assert [layer.name for layer in adopted] == ["d", "e"]
    for name, policy in (("d", "float32"), ("e", "mixed_bfloat16")):
        layer = model.get_layer(name)
        assert layer.quantization_mode is None
        assert layer.dtype_policy.name == policy
        assert layer.dtype_policy.fp8 == fp8.Recipe(
            scaling="delayed", amax_history=1024
        )
        state = _state(layer)
        history = expected[name]
        assert history.shape == (3, 1024)
        assert (history[:, :4] > 0).all() and not history[:, 4:].any()
        assert_bitwise_equal(state["fp8_amax_history"], history)
        assert state["fp8_steps"] == 1
        scales = [
            reference.scale(history[i].max(), fmt)
            for i, fmt in enumerate(("e4m3", "e4m3", "e5m2"))
        ]
        assert_bitwise_equal(state["fp8_scale"], np.array(scales))
    assert _fp8_column(model) == {
        "sequential": "no GEMM",
        "d": "delayed/tensorwise/hybrid history=1024 max",
        "e": "delayed/tensorwise/hybrid history=1024 max",
    }


def test_a_ring_that_wrapped_keeps_its_newest_amaxes_in_order():
    """With Keras's history of 4 after 6 steps (the ring wrapped), the
    input row is the bins of the last four inputs' amaxes, newest first,
    computed from the inputs alone; a recipe of another length keeps the
    newest entries (2) or pads with zeros (6)."""

    def trained():
        keras.utils.set_random_seed(0)
        policy = keras.dtype_policies.QuantizedFloat8DTypePolicy(
            "float8", "float32", amax_history_length=4
        )
        model = keras.Sequential(
            [keras.Input((FEATURES,)), keras.layers.Dense(4, dtype=policy)]
        )
        model.compile(keras.optimizers.SGD(0.01), loss="mse")
        for step in range(6):
            model.train_on_batch(*_data(step))
        return model

    amaxes = [np.abs(_data(step)[0]).max() for step in reversed(range(6))]
    newest = reference.history_value(np.array(amaxes, np.float32))
    model = trained()
    fp8.adopt(model)
    history = _state(model.layers[0])["fp8_amax_history"]
    assert_bitwise_equal(history[0], newest[:4])
    for length in (2, 6):
        model = trained()
        recipe = fp8.Recipe(scaling="delayed", amax_history=length)
        fp8.adopt(model, recipe=recipe)
        layer = model.layers[0]
        assert layer.dtype_policy.fp8 == recipe
        expected = np.zeros(length, np.float32)
        expected[: min(length, 4)] = newest[: min(length, 4)]
        assert_bitwise_equal(_state(layer)["fp8_amax_history"][0], expected)


def test_loss_scale_divides_only_the_output_gradient_history():
    """`loss_scale=2**10`: the output gradient's row holds the bins of
    Keras's amaxes / 1024, the input and kernel rows those of Keras's."""
    model = _keras_float8_model(steps=3)
    layer = model.get_layer("d")
    rows = _keras_rows(layer)
    fp8.adopt(model, loss_scale=2**10)
    history = _state(layer)["fp8_amax_history"]
    assert_bitwise_equal(history[:2], reference.history_value(rows[:2]))
    assert_bitwise_equal(
        history[2], reference.history_value(rows[2] / np.float32(1024))
    )
    assert not np.array_equal(history[2], reference.history_value(rows[2]))


def test_a_layer_keras_never_trained_starts_with_current_scaling():
    """Adopted before any step: history, steps and scales are 0 (the first
    step runs current scaling). Compiled and trained 2 steps, the first
    step's amaxes are folded in: steps 1, the input row starts with the
    bin of the first batch's amax."""
    model = _keras_float8_model(steps=0)
    fp8.adopt(model)
    layer = model.get_layer("d")
    state = _state(layer)
    assert not state["fp8_amax_history"].any()
    assert state["fp8_steps"] == 0
    assert not state["fp8_scale"].any()
    model.compile(keras.optimizers.SGD(0.01), loss="mse")
    for step in range(2):
        loss = model.train_on_batch(*_data(step))
        assert np.isfinite(to_numpy(loss))
    state = _state(layer)
    assert state["fp8_steps"] == 1
    first = reference.history_value(np.abs(_data(0)[0]).max())
    assert_bitwise_equal(
        state["fp8_amax_history"][0, :2], np.array([first, 0.0], np.float32)
    )
    assert (state["fp8_scale"] > 0).all()


def test_training_continues_after_compiling_again_and_the_state_advances():
    """Keras trains 3 steps; adopted and compiled again, 2 more steps
    train the kernel, fold one step's amaxes in front of Keras's history
    (steps 2), and the input row is the new amax then Keras's three."""
    model = _keras_float8_model(steps=3)
    layer = model.get_layer("d")
    keras_history = reference.history_value(_keras_rows(layer))
    fp8.adopt(model)
    model.compile(keras.optimizers.SGD(0.01), loss="mse")
    kernel = to_numpy(layer.kernel).copy()
    for step in range(3, 5):
        loss = model.train_on_batch(*_data(step))
        assert np.isfinite(to_numpy(loss))
    assert not np.array_equal(to_numpy(layer.kernel), kernel)
    state = _state(layer)
    assert state["fp8_steps"] == 2
    history = state["fp8_amax_history"]
    new = reference.history_value(np.abs(_data(3)[0]).max())
    assert_bitwise_equal(
        history[0, :4], np.array([new, *keras_history[0, :3]], np.float32)
    )
    assert_bitwise_equal(history[1:, 1:4], keras_history[1:, :3])


def test_a_step_compiled_before_adopt_is_traced_again(tmp_path):
    """`predict` ran (and was compiled) with Keras's float8 GEMMs; after
    adopt it gives what the layers' own call gives now (keras_mp's GEMMs,
    other scales than Keras's), and a `.keras` reload keeps the policy and
    the delayed state."""
    model = _keras_float8_model(steps=2)
    x = _data(5)[0]
    keras_out = to_numpy(model.predict(x, verbose=0))
    fp8.adopt(model)
    out = to_numpy(model.predict(x, verbose=0))
    np.testing.assert_allclose(out, to_numpy(model(x)), rtol=1e-6, atol=1e-6)
    assert not np.allclose(out, keras_out, rtol=1e-6, atol=1e-6)
    path = str(tmp_path / "adopted.keras")
    model.save(path)
    reloaded = keras.models.load_model(path)
    layer = reloaded.get_layer("d")
    assert layer.dtype_policy.fp8 == model.get_layer("d").dtype_policy.fp8
    for name, value in _state(model.get_layer("d")).items():
        assert_bitwise_equal(_state(layer)[name], value)


def test_kerass_float8_variables_leave_the_model():
    """After adopt no Keras float8 variable is in `weights` or
    `trainable_weights`, nor an attribute of the layer (nor a torch
    parameter); keras_mp's carrier is the one extra trainable variable and
    its delayed state is non-trainable."""
    model = _keras_float8_model(steps=1)
    fp8.adopt(model)
    layer = model.get_layer("d")
    assert [w.name for w in layer.trainable_weights] == [
        "kernel",
        "bias",
        "fp8_stats",
    ]
    assert [w.name for w in layer.non_trainable_weights] == [
        "fp8_amax_history",
        "fp8_steps",
        "fp8_scale",
    ]
    names = {w.name for w in model.weights}
    assert not names & set(KERAS_NAMES)
    assert not any(hasattr(layer, name) for name in KERAS_NAMES)
    if keras.backend.backend() == "torch":
        assert len(list(model.parameters())) == len(model.weights)


def test_other_layers_are_left_alone():
    """A plain Dense, Keras's int8 Dense and keras_mp's current-scaling
    FP8 Dense keep their policy objects and variables; only the float8
    Dense is taken over."""
    keras.utils.set_random_seed(0)
    current = keras_mp.Policy("float32", fp8=fp8.Recipe())
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(UNITS, name="float8"),
            keras.layers.Dense(UNITS, name="plain"),
            keras.layers.Dense(UNITS, name="int8"),
            keras.layers.Dense(4, name="current", dtype=current),
        ]
    )
    model.get_layer("float8").quantize("float8")
    model.get_layer("int8").quantize("int8")
    others = ("plain", "int8", "current")
    before = {
        name: (
            model.get_layer(name).dtype_policy,
            [id(w) for w in model.get_layer(name).weights],
        )
        for name in others
    }
    assert [layer.name for layer in fp8.adopt(model)] == ["float8"]
    for name in others:
        layer = model.get_layer(name)
        policy, weights = before[name]
        assert layer.dtype_policy is policy
        assert [id(w) for w in layer.weights] == weights
    assert model.get_layer("int8").quantization_mode == "int8"
    assert _fp8_column(model)["current"] == "current/tensorwise/hybrid"


def test_a_model_without_float8_layers_raises_and_names_the_fix():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(4, name="d")]
    )
    with pytest.raises(ValueError, match='quantize\\("float8"\\)') as error:
        fp8.adopt(model)
    assert "Received: model='sequential" in str(error.value)
    with pytest.raises(TypeError, match="Keras model or layer"):
        fp8.adopt("model")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"recipe": fp8.Recipe()}, "delayed tensorwise"),
        ({"recipe": {"scaling": "delayed"}}, "keras_mp.fp8.Recipe"),
        ({"loss_scale": 3.0}, "power of two"),
        ({"loss_scale": 0.0}, "power of two"),
    ],
)
def test_bad_arguments_raise_before_any_layer_changes(kwargs, match):
    model = _keras_float8_model(steps=0)
    with pytest.raises((ValueError, TypeError), match=match):
        fp8.adopt(model, **kwargs)
    layer = model.get_layer("d")
    assert layer.quantization_mode == "float8"
    assert {w.name for w in layer.weights} >= set(KERAS_NAMES)


def test_a_layer_that_cannot_be_adopted_leaves_every_layer_as_it_was():
    """The second float8 Dense is not built (no float8 variables): adopt
    raises, and the first, which it could take over, is unchanged."""
    policy = keras.dtype_policies.QuantizedFloat8DTypePolicy(
        "float8", "float32"
    )
    model = keras.Sequential(
        [
            keras.layers.Dense(UNITS, name="built", dtype=policy),
            keras.layers.Dense(4, name="unbuilt", dtype=policy),
        ]
    )
    model.layers[0].build((None, FEATURES))
    with pytest.raises(ValueError, match="'unbuilt'.*Build it"):
        fp8.adopt(model)
    layer = model.get_layer("built")
    assert layer.quantization_mode == "float8"
    assert len(layer.weights) == 2 + len(KERAS_NAMES)
    assert fp8_layers.delayed_state(layer) == {}

import contextlib
import inspect
import warnings

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import losses
from keras_mp.testing import assert_close
from keras_mp.testing import to_numpy

BACKEND = keras.backend.backend()

KERAS_LOSS_CLASSES = sorted(
    name
    for name, value in vars(keras.losses).items()
    if inspect.isclass(value)
    and issubclass(value, keras.losses.Loss)
    and value is not keras.losses.Loss
)
CROSSENTROPIES = [
    "BinaryCrossentropy",
    "BinaryFocalCrossentropy",
    "CategoricalCrossentropy",
    "CategoricalFocalCrossentropy",
    "SparseCategoricalCrossentropy",
]
SPARSE_LABEL_LOSSES = (
    "CategoricalGeneralizedCrossEntropy",
    "SparseCategoricalCrossentropy",
)
WARNING_MARK = "probabilities (from_logits=False)"

# Non-default values for the arguments that change a loss's value; every
# test that uses them also passes reduction="sum".
VALUE_ARGUMENTS = {
    "BinaryCrossentropy": {"from_logits": True, "label_smoothing": 0.1},
    "BinaryFocalCrossentropy": {
        "apply_class_balancing": True,
        "alpha": 0.4,
        "gamma": 3.0,
        "label_smoothing": 0.1,
    },
    "CategoricalCrossentropy": {"from_logits": True, "label_smoothing": 0.1},
    "CategoricalFocalCrossentropy": {
        "alpha": 0.4,
        "gamma": 3.0,
        "from_logits": True,
    },
    "CategoricalGeneralizedCrossEntropy": {"q": 0.7},
    "Circle": {"gamma": 60.0, "margin": 0.3, "remove_diagonal": False},
    "CosineSimilarity": {"axis": 0},
    "Dice": {"axis": (1,)},
    "Huber": {"delta": 0.5},
    "SparseCategoricalCrossentropy": {"from_logits": True, "ignore_class": 2},
    "Tversky": {"alpha": 0.3, "beta": 0.7},
}

# Non-default values for every argument of every class (checked below).
ROUND_TRIP_ARGUMENTS = {
    name: {
        "reduction": "sum",
        "name": "custom_loss",
        "dtype": "float64",
        "axis": 1,
        "from_logits": True,
        "label_smoothing": 0.1,
        **VALUE_ARGUMENTS.get(name, {}),
    }
    for name in KERAS_LOSS_CLASSES
}
ROUND_TRIP_ARGUMENTS["Dice"]["axis"] = [1]
ROUND_TRIP_ARGUMENTS["Tversky"]["axis"] = [1]
ROUND_TRIP_ARGUMENTS["SparseCategoricalCrossentropy"]["axis"] = 1


@pytest.fixture(autouse=True)
def fresh_warning_state(monkeypatch):
    """Each test sees the low precision warning as if for the first time."""
    monkeypatch.setattr(losses, "_warned_loss_classes", set())


def _inputs(name, dtype="float32", seed=0):
    """(y_true, y_pred) NumPy arrays that suit the loss `name`."""
    rng = np.random.default_rng(seed)
    if name == "CTC":
        y_true = np.array([[1, 2, 0], [3, 1, 2]], dtype="int32")
        y_pred = rng.normal(size=(2, 5, 4))
    elif name == "Circle":
        y_true = np.array([0, 1, 0, 1], dtype="int32")
        y_pred = rng.normal(size=(4, 3))
        y_pred /= np.linalg.norm(y_pred, axis=-1, keepdims=True)
    else:
        labels = np.array([0, 2, 1, 2])
        logits = rng.normal(size=(4, 3))
        y_pred = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
        if name in SPARSE_LABEL_LOSSES:
            y_true = labels.astype("int32")
        else:
            y_true = np.eye(3)[labels].astype(dtype)
    return y_true, y_pred.astype(dtype)


def _standard_dtype(tensor):
    return keras.backend.standardize_dtype(tensor.dtype)


def _set_policy_quietly(name):
    # The hardware check warns on machines without fast 16-bit compute.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keras_mp.set_global_policy(name)


def _probability_warnings(caught):
    return [w for w in caught if WARNING_MARK in str(w.message)]


@contextlib.contextmanager
def _recorded_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


@contextlib.contextmanager
def _float64_enabled():
    if BACKEND == "jax":
        import jax

        with jax.enable_x64(True):
            yield
    else:
        yield


def test_every_keras_loss_class_has_a_counterpart_under_the_same_name():
    assert len(KERAS_LOSS_CLASSES) >= 20
    for name in KERAS_LOSS_CLASSES:
        counterpart = getattr(losses, name)
        assert counterpart.__name__ == name
        assert issubclass(counterpart, losses.Loss)
        assert issubclass(counterpart, getattr(keras.losses, name))


def test_all_lists_the_base_and_every_counterpart():
    assert sorted(losses.__all__) == sorted(["Loss", *KERAS_LOSS_CLASSES])
    assert keras_mp.losses is losses


@pytest.mark.parametrize("name", ["Loss", *KERAS_LOSS_CLASSES])
def test_classes_are_registered_as_keras_mp_class_name(name):
    cls = getattr(losses, name)
    assert keras.saving.get_registered_name(cls) == f"keras_mp>{name}"
    assert keras.saving.get_registered_object(f"keras_mp>{name}") is cls


@pytest.mark.parametrize("name", KERAS_LOSS_CLASSES)
def test_counterparts_document_themselves_and_default_to_float32(name):
    cls = getattr(losses, name)
    assert cls.__module__ == "keras_mp.losses"
    assert f"keras.losses.{name}`" in cls.__doc__
    assert "Args:" in cls.__doc__ and "Example:" in cls.__doc__
    parameters = inspect.signature(cls).parameters
    keras_parameters = inspect.signature(getattr(keras.losses, name)).parameters
    assert list(parameters) == list(keras_parameters)
    assert parameters["dtype"].default == "float32"
    assert cls().dtype == "float32"


@pytest.mark.parametrize("name", KERAS_LOSS_CLASSES)
def test_float16_inputs_give_a_float32_loss_under_mixed_float16(name):
    _set_policy_quietly("mixed_float16")
    y_true, y_pred = _inputs(name, dtype="float16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = getattr(losses, name)()(y_true, y_pred)
    assert _standard_dtype(value) == "float32"
    # The float16 inputs were cast, then the loss ran in float32.
    expected = getattr(keras.losses, name)(dtype="float32")(
        y_true, y_pred.astype("float32")
    )
    assert_close(value, expected, "float32")


def test_default_dtype_stays_float32_whatever_floatx_and_policy():
    keras.config.set_floatx("float16")
    _set_policy_quietly("mixed_bfloat16")
    assert keras.losses.MeanSquaredError().dtype == "float16"
    assert losses.MeanSquaredError().dtype == "float32"
    assert losses.Loss().dtype == "float32"
    value = losses.MeanSquaredError()(
        np.ones((2, 3), "float16"), np.zeros((2, 3), "float16")
    )
    assert _standard_dtype(value) == "float32"


@pytest.mark.parametrize("name", KERAS_LOSS_CLASSES)
def test_value_matches_keras_builtin_on_float32_inputs(name):
    y_true, y_pred = _inputs(name)
    sample_weight = np.linspace(0.5, 1.5, len(y_true)).astype("float32")
    ours = getattr(losses, name)()
    theirs = getattr(keras.losses, name)()
    assert_close(ours(y_true, y_pred), theirs(y_true, y_pred))
    assert_close(
        ours(y_true, y_pred, sample_weight=sample_weight),
        theirs(y_true, y_pred, sample_weight=sample_weight),
    )


@pytest.mark.parametrize("name", sorted(VALUE_ARGUMENTS))
def test_value_matches_keras_builtin_with_non_default_arguments(name):
    y_true, y_pred = _inputs(name, seed=1)
    arguments = dict(VALUE_ARGUMENTS[name], reduction="sum")
    ours = getattr(losses, name)(**arguments)(y_true, y_pred)
    theirs = getattr(keras.losses, name)(**arguments)(y_true, y_pred)
    assert_close(ours, theirs)


def test_positional_arguments_bind_as_in_keras():
    loss = losses.BinaryCrossentropy(True, 0.2)
    assert loss.from_logits is True
    assert loss.label_smoothing == 0.2
    assert losses.Dice("sum", "dice_loss", (1,)).get_config()["axis"] == (1,)


def test_dtype_float64_is_honored():
    y_true = np.array([[1.0, 2.0]])
    y_pred = np.array([[1.0 + 1e-12, 2.0]])
    with _float64_enabled():
        value = losses.MeanSquaredError(dtype="float64")(y_true, y_pred)
        assert _standard_dtype(value) == "float64"
        # In float32, 1 + 1e-12 rounds to 1 and the loss would be 0.
        assert float(to_numpy(value)) == pytest.approx(5e-25, rel=1e-3)


def test_dtype_bfloat16_is_honored():
    y_true, y_pred = _inputs("MeanAbsoluteError", dtype="float32")
    value = losses.MeanAbsoluteError(dtype="bfloat16")(y_true, y_pred)
    assert _standard_dtype(value) == "bfloat16"
    expected = np.abs(y_true - y_pred).mean()
    # Cast first: TensorFlow cannot hand a bfloat16 scalar to NumPy.
    assert_close(keras.ops.cast(value, "float32"), expected, "bfloat16")


@pytest.mark.parametrize(
    "dtype, expected",
    [
        (None, "float32"),
        (np.float64, "float64"),
        (np.dtype("float16"), "float16"),
        ("bfloat16", "bfloat16"),
    ],
)
def test_dtype_accepts_dtype_objects_and_none_means_float32(dtype, expected):
    assert losses.Huber(dtype=dtype).dtype == expected
    assert losses.Huber(dtype=dtype).get_config()["dtype"] == expected


@pytest.mark.parametrize("name", KERAS_LOSS_CLASSES)
def test_config_round_trip_keeps_non_default_values_including_dtype(name):
    cls = getattr(losses, name)
    arguments = {
        key: value
        for key, value in ROUND_TRIP_ARGUMENTS[name].items()
        if key in inspect.signature(cls).parameters
    }
    # Every argument is given, and differs from its default.
    for parameter in inspect.signature(cls).parameters.values():
        assert parameter.name in arguments, parameter.name
        assert arguments[parameter.name] != parameter.default, parameter.name
    config = cls(**arguments).get_config()
    assert config == arguments
    restored = cls.from_config(config)
    assert type(restored) is cls
    assert restored.get_config() == config
    assert restored.dtype == "float64"

    serialized = keras.saving.serialize_keras_object(cls(**arguments))
    assert serialized["registered_name"] == f"keras_mp>{name}"
    deserialized = keras.saving.deserialize_keras_object(serialized)
    assert type(deserialized) is cls
    assert deserialized.get_config() == config


def test_saved_model_reloads_its_keras_mp_loss_with_dtype(tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    loss = losses.CategoricalCrossentropy(
        from_logits=True, label_smoothing=0.1, dtype="float64"
    )
    model.compile(optimizer="sgd", loss=loss)
    model.save(tmp_path / "model.keras")
    restored = keras.saving.load_model(tmp_path / "model.keras")
    assert type(restored.loss) is losses.CategoricalCrossentropy
    assert restored.loss.get_config() == loss.get_config()


@pytest.mark.parametrize(
    "name, arguments",
    [
        ("Huber", {"delta": 0.25}),
        ("CosineSimilarity", {"axis": 0}),
    ],
)
def test_round_trip_keeps_arguments_that_keras_configs_drop(name, arguments):
    y_true, y_pred = _inputs(name, seed=2)
    loss = getattr(losses, name)(**arguments)
    restored = getattr(losses, name).from_config(loss.get_config())
    assert_close(restored(y_true, y_pred), loss(y_true, y_pred))
    default = getattr(losses, name)()
    assert not np.allclose(
        to_numpy(default(y_true, y_pred)), to_numpy(loss(y_true, y_pred))
    )


def test_custom_subclass_casts_inputs_reduces_in_dtype_and_round_trips():
    class MeanCubedError(losses.Loss):
        def call(self, y_true, y_pred):
            self.seen_dtypes = (
                _standard_dtype(y_true),
                _standard_dtype(y_pred),
            )
            return keras.ops.mean(keras.ops.abs(y_pred - y_true) ** 3, axis=-1)

    _set_policy_quietly("mixed_float16")
    loss = MeanCubedError(name="cubed", reduction="sum", dtype="float64")
    with _float64_enabled():
        value = loss(np.zeros((2, 2), "int32"), np.ones((2, 2), "float16"))
        assert loss.seen_dtypes == ("float64", "float64")
        assert _standard_dtype(value) == "float64"
        assert float(to_numpy(value)) == 2.0
    config = loss.get_config()
    assert config == {"name": "cubed", "reduction": "sum", "dtype": "float64"}
    assert MeanCubedError.from_config(config).get_config() == config


@pytest.mark.parametrize("name", CROSSENTROPIES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_crossentropy_warns_once_on_16_bit_probabilities(name, dtype):
    y_true, y_pred = _inputs(name, dtype="float32")
    y_pred = keras.ops.cast(y_pred, dtype)
    with _recorded_warnings() as caught:
        loss = getattr(losses, name)()
        loss(y_true, y_pred)
        loss(y_true, y_pred)
        getattr(losses, name)()(y_true, y_pred)
    found = _probability_warnings(caught)
    assert len(found) == 1
    assert found[0].category is UserWarning
    message = str(found[0].message)
    assert name in message and dtype in message
    assert 'dtype="float32")' in message and "from_logits=True" in message


@pytest.mark.parametrize("name", CROSSENTROPIES)
def test_crossentropy_does_not_warn_for_logits_or_float32_probabilities(name):
    y_true, y_pred = _inputs(name, dtype="float32")
    with _recorded_warnings() as caught:
        getattr(losses, name)(from_logits=True)(
            y_true, keras.ops.cast(y_pred, "float16")
        )
        getattr(losses, name)()(y_true, y_pred)
        getattr(losses, name)()(y_true, y_pred.astype("float64"))
    assert _probability_warnings(caught) == []


@pytest.mark.parametrize(
    "name", sorted(set(KERAS_LOSS_CLASSES) - set(CROSSENTROPIES))
)
def test_losses_without_from_logits_never_warn(name):
    y_true, y_pred = _inputs(name, dtype="float16")
    with _recorded_warnings() as caught:
        getattr(losses, name)()(y_true, y_pred)
    assert _probability_warnings(caught) == []


def test_each_crossentropy_class_warns_once_on_its_own():
    y_true, y_pred = _inputs("CategoricalCrossentropy", dtype="float16")
    with _recorded_warnings() as caught:
        losses.CategoricalCrossentropy()(y_true, y_pred)
        losses.BinaryCrossentropy()(y_true, y_pred)
        losses.BinaryCrossentropy()(y_true, y_pred)
        losses.CategoricalCrossentropy()(y_true, y_pred)
    messages = [str(w.message) for w in _probability_warnings(caught)]
    assert len(messages) == 2
    assert 'Activation("softmax"' in messages[0]
    assert 'Activation("sigmoid"' in messages[1]


@pytest.mark.backends("jax")
def test_warning_fires_once_while_jax_jit_traces_the_loss():
    import jax

    loss = losses.CategoricalCrossentropy()
    step = jax.jit(lambda y_true, y_pred: loss(y_true, y_pred))
    y_true, y_pred = _inputs("CategoricalCrossentropy")
    y_pred = keras.ops.cast(y_pred, "bfloat16")
    with _recorded_warnings() as caught:
        value = step(y_true, y_pred)
        step(y_true, y_pred)
    assert len(_probability_warnings(caught)) == 1
    assert _standard_dtype(value) == "float32"


@pytest.mark.backends("tensorflow")
def test_warning_fires_once_while_tf_function_traces_the_loss():
    import tensorflow as tf

    loss = losses.SparseCategoricalCrossentropy()
    step = tf.function(lambda y_true, y_pred: loss(y_true, y_pred))
    y_true, y_pred = _inputs("SparseCategoricalCrossentropy", dtype="float16")
    with _recorded_warnings() as caught:
        value = step(tf.constant(y_true), tf.constant(y_pred))
        step(tf.constant(y_true), tf.constant(y_pred))
    assert len(_probability_warnings(caught)) == 1
    assert _standard_dtype(value) == "float32"


def _tiny_classifier(final_activation_dtype):
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3),
            keras.layers.Activation("softmax", dtype=final_activation_dtype),
        ]
    )


def _tiny_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype("float32")
    y = np.eye(3)[rng.integers(0, 3, size=8)].astype("float32")
    return x, y


def test_model_with_keras_mp_loss_trains_under_mixed_bfloat16():
    _set_policy_quietly("mixed_bfloat16")
    model = _tiny_classifier("float32")
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=losses.CategoricalCrossentropy(),
    )
    assert model.layers[0].compute_dtype == "bfloat16"
    kernel_before = model.layers[0].get_weights()[0]
    x, y = _tiny_data()
    with _recorded_warnings() as caught:
        history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert _probability_warnings(caught) == []
    assert np.isfinite(history.history["loss"]).all()
    assert not np.array_equal(kernel_before, model.layers[0].get_weights()[0])


def test_fit_with_a_bfloat16_softmax_output_warns_once():
    _set_policy_quietly("mixed_bfloat16")
    model = _tiny_classifier(None)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=losses.CategoricalCrossentropy(),
    )
    x, y = _tiny_data()
    with _recorded_warnings() as caught:
        model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    found = _probability_warnings(caught)
    assert len(found) == 1
    assert "bfloat16" in str(found[0].message)


@pytest.mark.parametrize(
    "dtype", ["int32", "bool", "complex64", "float8_e4m3fn", "mixed_float16"]
)
@pytest.mark.parametrize("cls", [losses.Loss, losses.BinaryCrossentropy])
def test_non_float_dtype_raises_value_error(cls, dtype):
    with pytest.raises(ValueError, match="Expected `dtype` to be") as error:
        cls(dtype=dtype)
    assert f"Received: dtype={dtype!r}" in str(error.value)
    assert '"float32"' in str(error.value)


@pytest.mark.parametrize(
    "dtype", [object(), 3, keras.DTypePolicy("mixed_float16")]
)
@pytest.mark.parametrize("cls", [losses.Loss, losses.MeanSquaredError])
def test_non_dtype_raises_type_error(cls, dtype):
    with pytest.raises(TypeError, match="Expected `dtype` to be") as error:
        cls(dtype=dtype)
    assert f"Received: dtype={dtype!r}" in str(error.value)

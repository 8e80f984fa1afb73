"""keras_mp among Keras, TensorFlow and JAX: what it must not step on.

Checks that need a runtime not yet initialized, or several tf.distribute
strategies in one process, run in fresh interpreters.
"""

import io
import zipfile

import h5py
import numpy as np
import pytest

from keras_mp.testing import run_python

CHILD_TIMEOUT = 240


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_set_global_policy_leaves_tensorflow_devices_configurable(policy):
    out = run_python(
        f"""
        import keras_mp
        import tensorflow as tf

        keras_mp.set_global_policy({policy!r})
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
        print(len(tf.config.list_logical_devices("CPU")))
        """,
        env={"KERAS_BACKEND": "tensorflow"},
        timeout=CHILD_TIMEOUT,
    )
    assert out.split()[-1] == "2"


@pytest.mark.backends("jax")
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_set_global_policy_leaves_the_jax_backend_uninitialized(policy):
    out = run_python(
        f"""
        import keras_mp
        from jax._src import xla_bridge

        keras_mp.set_global_policy({policy!r})
        print(xla_bridge.backends_are_initialized())
        """,
        env={"KERAS_BACKEND": "jax"},
        timeout=CHILD_TIMEOUT,
    )
    assert out.split()[-1] == "False"


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_hardware_check_runs_at_the_first_build_instead(policy):
    import keras

    out = run_python(
        f"""
        import warnings
        import keras
        import keras_mp
        from keras_mp.backend import devices

        devices.device_details = lambda: [devices._cpu_details() | dict(
            name="test CPU", native_bfloat16=False)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            keras_mp.set_global_policy({policy!r})
            print("after policy", len(caught))
            keras.layers.Dense(2).build((None, 3))
            print("after build", len(caught))
            keras.layers.Dense(2).build((None, 3))
            print("after second build", len(caught))
        print(caught[0].message)
        """,
        env={"KERAS_BACKEND": keras.backend.backend()},
        timeout=CHILD_TIMEOUT,
    )
    assert "after policy 0" in out
    assert "after build 1" in out
    assert "after second build 1" in out
    assert "test CPU" in out


_TWO_STRATEGIES = """
import sys
import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)
import keras
import keras_mp

x = np.random.RandomState(0).randn(32, 4).astype("float32")
y = x.sum(axis=1, keepdims=True)
for aggregate_in_float16 in {order}:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(3, dtype="mixed_float16"),
            keras.layers.Dense(1),
        ])
        optimizer = keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(0.01),
            aggregate_in_float16=aggregate_in_float16,
        )
        model.compile(optimizer, "mean_squared_error")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    print("trained", aggregate_in_float16)
"""


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("order", [(False, True), (True, False)])
def test_float16_and_float32_all_reduce_strategies_run_in_one_process(order):
    out = run_python(
        _TWO_STRATEGIES.format(order=order),
        env={"KERAS_BACKEND": "tensorflow"},
        timeout=CHILD_TIMEOUT,
    )
    assert out.split("\n")[-3:-1] == [f"trained {flag}" for flag in order]


# Error messages name what the user wrote.


@pytest.mark.parametrize(
    "restore, needed",
    [
        (lambda: _lso().from_config({}), "inner_optimizer"),
        (lambda: _lso().from_config([]), "is a dict"),
        (lambda: _wrapper().from_config({}), "'optimizer'"),
        (lambda: _keras_mp().DynamicLossScale.from_config({"x": 1}), "'x'"),
        (lambda: _keras_mp().FixedLossScale.from_config({}), "needs"),
        (
            lambda: _keras_mp().transforms.ClipByValue.from_config(
                {"clip_valu": 1}
            ),
            "'clip_valu'",
        ),
    ],
    ids=["lso", "lso-list", "wrapper", "dynamic", "fixed", "transform"],
)
def test_from_config_of_a_malformed_config_says_what_is_wrong(restore, needed):
    with pytest.raises(ValueError, match="config") as error:
        restore()
    assert needed in str(error.value)


def _keras_mp():
    import keras_mp

    return keras_mp


def _lso():
    return _keras_mp().LossScaleOptimizer


def _wrapper():
    return _keras_mp().OptimizerWrapper


def test_dir_of_a_wrapper_lists_inner_optimizer_and_checkpoints_keep_layout(
    tmp_path,
):
    import keras

    keras_mp = _keras_mp()
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam())
    assert "inner_optimizer" in dir(optimizer)
    assert "_inner_optimizer" not in dir(optimizer)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer, "mean_squared_error")
    model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        weights = archive.read("model.weights.h5")
    paths = []
    with h5py.File(io.BytesIO(weights)) as store:
        store.visit(paths.append)
    assert not [p for p in paths if "inner_optimizer" in p]


@pytest.mark.parametrize(
    "kwargs, written",
    [
        ({"initial_scale": -5}, "initial_scale"),
        ({"dynamic_growth_steps": 0}, "dynamic_growth_steps"),
        ({"dynamic": False, "initial_scale": 0.5}, "initial_scale"),
    ],
)
def test_keras_3_arguments_are_named_as_written_in_errors(kwargs, written):
    import keras

    with pytest.raises(ValueError) as error:
        _lso()(keras.optimizers.Adam(), **kwargs)
    message = str(error.value)
    assert written in message
    for internal in (
        "initial_loss_scale",
        "increment_period",
        "loss_scale_value",
    ):
        assert internal not in message


def test_policy_with_a_config_of_another_class_expects_a_loss_scale_config():
    with pytest.raises(ValueError, match="Expected a loss scale config"):
        _keras_mp().Policy(
            "mixed_float16", loss_scale={"class_name": "Adam", "config": {}}
        )


def test_lookahead_slow_step_size_of_the_wrong_type_is_a_type_error():
    import keras

    with pytest.raises(TypeError, match="slow_step_size"):
        _keras_mp().optimizers.Lookahead(
            keras.optimizers.SGD(), slow_step_size="0.5"
        )


def test_transform_with_a_misspelt_argument_lists_the_valid_ones():
    with pytest.raises(ValueError, match="clip_value") as error:
        _keras_mp().transforms.get(("clip_by_value", {"clip_valu": 1}))
    assert "clip_valu'" in str(error.value)


def test_loading_without_keras_mp_says_to_import_it(tmp_path):
    import keras

    keras_mp = _keras_mp()
    policy = keras_mp.Policy("p=f32,c=bf16,o=f32", loss_scale=8)
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, dtype=policy)]
    )
    path = str(tmp_path / "model.keras")
    model.save(path)
    out = run_python(
        f"""
        import sys
        import keras
        try:
            keras.models.load_model({path!r})
        except ValueError as error:
            print("ValueError:", error)
        assert "keras_mp" not in sys.modules, "the child imported keras_mp"
        """,
        env={"KERAS_BACKEND": keras.backend.backend()},
        timeout=CHILD_TIMEOUT,
    )
    assert out.startswith("ValueError:"), out
    assert (
        "This model was saved with keras_mp: `import keras_mp` before "
        "loading it." in out
    )
    assert "quantization_mode" not in out

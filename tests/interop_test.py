"""keras_mp among Keras, TensorFlow and JAX: what it must not step on.

Checks that need a runtime not yet initialized, or several tf.distribute
strategies in one process, run in fresh interpreters.
"""

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

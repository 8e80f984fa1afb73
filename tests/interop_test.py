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

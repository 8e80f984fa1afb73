"""Delayed FP8 scaling under replicas (issue 22, item 6): every replica
holds the same FP8 state, equal bit for bit to one device's on the same
global batch, whose largest inputs are all on the second replica.

JAX: `DataParallel` over two host devices (the carrier's gradient is the
global batch's inside `jax.jit`). TensorFlow: `MirroredStrategy` over two
logical CPUs with Keras's own Adam, which keeps one replica's overwritten
gradient: each FP8 layer's backward takes its carrier's max over the
replicas first. Each runs in a fresh interpreter (devices are set before
the backend is imported)."""

import json

import numpy as np
import pytest

import keras_mp
from keras_mp.testing import assert_bitwise_equal

_MODEL = """
import json

import keras
import numpy as np

import keras_mp
from keras_mp import fp8
from keras_mp import fp8_layers

rng = np.random.default_rng(0)
x = rng.normal(size=(32, 64)).astype("float32")
x[16:] *= 100  # the second replica's half holds the largest inputs
y = rng.normal(size=(32, 4)).astype("float32")
RECIPE = fp8.Recipe(scaling="delayed", amax_history=4)


def build_and_train():
    keras_mp.set_global_policy("mixed_bfloat16", fp8=RECIPE)
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(64, name="up")(inputs)
        model = keras.Model(
            inputs, keras.layers.Dense(4, name="out")(hidden)
        )
        model.compile(keras.optimizers.Adam(1e-3), "mse")
        for _ in range(4):
            model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        return model
    finally:
        keras_mp.set_global_policy(None)


def state(model):
    return {
        name: keras.ops.convert_to_numpy(v).tolist()
        for name, v in fp8_layers.delayed_state(model.get_layer("up")).items()
    }
"""

_JAX = (
    """
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
"""
    + _MODEL
    + """
devices = keras.distribution.list_devices("cpu")
assert len(devices) == 2, devices
one = state(build_and_train())
keras.distribution.set_distribution(
    keras.distribution.DataParallel(devices=devices)
)
model = build_and_train()
two = state(model)
history = fp8_layers.delayed_state(model.get_layer("up"))["fp8_amax_history"]
shards = [np.asarray(s.data).tolist() for s in history.value.addressable_shards]
keras.distribution.set_distribution(None)
print("RESULT " + json.dumps({"one": one, "two": two, "copies": shards}))
"""
)

_TENSORFLOW = (
    """
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)
"""
    + _MODEL
    + """
with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
    one = state(build_and_train())
with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
    model = build_and_train()
two = state(model)
history = fp8_layers.delayed_state(model.get_layer("up"))["fp8_amax_history"]
value = history.value
copies = [c.numpy().tolist() for c in getattr(value, "values", (value,))]
print("RESULT " + json.dumps({"one": one, "two": two, "copies": copies}))
"""
)


def _result(code, backend):
    out = keras_mp.testing.run_python(code, env={"KERAS_BACKEND": backend})
    line = [row for row in out.splitlines() if row.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def _check(result):
    one, two = result["one"], result["two"]
    assert set(one) == {"fp8_amax_history", "fp8_steps", "fp8_scale"}
    for name in one:
        assert_bitwise_equal(
            np.asarray(two[name], "float32"), np.asarray(one[name], "float32")
        )
    assert one["fp8_steps"] == 3  # the 4th step's amaxes wait in the carrier
    history = np.asarray(one["fp8_amax_history"], "float32")
    # The input's amax is 100x a standard normal's: in [2**8, 2**9).
    assert 2.0**8 <= history[0, 0] < 2.0**9
    assert len(result["copies"]) == 2
    for copy in result["copies"]:
        assert_bitwise_equal(np.asarray(copy, "float32"), history)


@pytest.mark.backends("jax")
@pytest.mark.slow
def test_data_parallel_replicas_hold_one_devices_delayed_state():
    _check(_result(_JAX, "jax"))


@pytest.mark.backends("tensorflow")
@pytest.mark.slow
def test_mirrored_replicas_hold_one_devices_delayed_state():
    _check(_result(_TENSORFLOW, "tensorflow"))

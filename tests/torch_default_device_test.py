"""PyTorch: keras_mp makes every tensor on its inputs' device.

A tensor made without `device=` lands on torch's default device, the CPU:
on a GPU the step then mixes devices and fails ("Expected all tensors to
be on the same device"), which a CPU-only suite never sees. Here the
default device is `meta` while the model's tensors are on the CPU, so any
tensor made without a device meets a CPU tensor and raises. On an H100,
`state_dtype="bfloat16"` failed so (its stochastic-rounding keys and
scratch buffers were made on the default device).
"""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.backend import fp8 as backend_fp8

pytestmark = pytest.mark.backends("torch")


def _steps_on_meta_default(model, optimizer):
    import torch

    x = np.random.default_rng(0).random((32, 64), dtype="float32")
    model.build((None, 64))
    model.compile(optimizer, "mse")
    optimizer.build(model.trainable_variables)
    with torch.device("meta"):
        # The first step builds what the update caches (buffers, layouts).
        for _ in range(2):
            logs = model.train_on_batch(x, x, return_dict=True)
    assert np.isfinite(logs["loss"])


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.layers.Dense(128), keras.layers.Dense(64)])


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float16", "float8"])
def test_low_precision_state_makes_no_tensor_on_the_default_device(
    state_dtype,
):
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(1e-3), state_dtype=state_dtype
    )
    _steps_on_meta_default(_model(), optimizer)


@pytest.mark.parametrize(
    "recipe",
    [
        {},
        {"scaling": "delayed"},
        {"granularity": "rowwise"},
    ],
    ids=["current", "delayed", "rowwise"],
)
def test_fp8_step_makes_no_tensor_on_the_default_device(recipe, monkeypatch):
    # The FP8 codes and `_scaled_mm` path a GPU takes.
    monkeypatch.setattr(backend_fp8, "SCALED_MM_ON_CPU", True)
    keras_mp.set_global_policy(
        "mixed_bfloat16", fp8=keras_mp.fp8.Recipe(**recipe)
    )
    try:
        model = _model()
    finally:
        keras_mp.set_global_policy(None)
    _steps_on_meta_default(
        model, keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    )

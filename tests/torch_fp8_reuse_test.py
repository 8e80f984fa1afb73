"""A PyTorch FP8 layer's kernel codes follow every update of its kernel.

`backend/torch/versions.reuse` computes a kernel's FP8 codes once per
optimizer step, keyed on the kernel tensor's version counter. Two writes in
torch 2.13 bump no counter: `torch._fused_adamw_` (the step of
`LossScaleOptimizer(skip_on_device=True)` with Keras's Adam), and every
`torch._foreach_*` in-place operation under a `TorchDispatchMode` (Keras's
own Adam, inside `FlopCounterMode`). Before the fix both trained on with the
codes of the initial kernel, silently: every step's forward differed from
the one computed afresh (by up to 14 in the model's outputs below).
"""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import to_numpy

pytestmark = pytest.mark.backends("torch")


def _model():
    keras.utils.set_random_seed(0)
    with keras_mp.policy_scope("mixed_bfloat16", fp8=True):
        return keras.Sequential(
            [
                keras.Input((32,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(32),
                keras.layers.Dense(4, dtype="float32"),
            ]
        )


def _data():
    x = np.random.default_rng(0).normal(size=(16, 32)).astype("float32")
    return x, np.ones((16, 4), "float32")


def _forget_codes(model):
    for layer in model.layers:
        tensor = layer.kernel.value
        owner = tensor if tensor._base is None else tensor._base
        if hasattr(owner, "_keras_mp_fp8_operands"):
            del owner._keras_mp_fp8_operands


def _assert_forward_uses_current_kernels(model, x):
    cached = to_numpy(model(x[:4]))
    _forget_codes(model)
    assert_bitwise_equal(cached, to_numpy(model(x[:4])))


def test_fused_adamw_steps_requantize_the_kernels(monkeypatch):
    from keras_mp.backend.torch import fused_adam

    calls = []
    update = fused_adam.update
    monkeypatch.setattr(
        fused_adam,
        "update",
        lambda *args, **kwargs: calls.append(1) or update(*args, **kwargs),
    )
    model = _model()
    model.compile(
        keras_mp.LossScaleOptimizer(
            keras.optimizers.Adam(0.1), skip_on_device=True
        ),
        loss="mse",
    )
    x, y = _data()
    for _ in range(3):
        model.train_on_batch(x, y)
        _assert_forward_uses_current_kernels(model, x)
    assert len(calls) == 3  # torch's fused AdamW made every update


def test_training_inside_a_dispatch_mode_matches_training_outside_it():
    from torch.utils.flop_counter import FlopCounterMode

    x, y = _data()
    weights = []
    for mode in (None, FlopCounterMode(display=False)):
        model = _model()
        model.compile(keras.optimizers.Adam(0.1), loss="mse")
        model.train_on_batch(x, y)
        if mode is None:
            for _ in range(3):
                model.train_on_batch(x, y)
        else:
            with mode:
                for _ in range(3):
                    model.train_on_batch(x, y)
        _assert_forward_uses_current_kernels(model, x)
        weights.append([to_numpy(w) for w in model.weights])
    for plain, counted in zip(*weights):
        assert_bitwise_equal(plain, counted)


def _held_code_bytes(model):
    import torch

    held = 0
    for variable in model.trainable_variables:
        tensor = variable.value
        owner = tensor if tensor._base is None else tensor._base
        cache = getattr(owner, "_keras_mp_fp8_operands", None)
        stack = list(cache[1].values()) if cache else []
        while stack:
            value = stack.pop()
            if isinstance(value, (tuple, list)):
                stack.extend(value)
            elif isinstance(value, torch.Tensor):
                held += value.nbytes
    return held


@pytest.mark.parametrize("skip_on_device", [False, True])
def test_no_stale_kernel_codes_are_held_between_steps(
    monkeypatch, skip_on_device
):
    """Issue 46: the codes of a kernel the optimizer has written are not
    kept to the next step (2 bytes a parameter on a GPU, row- and
    column-major, as much as a bfloat16 copy); 262,152 bytes were held for
    these two 256x256 kernels before."""
    from keras_mp.backend import fp8 as backend_fp8

    monkeypatch.setattr(backend_fp8, "SCALED_MM_ON_CPU", True)  # GPU codes
    keras.utils.set_random_seed(0)
    with keras_mp.policy_scope("mixed_bfloat16", fp8=True):
        model = keras.Sequential(
            [
                keras.Input((256,)),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(256),
                keras.layers.Dense(4, dtype="float32"),
            ]
        )
    optimizer = keras.optimizers.Adam(1e-3)
    if skip_on_device:
        optimizer = keras_mp.LossScaleOptimizer(optimizer, skip_on_device=True)
    model.compile(optimizer, loss="mse")
    x = np.random.default_rng(0).normal(size=(16, 256)).astype("float32")
    y = np.zeros((16, 4), "float32")
    for _ in range(2):
        model.train_on_batch(x, y)
        assert _held_code_bytes(model) == 0
    # A forward after the step computes them again, for its own calls.
    model(x[:4])
    assert _held_code_bytes(model) > 0

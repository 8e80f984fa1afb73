"""Custom training steps from `examples/` train exactly as `fit` does.

Each example overrides `train_step` (TensorFlow: `optimizer.minimize` with
a tape; JAX: `scale_loss` under a StatelessScope, then `stateless_apply`;
PyTorch: `scale_loss(loss).backward()`, then `apply` under `no_grad`).
Trained on the same data from the same initial weights as a plain
`keras.Model` under `fit`, it must reach the same weights, loss scale,
applied steps and skipped steps, including through overflowing steps.
"""

import importlib.util
import pathlib

import pytest

import keras_mp
from keras_mp.testing import assert_close
from keras_mp.testing import to_numpy

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load_example(name):
    spec = importlib.util.spec_from_file_location(
        f"keras_mp_example_{name}", EXAMPLES / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _data(example):
    x, y = example.load_data()
    x, y = x[:256], y[:256]
    # Inputs this large overflow float16 gradients at the initial scale of
    # 2**15: the first steps are skipped and the scale halves until they fit.
    x[:64] *= 1000.0
    return x, y


def _train_custom_and_plain(example_name, monkeypatch):
    example = _load_example(example_name)
    traced = []
    custom_train_step = example.CustomTrainStepModel.train_step

    def spied_train_step(self, *args):
        traced.append(type(self))
        return custom_train_step(self, *args)

    # Guards against comparing `fit` with itself.
    monkeypatch.setattr(
        example.CustomTrainStepModel, "train_step", spied_train_step
    )
    keras_mp.set_global_policy(example.POLICY)
    x, y = _data(example)
    models = {}
    for custom in (True, False):
        model = example.build_model(custom_train_step=custom)
        example.train(model, x, y, epochs=2, batch_size=64, shuffle=False)
        models[custom] = model
    assert traced and set(traced) == {example.CustomTrainStepModel}
    return models[True], models[False]


def _assert_same_training(custom, plain):
    assert type(custom.optimizer) is keras_mp.LossScaleOptimizer
    assert type(plain).__name__ == "Functional"
    skipped = int(to_numpy(custom.optimizer.skipped_steps))
    assert skipped > 0
    assert skipped == int(to_numpy(plain.optimizer.skipped_steps))
    assert int(to_numpy(custom.optimizer.iterations)) == 8 - skipped
    assert int(to_numpy(plain.optimizer.iterations)) == 8 - skipped
    assert float(to_numpy(custom.optimizer.loss_scale())) == float(
        to_numpy(plain.optimizer.loss_scale())
    )
    # Tolerance 1e-5 (float32's): both steps run the same float16 ops in the
    # same order and agree bit for bit on CPU, but each is its own compiled
    # program, and another compiler version or device may fuse and round
    # differently (a one-ulp float16 change in an activation shifts an Adam
    # update of lr 1e-3 by about 1e-6). A missed or doubled unscale, or a
    # step wrongly applied or skipped, moves weights by ~1e-3 or more.
    for custom_weight, plain_weight in zip(custom.weights, plain.weights):
        assert_close(custom_weight, plain_weight, msg=custom_weight.path)


@pytest.mark.backends("tensorflow")
def test_tensorflow_minimize_train_step_trains_as_fit_does(monkeypatch):
    custom, plain = _train_custom_and_plain(
        "custom_train_step_tensorflow", monkeypatch
    )
    _assert_same_training(custom, plain)


@pytest.mark.backends("jax")
def test_jax_stateless_train_step_trains_as_fit_does(monkeypatch):
    custom, plain = _train_custom_and_plain(
        "custom_train_step_jax", monkeypatch
    )
    _assert_same_training(custom, plain)


@pytest.mark.backends("torch")
def test_torch_backward_train_step_trains_as_fit_does(monkeypatch):
    custom, plain = _train_custom_and_plain(
        "custom_train_step_torch", monkeypatch
    )
    _assert_same_training(custom, plain)

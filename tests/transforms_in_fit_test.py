"""Gradient transforms inside wrappers: fit, stateless steps, save and load."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import to_numpy


def _data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype(
        "float32"
    )
    return x, y


def _model():
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )


def _chain():
    return [
        ("clip_by_global_norm", {"max_norm": 0.5}),
        keras_mp.transforms.GaussianNoise(stddev=1e-3, seed=11),
        keras_mp.transforms.AdaptiveClipByGlobalNorm(multiplier=3.0, decay=0.9),
    ]


def _optimizer():
    return keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        loss_scale=keras_mp.DynamicLossScale(256.0, 4),
        transform_gradients=_chain(),
    )


def _fit(model, epochs=1):
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)


def test_transform_chain_saves_reloads_and_continues_identically(tmp_path):
    keras.utils.set_random_seed(0)
    model = _model()
    model.compile(_optimizer(), "mse")
    _fit(model)
    path = str(tmp_path / "chain.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    transforms = restored.optimizer.transforms.transforms
    assert [type(t).__name__ for t in transforms] == [
        "ClipByGlobalNorm",
        "GaussianNoise",
        "AdaptiveClipByGlobalNorm",
    ]
    for a, b in zip(model.optimizer.variables, restored.optimizer.variables):
        assert_bitwise_equal(b, a, msg=a.path)
    _fit(model)
    _fit(restored)
    for a, b in zip(model.weights, restored.weights):
        assert_bitwise_equal(b, a, msg=a.path)


def test_transform_state_advances_in_fit_on_every_backend():
    model = _model()
    optimizer = _optimizer()
    model.compile(optimizer, "mse")
    _fit(model)
    state = optimizer.get_state()
    seeds = [v for k, v in state.items() if "seed" in k]
    assert seeds and not np.array_equal(seeds[0], [11, 0])
    norms = [v for k, v in state.items() if "adaptive" in k]
    assert norms and np.all(np.asarray(norms[0]) > 0)


def test_set_state_rolls_back_whole_on_a_mismatch():
    model = _model()
    optimizer = _optimizer()
    model.compile(optimizer, "mse")
    _fit(model)
    before = optimizer.get_state()
    bad = {key: np.zeros_like(value) for key, value in before.items()}
    last = sorted(bad)[-1]
    bad[last] = np.zeros((3, 3), before[last].dtype)
    with pytest.raises(ValueError, match="shape"):
        optimizer.set_state(bad)
    after = optimizer.get_state()
    for key in before:
        assert_bitwise_equal(after[key], before[key], msg=key)
    good = {key: np.zeros_like(value) for key, value in before.items()}
    optimizer.set_state(good)
    for key, value in optimizer.get_state().items():
        assert_bitwise_equal(value, good[key], msg=key)


def test_skipped_step_leaves_transform_state_untouched():
    optimizer = _optimizer()
    variables = [keras.Variable(np.ones((2,), "float32"))]
    optimizer.build(variables)
    optimizer.apply([keras.ops.ones((2,))], variables)
    before = optimizer.get_state()
    optimizer.apply([keras.ops.array([np.nan, 1.0])], variables)
    assert int(to_numpy(optimizer.skipped_steps)) == 1
    for key, value in optimizer.get_state().items():
        assert_bitwise_equal(value, before[key], msg=key)


def test_plain_callables_train_but_refuse_to_serialize():
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.SGD(0.1),
        transform_gradients=[lambda gv: [(g * 0.5, v) for g, v in gv]],
    )
    model = _model()
    model.compile(optimizer, "mse")
    _fit(model)
    with pytest.raises(Exception, match="callable"):
        keras.saving.serialize_keras_object(optimizer)


def test_decoupled_weight_decay_transform_matches_keras_weight_decay():
    def train(optimizer):
        keras.utils.set_random_seed(5)
        model = _model()
        model.compile(optimizer, "mse")
        _fit(model, epochs=2)
        return [to_numpy(w) for w in model.weights]

    keras_way = train(
        keras.optimizers.SGD(0.05, weight_decay=0.1, global_clipnorm=1.0)
    )
    ours = train(
        keras_mp.OptimizerWrapper(
            keras.optimizers.SGD(0.05),
            transform_gradients=[
                ("clip_by_global_norm", {"max_norm": 1.0}),
                ("decoupled_weight_decay", {"weight_decay": 0.1}),
            ],
        )
    )
    for a, b in zip(ours, keras_way):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@keras_mp.transforms.register_transform("running_sum", package="keras_mp_tests")
class RunningSum(keras_mp.transforms.Transform):
    """Per-variable state, to check state keys survive a reload."""

    def build(self, var_list):
        self.sums = [
            self.add_variable_from_reference(v, "sum") for v in var_list
        ]

    def call(self, grads_and_vars):
        for total, (grad, _) in zip(self.sums, grads_and_vars):
            total.assign(total + grad)
        return grads_and_vars


def test_per_variable_state_of_a_model_sets_its_reloaded_copy(tmp_path):
    model = _model()
    model.compile(
        keras_mp.OptimizerWrapper(
            keras.optimizers.SGD(0.1), transform_gradients=["running_sum"]
        ),
        "mse",
    )
    _fit(model)
    path = str(tmp_path / "sums.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    state = model.optimizer.get_state()
    restored.optimizer.set_state(state)
    for key, value in restored.optimizer.get_state().items():
        assert_bitwise_equal(value, state[key], msg=key)

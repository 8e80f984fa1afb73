"""Optimizer state precision and precision rules on the paths users walk:
checkpoints, skipped steps, custom training steps, notebooks, Keras's own
policy API and threads."""

import threading
import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_mp
from keras_mp import policy as policy_module
from keras_mp.precision import global_policy as global_policy_module
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import to_numpy

BACKEND = keras.backend.backend()
RNG = np.random.default_rng(0)
X = RNG.normal(size=(12, 3)).astype("float32")
Y = RNG.normal(size=(12, 2)).astype("float32")
# Varying parts of a LossScaleOptimizer that an overflow changes on purpose.
_LOSS_SCALE_STATE = ("loss_scale", "num_good_steps", "skipped_steps")


def _model(master_weights, hidden=4, seed=0):
    """A tiny model and its LossScaleOptimizer with bfloat16 Adam state:
    float32 variables with stochastic rounding, or bfloat16 variables
    (created under a bfloat16 policy) with float32 master weights."""
    keras.utils.set_random_seed(seed)
    policy = keras_mp.Policy("bfloat16" if master_weights else "float32")
    with warnings.catch_warnings():
        # The bfloat16 policy's advice is master_weights, used here.
        warnings.simplefilter("ignore", UserWarning)
        with keras_mp.policy_scope(policy):
            model = keras.Sequential(
                [
                    keras.Input((3,)),
                    keras.layers.Dense(hidden),
                    keras.layers.Dense(2),
                ]
            )
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        state_dtype="bfloat16",
        master_weights=master_weights,
    )
    model.compile(optimizer, "mse")
    return model


def _state(model):
    """Every model and optimizer variable as `(path, float32 numpy)`, in
    order (two models built alike have the same order, not the same names).
    """
    return [
        (
            v.path,
            to_numpy(ops.cast(v.value, "float32"))
            if keras.backend.is_float_dtype(v.dtype)
            else to_numpy(v.value),
        )
        for v in model.weights + model.optimizer.variables
    ]


def _assert_same_state(actual, expected, skip=()):
    assert len(actual) == len(expected)
    for (_, value), (path, reference) in zip(actual, expected):
        if not any(name in path for name in skip):
            assert_bitwise_equal(value, reference)


def _fit(model, x=X, y=Y):
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)


def _paths_with(model, text):
    return [v.path for v in model.optimizer.variables if text in v.path]


# ------------------------------------------------------------- checkpoints
@pytest.mark.parametrize(
    "how, master_weights",
    [
        ("save_weights", False),
        ("save_weights", True),
        ("checkpoint_weights", True),
        ("checkpoint_keras", False),
        ("checkpoint_keras", True),
    ],
)
def test_resuming_from_a_checkpoint_continues_bit_identically(
    tmp_path, how, master_weights
):
    original = _model(master_weights)
    if how == "save_weights":
        path = str(tmp_path / "state.weights.h5")
        _fit(original)
        original.save_weights(path)
    else:
        suffix = "weights.h5" if how == "checkpoint_weights" else "keras"
        path = str(tmp_path / f"state.{suffix}")
        checkpoint = keras.callbacks.ModelCheckpoint(
            path, save_weights_only=how == "checkpoint_weights"
        )
        original.fit(
            X, Y, batch_size=4, epochs=1, verbose=0, shuffle=False,
            callbacks=[checkpoint],
        )  # fmt: skip
    saved = _state(original)
    assert _paths_with(original, "seed_generator_state")
    assert bool(_paths_with(original, "_master")) == master_weights
    # Another seed: nothing of the fresh model's own state may survive.
    if how == "checkpoint_keras":
        keras.utils.set_random_seed(99)
        resumed = keras.saving.load_model(path)
        _assert_same_state(_state(resumed), saved)
    else:
        resumed = _model(master_weights, seed=99)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            resumed.load_weights(path)
    _fit(original)
    _fit(resumed)
    _assert_same_state(_state(resumed), _state(original))


def test_failed_load_into_a_trained_model_leaves_optimizer_state_intact(
    tmp_path,
):
    master_weights = True
    other = _model(master_weights, hidden=5)
    _fit(other)
    path = str(tmp_path / "other.weights.h5")
    other.save_weights(path)
    model = _model(master_weights)
    _fit(model)
    before = _state(model)
    with pytest.raises(ValueError, match="could not be loaded"):
        model.load_weights(path)
    after = _state(model)
    optimizer_paths = {v.path for v in model.optimizer.variables}
    for (path_, old), (_, new) in zip(before, after):
        # Keras itself loads the layers whose shapes match (the output
        # layer's bias); the optimizer's state is loaded all or nothing.
        if path_ in optimizer_paths or "/kernel" in path_:
            assert_bitwise_equal(new, old)
    _fit(model)


def test_failed_load_into_a_fresh_model_does_not_break_its_first_step(
    tmp_path,
):
    other = _model(False, hidden=5)
    _fit(other)
    path = str(tmp_path / "other.weights.h5")
    other.save_weights(path)
    model = _model(False)
    with pytest.raises(ValueError, match="could not be loaded"):
        model.load_weights(path)
    # The optimizer was not built: its part of the failed checkpoint was
    # held for `build`, where it does not fit. It starts fresh instead of
    # failing the first training step.
    with pytest.warns(UserWarning, match="Skipping the optimizer state"):
        model.optimizer.build(model.trainable_variables)
    assert int(to_numpy(model.optimizer.iterations)) == 0
    for variable in model.optimizer.inner_optimizer.variables:
        if "momentum" in variable.path or "velocity" in variable.path:
            assert not np.any(to_numpy(ops.cast(variable, "float32")))
    _fit(model)
    assert int(to_numpy(model.optimizer.iterations)) == 3


# ------------------------------------------------------------ skipped steps
@pytest.mark.parametrize("master_weights", [False, True])
def test_overflow_in_fit_is_skipped_bit_for_bit_and_then_forgotten(
    master_weights,
):
    poisoned = X.copy()
    poisoned[4:8] = np.inf
    # The run that overflows: batches 1, 2 (inf) and 3.
    model = _model(master_weights)
    _fit(model, poisoned[:8], Y[:8])
    assert int(to_numpy(model.optimizer.skipped_steps)) == 1
    # The run that never saw the overflow: batches 1 and 3.
    clean = _model(master_weights)
    _fit(clean, X[:4], Y[:4])
    assert _paths_with(clean, "seed_generator_state")
    assert bool(_paths_with(clean, "_master")) == master_weights
    _assert_same_state(_state(model), _state(clean), skip=_LOSS_SCALE_STATE)
    _fit(model, X[8:], Y[8:])
    _fit(clean, X[8:], Y[8:])
    _assert_same_state(_state(model), _state(clean), skip=_LOSS_SCALE_STATE)


# --------------------------------------------------------- custom train_step
def _custom_train_step_class():
    """A Sequential with the `train_step` of Keras's "customizing fit"
    guide for this backend, which never calls `scale_loss`."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        class Custom(keras.Sequential):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = self.compute_loss(y=y, y_pred=y_pred)
                grads = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply(grads, self.trainable_variables)
                return {"loss": loss}

    elif BACKEND == "jax":
        import jax

        class Custom(keras.Sequential):
            def compute_loss_and_updates(
                self, trainable, non_trainable, x, y, training=False
            ):
                y_pred, non_trainable = self.stateless_call(
                    trainable, non_trainable, x, training=training
                )
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
                return loss, (y_pred, non_trainable)

            def train_step(self, state, data):
                trainable, non_trainable, optimizer_vars, metrics_vars = state
                x, y = data
                grad_fn = jax.value_and_grad(
                    self.compute_loss_and_updates, has_aux=True
                )
                (loss, (_, non_trainable)), grads = grad_fn(
                    trainable, non_trainable, x, y, training=True
                )
                trainable, optimizer_vars = self.optimizer.stateless_apply(
                    optimizer_vars, grads, trainable
                )
                state = (trainable, non_trainable, optimizer_vars, metrics_vars)
                return {"loss": loss}, state

    else:
        import torch

        class Custom(keras.Sequential):
            def train_step(self, data):
                x, y = data
                self.zero_grad()
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
                loss.backward()
                trainable = self.trainable_weights
                grads = [v.value.grad for v in trainable]
                with torch.no_grad():
                    self.optimizer.apply(grads, trainable)
                return {"loss": loss}

    return Custom


@pytest.mark.parametrize("kind", ["loss_scale", "master_weights"])
def test_custom_train_step_matches_fit(kind):
    def build(cls):
        keras.utils.set_random_seed(0)
        policy = "bfloat16" if kind == "master_weights" else "float32"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            with keras_mp.policy_scope(keras_mp.Policy(policy)):
                model = cls(
                    [
                        keras.Input((3,)),
                        keras.layers.Dense(4),
                        keras.layers.Dense(2),
                    ]
                )
        wrapper = (
            keras_mp.LossScaleOptimizer
            if kind == "loss_scale"
            else keras_mp.OptimizerWrapper
        )
        optimizer = wrapper(
            keras.optimizers.Adam(0.01),
            state_dtype="bfloat16",
            master_weights=kind == "master_weights",
        )
        model.compile(optimizer, "mse")
        return model

    fitted = build(keras.Sequential)
    custom = build(_custom_train_step_class())
    for model in (fitted, custom):
        with warnings.catch_warnings():
            # The custom step's loss is not scaled (the guide's code).
            warnings.filterwarnings("ignore", "LossScaleOptimizer .* did not")
            model.fit(X, Y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    assert int(to_numpy(custom.optimizer.iterations)) == 6
    assert {str(v.dtype) for v in fitted.trainable_variables} == {
        "bfloat16" if kind == "master_weights" else "float32"
    }
    _assert_same_state(_state(custom), _state(fitted))


# --------------------------------------------------- notebooks and policies
def _functional(name, softmax=True):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name=f"{name}_hidden")(inputs)
    outputs = keras.layers.Dense(3, name=f"{name}_logits")(hidden)
    if softmax:
        outputs = keras.layers.Softmax(name=f"{name}_probs")(outputs)
    return keras.Model(inputs, outputs, name=name)


def _assert_explained_as_built(model, rule):
    """explain_precision's rows are the layers' real dtypes, and every layer
    but those named in `rule` has the reason `rule[None]`."""
    rows = keras_mp.explain_precision(model, print_fn=None)
    layers = {model.name: model}
    layers.update({layer.name: layer for layer in model.layers})
    for row in rows:
        layer = layers[row["layer"]]
        policy = policy_module.layer_policy(layer)
        assert row["variable_dtype"] == policy.variable_dtype
        assert row["compute_dtype"] == layer.compute_dtype
        if not isinstance(layer, keras.Model):
            for weight in layer.weights:
                assert str(weight.dtype) == row["variable_dtype"]
        assert row["rule"] == rule.get(row["layer"], rule[None]), row
    return {row["layer"]: row for row in rows}


@pytest.mark.parametrize(
    "set_float32",
    [
        lambda: keras_mp.set_global_policy("float32"),
        lambda: keras.mixed_precision.set_global_policy("float32"),
        lambda: keras_mp.set_global_policy(None),
    ],
    ids=["keras_mp", "keras", "none"],
)
def test_second_notebook_model_after_float32_gets_no_islands(set_float32):
    keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
    first = _functional("first")
    set_float32()
    second = _functional("second")
    rows = _assert_explained_as_built(
        first,
        {
            None: "global policy",
            "first_probs": "DEFAULT_FLOAT32_ISLANDS: Softmax -> float32",
        },
    )
    assert rows["first_hidden"]["compute_dtype"] == "bfloat16"
    assert rows["first_probs"]["compute_dtype"] == "float32"
    # Created without a dtype argument, under the float32 global policy:
    # not "dtype argument", which this layer never had.
    rows = _assert_explained_as_built(second, {None: "global policy"})
    assert {row["compute_dtype"] for row in rows.values()} == {"float32"}
    for layer in second.layers:
        assert not hasattr(layer, "_keras_mp_islands")
    x = np.ones((2, 4), "float32")
    for output in (first(x), second.get_layer("second_hidden")(x)):
        assert keras.backend.standardize_dtype(output.dtype) == "float32"


def test_keras_set_global_policy_turns_the_islands_off_as_documented():
    keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    assert global_policy_module._settings.float32_islands is None
    assert keras.layers.Softmax().compute_dtype == "bfloat16"
    assert "turn the float32 islands off" in " ".join(
        keras_mp.set_global_policy.__doc__.split()
    )


def _policy_map(**entries):
    policy_map = keras.dtype_policies.DTypePolicyMap("mixed_bfloat16")
    for path, policy in entries.items():
        policy_map[path] = keras.DTypePolicy(policy)
    return policy_map


def test_island_rule_over_a_policy_map_entry_wins_and_warns():
    keras_mp.set_global_policy(
        _policy_map(net_logits="bfloat16"), float32_islands="default"
    )
    with pytest.warns(UserWarning, match="'net_logits' has an entry .* wins"):
        model = _functional("net", softmax=False)
    logits = model.get_layer("net_logits")
    # The map made its weights; the rule gives compute and output dtypes.
    assert logits.kernel.dtype == "bfloat16"
    assert logits.compute_dtype == "float32"
    _assert_explained_as_built(
        model,
        {
            None: "global policy",
            "net_logits": "DEFAULT_FLOAT32_ISLANDS: model outputs -> float32",
        },
    )


def test_rule_giving_none_keeps_the_policy_map_entry_without_a_warning():
    rules = keras_mp.precision_rules(
        {"net_probs": None}, base="default", name="mine"
    )
    keras_mp.set_global_policy(
        _policy_map(net_probs="bfloat16", net_hidden="float32"),
        float32_islands=rules,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = _functional("net")
    assert model.get_layer("net_hidden").compute_dtype == "float32"
    assert model.get_layer("net_probs").compute_dtype == "bfloat16"
    assert model.get_layer("net_logits").compute_dtype == "bfloat16"
    with pytest.warns(UserWarning, match="'net_probs' has an entry .* wins"):
        keras_mp.set_global_policy(
            _policy_map(net_probs="bfloat16"), float32_islands="default"
        )
        model = _functional("net")
    assert model.get_layer("net_probs").compute_dtype == "float32"


# ------------------------------------------------------------------ threads
def _train_in_thread(policy, seed, results, start):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with keras_mp.policy_scope(policy):
            init = keras.initializers.GlorotUniform
            model = keras.Sequential(
                [
                    keras.Input((3,)),
                    keras.layers.Dense(4, kernel_initializer=init(seed)),
                    keras.layers.Dense(2, kernel_initializer=init(seed + 1)),
                ]
            )
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        state_dtype="bfloat16",
        master_weights=policy == "bfloat16",
    )
    model.compile(optimizer, "mse")
    optimizer.build(model.trainable_variables)
    (seed_state,) = [
        v for v in optimizer.variables if "seed_generator_state" in v.path
    ]
    seed_state.assign(np.array([seed, 0], "int32"))
    if start is not None:
        start.wait()
    _fit(model)
    results[policy] = (
        [str(v.dtype) for v in model.weights],
        [to_numpy(ops.cast(v.value, "float32")) for v in optimizer.variables],
        [to_numpy(ops.cast(v.value, "float32")) for v in model.weights],
    )


def test_two_threads_training_under_their_own_policy_scopes_stay_apart():
    policies = {"mixed_bfloat16": 1, "bfloat16": 2}
    alone = {}
    for policy, seed in policies.items():
        _train_in_thread(policy, seed, alone, None)
    together, errors = {}, []
    start = threading.Barrier(len(policies))

    def target(policy, seed):
        try:
            _train_in_thread(policy, seed, together, start)
        except BaseException as error:  # reported in the main thread
            errors.append(error)
            start.abort()

    threads = [
        threading.Thread(target=target, args=item) for item in policies.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert together["mixed_bfloat16"][0] == ["float32"] * 4
    assert together["bfloat16"][0] == ["bfloat16"] * 4
    for policy in policies:
        for a, b in zip(together[policy][1] + together[policy][2],
                        alone[policy][1] + alone[policy][2]):  # fmt: skip
            assert_bitwise_equal(a, b)
    # Neither thread's scope reached the process-global policy.
    assert keras_mp.global_policy().name == "float32"


def test_worker_thread_layers_follow_the_main_threads_policy_and_islands():
    keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
    models, errors = [], []

    def build():
        try:
            models.append(_functional("worker"))
        except BaseException as error:  # reported in the main thread
            errors.append(error)

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    assert not errors, errors
    (model,) = models
    assert model.get_layer("worker_hidden").compute_dtype == "bfloat16"
    assert model.get_layer("worker_probs").compute_dtype == "float32"
    _assert_explained_as_built(
        model,
        {
            None: "global policy",
            "worker_probs": "DEFAULT_FLOAT32_ISLANDS: Softmax -> float32",
        },
    )

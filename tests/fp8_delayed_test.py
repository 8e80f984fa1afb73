"""Delayed FP8 scaling (issue 22, item 1): each scale from a window of earlier
steps' amaxes, as Transformer Engine's `DelayedScaling` (power-of-two
scales), with state that is not trainable, free of the loss scale, the max
over repeated calls, and left alone by a skipped step."""

import itertools

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import fp8
from keras_mp import fp8_layers
from keras_mp._fp8 import delayed
from keras_mp._fp8 import stats as fp8_stats
from keras_mp.testing import branched_fp8_model
from keras_mp.testing import fp8_reference as reference
from keras_mp.testing import to_numpy

BATCH = 16
FEATURES = 32
UNITS = 16
TE_RECIPES = [
    fp8.Recipe(scaling="delayed", amax_history=h, amax_algo=algo, margin=margin)
    for h, algo, margin in itertools.product(
        (1, 16, 1024), ("max", "most_recent"), (0, 1)
    )
]


def _state(layer):
    return {
        name: to_numpy(v) for name, v in fp8_layers.delayed_state(layer).items()
    }


def _carrier(layer):
    return to_numpy(fp8_stats.layer_carrier(layer))


def _te_scales(history, recipe):
    """Transformer Engine's delayed-scaling formula with power-of-two
    scales: the amax of the window (`max`) or its newest entry."""
    formats = ("e4m3", "e4m3", recipe.backward_format)
    amax = history.max(axis=1) if recipe.amax_algo == "max" else history[:, 0]
    return np.array(
        [reference.scale(a, f, recipe.margin) for a, f in zip(amax, formats)],
        np.float32,
    )


def _linear_loss(y_true, y_pred):
    # d loss / d y_pred = y_true / BATCH exactly: the output gradient of
    # every layer is known to NumPy.
    return keras.ops.sum(y_true * keras.ops.cast(y_pred, "float32"), axis=-1)


def _parallel_model(recipes, compute="float32", seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    outputs = [
        keras.layers.Dense(
            UNITS,
            use_bias=False,
            dtype=keras_mp.Policy(compute, fp8=recipe),
            name=f"dense_{i}",
        )(inputs)
        for i, recipe in enumerate(recipes)
    ]
    out = (
        outputs[0] if len(outputs) == 1 else keras.layers.Concatenate()(outputs)
    )
    return keras.Model(inputs, out)


def _step_data(step, layers, rng):
    magnitude = 2.0 ** rng.integers(-6, 7)
    x = (rng.normal(size=(BATCH, FEATURES)) * magnitude).astype(np.float32)
    g_magnitude = 2.0 ** rng.integers(-8, 8, size=layers)
    c = rng.normal(size=(BATCH, layers, UNITS)) * g_magnitude[None, :, None]
    return x, c.reshape(BATCH, layers * UNITS).astype(np.float32)


def test_fifty_steps_match_transformer_engines_formula_bit_for_bit():
    """12 Dense layers side by side, one per amax_history in {1, 16, 1024},
    amax_algo and margin in {0, 1}: after every step, each layer's history
    and the scales its GEMMs used equal a NumPy simulation of TE's delayed
    scaling from the step's true amaxes (the input, the kernel read from
    the model, the output gradient `y / BATCH`)."""
    model = _parallel_model(TE_RECIPES)
    model.compile(keras.optimizers.SGD(0.05), loss=_linear_loss)
    layers = [model.get_layer(f"dense_{i}") for i in range(len(TE_RECIPES))]
    histories = [np.zeros((3, r.amax_history), np.float32) for r in TE_RECIPES]
    rng = np.random.default_rng(7)
    for step in range(50):
        x, c = _step_data(step, len(layers), rng)
        kernels = [np.abs(to_numpy(layer.kernel)).max() for layer in layers]
        model.train_on_batch(x, c)
        for i, (layer, recipe) in enumerate(zip(layers, TE_RECIPES)):
            state = _state(layer)
            expected = (
                np.zeros(3, np.float32)
                if step == 0
                else _te_scales(histories[i], recipe)
            )
            np.testing.assert_array_equal(
                state["fp8_scale"], expected, err_msg=f"{recipe} step {step}"
            )
            np.testing.assert_array_equal(
                state["fp8_amax_history"], histories[i], err_msg=str(recipe)
            )
            assert state["fp8_steps"] == step
            amaxes = reference.history_value(
                np.array(
                    [
                        np.abs(x).max(),
                        kernels[i],
                        np.abs(c[:, i * UNITS : (i + 1) * UNITS]).max() / BATCH,
                    ],
                    np.float32,
                )
            )
            histories[i] = np.concatenate(
                [amaxes[:, None], histories[i][:, :-1]], axis=1
            )


def test_the_first_step_runs_current_scaling_never_scale_one():
    """Keras's float8 runs its first steps at scale 1.0; a delayed layer's
    first step equals the current recipe's bit for bit."""
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(BATCH, FEATURES)) * 1e-3).astype(np.float32)
    outputs = []
    for recipe in (fp8.Recipe(scaling="delayed"), fp8.Recipe()):
        model = _parallel_model([recipe], seed=1)
        outputs.append(to_numpy(model(x)))
    np.testing.assert_array_equal(outputs[0], outputs[1])
    assert np.count_nonzero(outputs[0]) == outputs[0].size


def _fit_steps(model, x, c, steps):
    for _ in range(steps):
        model.train_on_batch(x, c)


def test_a_layer_called_twice_records_the_max_not_the_sum():
    """Keras's float8 sums the "gradients" of its amax history over the
    calls of a step: a scale 4x too large for a layer called twice."""
    keras.utils.set_random_seed(2)
    recipe = fp8.Recipe(scaling="delayed", amax_history=4)
    layer = keras.layers.Dense(
        FEATURES,
        use_bias=False,
        dtype=keras_mp.Policy("float32", fp8=recipe),
        name="twice",
    )
    inputs = keras.Input((FEATURES,))
    model = keras.Model(inputs, layer(layer(inputs)))
    model.compile(keras.optimizers.SGD(0.0), loss=_linear_loss)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    c = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    _fit_steps(model, x, c, 2)
    w = to_numpy(layer.kernel)
    hidden = x @ w  # only its bin matters
    history = _state(layer)["fp8_amax_history"]
    expected_input = reference.history_value(
        max(np.abs(x).max(), np.abs(hidden).max())
    )
    assert history[0, 0] == expected_input
    assert history[1, 0] == reference.history_value(np.abs(w).max())
    assert _state(layer)["fp8_steps"] == 1


def test_the_output_gradient_history_is_free_of_the_loss_scale():
    """Under mixed_float16, Keras's float8 stores the output gradient's amax
    multiplied by the loss scale. Here a loss scale of 1 and of 2**12 give
    the same history and scales, bit for bit."""
    recipe = fp8.Recipe(scaling="delayed", amax_history=8)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    c = rng.normal(size=(BATCH, UNITS)).astype(np.float32)
    states = []
    for scale in (1.0, 2.0**12):
        model = _parallel_model([recipe], compute="float16", seed=3)
        optimizer = keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(0.01),
            loss_scale=keras_mp.FixedLossScale(scale),
        )
        model.compile(optimizer, loss=_linear_loss)
        _fit_steps(model, x, c, 4)
        states.append(_state(model.get_layer("dense_0")))
        assert _carrier(model.get_layer("dense_0"))[0, delayed.LOSS_SCALE] == (
            scale
        )
    for name in states[0]:
        np.testing.assert_array_equal(states[0][name], states[1][name], name)
    # The output gradient's amax is that of y / BATCH, not loss-scaled.
    history = states[1]["fp8_amax_history"]
    assert history[2, 0] <= 2 * np.abs(c).max() / BATCH


def _effective_state(layer):
    """The history and step count the next call quantizes with (the
    carrier folded in, as the next call does), as NumPy."""
    state = fp8_layers.delayed_state(layer)
    history, steps = delayed.fold(
        keras.ops.convert_to_tensor(_state(layer)["fp8_amax_history"]),
        keras.ops.convert_to_tensor(_state(layer)["fp8_steps"]),
        keras.ops.convert_to_tensor(_carrier(layer)),
    )
    assert state
    return to_numpy(history), to_numpy(steps)


def test_a_skipped_step_changes_no_state_the_next_step_uses():
    """An inf in one layer's output gradient skips the step: the weights,
    the carrier's statistics and the history the next call folds are
    bit-identical, and no inf reaches a history."""
    recipe = fp8.Recipe(scaling="delayed", amax_history=8)
    model = _parallel_model([recipe, recipe], compute="float16", seed=4)
    model.compile(
        keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.01)),
        loss=_linear_loss,
    )
    rng = np.random.default_rng(6)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    c = rng.normal(size=(BATCH, 2 * UNITS)).astype(np.float32)
    _fit_steps(model, x, c, 3)
    layers = [model.get_layer("dense_0"), model.get_layer("dense_1")]
    before = [_effective_state(layer) for layer in layers]
    carriers = [_carrier(layer) for layer in layers]
    weights = [to_numpy(w) for w in model.trainable_weights]
    bad = c.copy()
    bad[0, UNITS] = np.inf  # dense_1's output gradient only
    model.train_on_batch(x, bad)
    assert int(to_numpy(model.optimizer.skipped_steps)) == 1
    for layer, (history, steps), carrier in zip(layers, before, carriers):
        after_history, after_steps = _effective_state(layer)
        np.testing.assert_array_equal(after_history, history)
        assert after_steps == steps
        np.testing.assert_array_equal(
            _carrier(layer)[:, : delayed.LOSS_SCALE],
            carrier[:, : delayed.LOSS_SCALE],
        )
    for w, previous in zip(model.trainable_weights, weights):
        if not fp8_stats.is_carrier(w):
            np.testing.assert_array_equal(to_numpy(w), previous)
    _fit_steps(model, x, c, 2)
    for layer in layers:
        assert np.isfinite(_state(layer)["fp8_amax_history"]).all()


def test_the_state_is_not_trainable():
    """Keras's float8 counts 3 x 1024 + 3 state values per layer as
    trainable parameters; the delayed state here is non-trainable."""
    model = _parallel_model([fp8.Recipe(scaling="delayed")])
    layer = model.get_layer("dense_0")
    trainable = {v.path for v in model.trainable_weights}
    state = fp8_layers.delayed_state(layer)
    assert set(state) == {"fp8_amax_history", "fp8_steps", "fp8_scale"}
    assert not trainable & {v.path for v in state.values()}
    assert state["fp8_amax_history"].shape == (3, 1024)


def test_resume_from_a_checkpoint_equals_uninterrupted_training(tmp_path):
    """20 steps equal 10 steps, save_weights, load into a fresh model, 10
    steps: weights, optimizer slots and FP8 state bit-identical."""
    recipe = fp8.Recipe(scaling="delayed", amax_history=4)
    rng = np.random.default_rng(8)
    batches = [_step_data(i, 1, rng) for i in range(20)]

    def fresh():
        model = _parallel_model([recipe], compute="bfloat16", seed=5)
        model.compile(keras.optimizers.Adam(1e-3), loss=_linear_loss)
        model.optimizer.build(model.trainable_variables)
        return model

    straight = fresh()
    for x, c in batches:
        straight.train_on_batch(x, c)
    first = fresh()
    for x, c in batches[:10]:
        first.train_on_batch(x, c)
    path = str(tmp_path / "half.weights.h5")
    first.save_weights(path)
    second = fresh()
    second.load_weights(path)
    for x, c in batches[10:]:
        second.train_on_batch(x, c)
    for a, b in zip(straight.weights, second.weights):
        assert a.path == b.path
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b), a.path)
    for a, b in zip(straight.optimizer.variables, second.optimizer.variables):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b), a.path)


def test_a_shorter_history_loads_its_newest_entries(tmp_path):
    rng = np.random.default_rng(9)
    long = _parallel_model([fp8.Recipe(scaling="delayed", amax_history=8)])
    long.compile(keras.optimizers.SGD(0.01), loss=_linear_loss)
    for i in range(5):
        long.train_on_batch(*_step_data(i, 1, rng))
    path = str(tmp_path / "long.weights.h5")
    long.save_weights(path)
    short = _parallel_model([fp8.Recipe(scaling="delayed", amax_history=2)])
    caught = _load_warnings(short, path)
    assert len(caught) == 1 and "dense_0 (8 -> 2)" in caught[0]
    saved = _state(long.get_layer("dense_0"))["fp8_amax_history"]
    np.testing.assert_array_equal(
        _state(short.get_layer("dense_0"))["fp8_amax_history"], saved[:, :2]
    )


def _trained(recipes, rng, steps=3):
    model = _parallel_model(recipes, seed=6)
    model.compile(keras.optimizers.SGD(0.01), loss=_linear_loss)
    for i in range(steps):
        model.train_on_batch(*_step_data(i, len(recipes), rng))
    return model


def _load_warnings(model, path):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_weights(path)
    return [str(w.message) for w in caught if "FP8" in str(w.message)]


def test_a_checkpoint_without_delayed_state_seeds_it_with_one_warning(
    tmp_path,
):
    rng = np.random.default_rng(10)
    plain = _trained([fp8.Recipe(), fp8.Recipe()], rng)
    path = str(tmp_path / "current.weights.h5")
    plain.save_weights(path)
    recipe = fp8.Recipe(scaling="delayed", amax_history=4)
    model = _parallel_model([recipe, recipe], seed=7)
    caught = _load_warnings(model, path)
    assert len(caught) == 1
    assert "2 layer(s) have delayed FP8 scaling" in caught[0]
    assert "dense_0" in caught[0] and "dense_1" in caught[0]
    for got, want in zip(model.get_weights(), plain.get_weights()):
        if got.shape == want.shape and got.ndim == 2 and got.shape[0] > 3:
            np.testing.assert_array_equal(got, want)
    layer = model.get_layer("dense_0")
    assert _state(layer)["fp8_steps"] == 0
    # The first step after the load runs current scaling, then seeds.
    model.compile(keras.optimizers.SGD(0.01), loss=_linear_loss)
    model.train_on_batch(*_step_data(0, 2, rng))
    assert not _state(layer)["fp8_scale"].any()
    model.train_on_batch(*_step_data(1, 2, rng))
    assert _state(layer)["fp8_steps"] == 1
    assert _state(layer)["fp8_scale"].all()


def test_a_delayed_checkpoint_loads_without_delayed_state_with_one_warning(
    tmp_path,
):
    rng = np.random.default_rng(11)
    recipe = fp8.Recipe(scaling="delayed", amax_history=4)
    model = _trained([recipe, recipe], rng)
    path = str(tmp_path / "delayed.weights.h5")
    model.save_weights(path)
    plain = _parallel_model([fp8.Recipe(), fp8.Recipe()], seed=8)
    caught = _load_warnings(plain, path)
    assert len(caught) == 1 and "ignored the file's state" in caught[0]
    for i in range(2):
        np.testing.assert_array_equal(
            to_numpy(plain.get_layer(f"dense_{i}").kernel),
            to_numpy(model.get_layer(f"dense_{i}").kernel),
        )
    # And into the same model without FP8 (Keras's float8 checkpoint
    # cannot load there: K6).
    keras.utils.set_random_seed(16)
    inputs = keras.Input((FEATURES,))
    plain = keras.Model(
        inputs,
        keras.layers.Concatenate()(
            [
                keras.layers.Dense(UNITS, use_bias=False, name=f"dense_{i}")(
                    inputs
                )
                for i in range(2)
            ]
        ),
    )
    caught = _load_warnings(plain, path)
    assert len(caught) == 1 and "ignored the file's state" in caught[0]
    assert len(plain.weights) == 2
    for i in range(2):
        np.testing.assert_array_equal(
            to_numpy(plain.get_layer(f"dense_{i}").kernel),
            to_numpy(model.get_layer(f"dense_{i}").kernel),
        )
    # The same checkpoint into the same recipes loads silently.
    same = _parallel_model([recipe, recipe], seed=9)
    assert _load_warnings(same, path) == []


def test_a_keras_reload_keeps_the_weight_order_and_the_state(tmp_path):
    """Keras's float8 model reorders its weights after a `.keras` reload;
    a delayed keras_mp model keeps the order, and `set_weights(
    get_weights())` works both ways between fresh and reloaded."""
    rng = np.random.default_rng(12)
    recipe = fp8.Recipe(scaling="delayed", amax_history=4)
    model = _trained([recipe], rng)
    path = str(tmp_path / "delayed.keras")
    model.save(path)
    reloaded = keras.models.load_model(path, compile=False)
    assert [w.path for w in reloaded.weights] == [w.path for w in model.weights]
    for got, want in zip(reloaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)
    fresh = _parallel_model([recipe], seed=13)
    fresh.set_weights(reloaded.get_weights())
    reloaded.set_weights(fresh.get_weights())
    x = _step_data(0, 1, rng)[0]
    np.testing.assert_array_equal(to_numpy(reloaded(x)), to_numpy(model(x)))


def test_a_frozen_delayed_layer_runs_current_scaling():
    """Keras's frozen float8 layer never calibrates (scale 1.0, 1e-3-sized
    inputs flush to zero). A frozen delayed layer gets no carrier gradient
    and keeps running current scaling: its output is the current recipe's,
    bit for bit, after training."""
    x = np.random.default_rng(14).normal(size=(BATCH, FEATURES)) * 1e-3
    x = x.astype(np.float32)
    outputs = []
    for recipe in (fp8.Recipe(scaling="delayed"), fp8.Recipe()):
        model = _parallel_model([recipe], seed=15)
        model.get_layer("dense_0").trainable = False
        # Nothing is trainable: the skipping wrapper `compile` gives an
        # FP8 model steps it as plain SGD would (nothing to update).
        model.compile(keras.optimizers.SGD(0.01), loss=_linear_loss)
        for _ in range(3):
            model.train_on_batch(x, np.ones((BATCH, UNITS), np.float32))
        outputs.append(to_numpy(model.predict_on_batch(x)))
    np.testing.assert_array_equal(outputs[0], outputs[1])
    assert np.count_nonzero(outputs[0]) == outputs[0].size


_RESUME = """
import os
import sys

import keras
import numpy as np

import keras_mp
from keras_mp import fp8
from keras_mp._fp8 import stats as fp8_stats

sys.path.insert(0, os.path.join(os.path.dirname(keras_mp.__path__[0]), "tests"))
from fp8_delayed_test import _linear_loss, _parallel_model, _step_data

recipe = fp8.Recipe(scaling="delayed", amax_history=4)
rng = np.random.default_rng(8)
batches = [_step_data(i, 1, rng) for i in range(20)]
path = sys.argv[1]
if sys.argv[2] == "first":
    model = _parallel_model([recipe], compute="bfloat16", seed=5)
    model.compile(keras.optimizers.Adam(1e-3), loss=_linear_loss)
    for x, c in batches[:10]:
        model.train_on_batch(x, c)
    model.save(path)
else:
    model = keras.models.load_model(
        path, custom_objects={"_linear_loss": _linear_loss}
    )
    for x, c in batches[10:]:
        model.train_on_batch(x, c)
    np.savez(
        path + ".npz",
        *[keras.ops.convert_to_numpy(v) for v in model.weights],
        *[keras.ops.convert_to_numpy(v) for v in model.optimizer.variables],
    )
"""


@pytest.mark.slow
def test_resume_in_a_fresh_process_equals_uninterrupted_training(tmp_path):
    """10 steps, `model.save`, `load_model` in a fresh process, 10 steps:
    weights, optimizer slots and FP8 state as 20 steps in one go."""
    recipe = fp8.Recipe(scaling="delayed", amax_history=4)
    rng = np.random.default_rng(8)
    batches = [_step_data(i, 1, rng) for i in range(20)]
    straight = _parallel_model([recipe], compute="bfloat16", seed=5)
    straight.compile(keras.optimizers.Adam(1e-3), loss=_linear_loss)
    for x, c in batches:
        straight.train_on_batch(x, c)
    path = str(tmp_path / "half.keras")
    script = tmp_path / "resume.py"
    script.write_text(_RESUME)
    for part in ("first", "second"):
        keras_mp.testing.run_script(str(script), path, part)
    saved = np.load(path + ".npz")
    expected = [
        *[to_numpy(v) for v in straight.weights],
        *[to_numpy(v) for v in straight.optimizer.variables],
    ]
    assert len(saved.files) == len(expected)
    for i, want in enumerate(expected):
        got = saved[f"arr_{i}"]  # bfloat16 comes back as 2-byte voids
        assert got.shape == want.shape
        assert got.tobytes() == want.tobytes(), i
    assert any("fp8_amax_history" in w.path for w in straight.weights)


def test_explain_precision_shows_the_history():
    model = _parallel_model(
        [
            fp8.Recipe(
                scaling="delayed", amax_history=16, amax_algo="most_recent"
            )
        ]
    )
    rows = keras_mp.explain_precision(model, print_fn=None)
    row = next(r for r in rows if r["layer"].endswith("dense_0"))
    assert row["fp8"] == "delayed/tensorwise/hybrid history=16 most_recent"


def test_under_keras_loss_scale_optimizer_the_history_stays_loss_scaled():
    """Keras's own LossScaleOptimizer divides every gradient by its scale
    (the carrier's too, which keeps its bins) and writes no loss scale
    into the carrier: the output gradient's history is in loss-scaled
    units, as Keras's float8 keeps it, and the GEMMs stay consistent."""
    recipe = fp8.Recipe(scaling="delayed", amax_history=8)
    rng = np.random.default_rng(17)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    c = rng.normal(size=(BATCH, UNITS)).astype(np.float32)
    histories = []
    for optimizer in (
        keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(0.0), loss_scale=keras_mp.FixedLossScale(1)
        ),
        keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.0), initial_scale=2.0**10
        ),
    ):
        model = _parallel_model([recipe], compute="float16", seed=18)
        model.compile(optimizer, loss=_linear_loss)
        _fit_steps(model, x, c, 3)
        layer = model.get_layer("dense_0")
        histories.append(_state(layer)["fp8_amax_history"])
        assert _carrier(layer)[0, delayed.LOSS_SCALE] in (0.0, 1.0)
    free, scaled = histories
    np.testing.assert_array_equal(scaled[:2], free[:2])
    np.testing.assert_array_equal(scaled[2], free[2] * 2.0**10)


def _torch_delayed_run(recipes, torch_ops, monkeypatch):
    """Every variable after eight `fit` steps of delayed layers (one called
    twice) under a dynamic loss scale, one step's output gradient inf (a
    skip), the model's weights set back to their start before the sixth,
    with PyTorch's own ops for the delayed bookkeeping or with
    `keras.ops`."""
    from keras_mp.backend.torch import ops as backend_torch_ops

    monkeypatch.setattr(backend_torch_ops, "BIT_OPS", torch_ops)
    keras.utils.set_random_seed(7)
    model = branched_fp8_model(
        recipes, "float16", use_bias=False, features=FEATURES, units=UNITS
    )
    model.compile(
        keras_mp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-3),
            keras_mp.DynamicLossScale(
                initial_loss_scale=2.0**10, increment_period=2
            ),
        ),
        loss=_linear_loss,
    )
    rng = np.random.default_rng(8)
    initial = model.get_weights()
    for step in range(8):
        x, c = _step_data(step, len(recipes) - 1, rng)
        if step == 3:
            c[0, 0] = np.inf
        if step == 5:
            # Every layer's state back to its start (counts 0, carriers
            # stale): the next steps take current scales again. PyTorch's
            # host must see the count written (`fp8_layers/state.py`).
            model.set_weights(initial)
        model.train_on_batch(x, c)
    assert int(to_numpy(model.optimizer.skipped_steps)) >= 1
    return {v.path: to_numpy(v) for v in model.variables}


@pytest.mark.backends("torch")
def test_torchs_own_delayed_bookkeeping_gives_the_bits_of_keras_ops(
    monkeypatch,
):
    """On PyTorch the fold, the scales, the carrier's gradient and the
    loss scale written into it run in torch's own operations (an eager
    step's `keras.ops` calls cost host time each): every weight, history,
    count, scale and carrier of a run is bit-identical to the
    `keras.ops` run's, through repeated calls, a skipped step, a dynamic
    loss scale, both amax algorithms, statistics with counts, and the
    state set back to its start (what the host knows of a layer's folds
    must follow the count)."""
    from keras_mp.backend.torch import delayed as torch_delayed

    recipes = [
        fp8.Recipe(scaling="delayed", amax_history=4),
        fp8.Recipe(scaling="delayed", amax_history=3, amax_algo="most_recent"),
        fp8.Recipe(scaling="delayed", amax_history=5, stats=True, margin=1),
    ]
    calls = []
    names = (
        "fold_and_scaling",
        "carrier_gradient_of_amaxes",
        "write_loss_scale",
        "select",
    )
    for name in names:
        own = getattr(torch_delayed, name)

        def counting(*args, own=own, name=name):
            # `select` with `first` a Python False: the host knew the
            # layer had folded, and no current scale was made.
            known = name == "select" and args[0] is False
            calls.append("select_known" if known else name)
            return own(*args)

        monkeypatch.setattr(torch_delayed, name, counting)
    fast = _torch_delayed_run(recipes, True, monkeypatch)
    assert {*names, "select_known"} <= set(calls)
    calls.clear()
    generic = _torch_delayed_run(recipes, False, monkeypatch)
    assert not calls
    assert fast.keys() == generic.keys()
    for path, value in fast.items():
        np.testing.assert_array_equal(
            np.atleast_1d(value).view(np.uint8),
            np.atleast_1d(generic[path]).view(np.uint8),
            path,
        )

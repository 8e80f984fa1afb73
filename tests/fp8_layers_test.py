"""FP8 GEMMs in Keras's Dense and EinsumDense (keras_mp.fp8_layers): the
routing to `fp8.dot` / `fp8.einsum`, training with `fit`, checkpoints that
resume exactly, and a skipped step under loss scaling."""

import importlib
import json

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import fp8
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import run_python
from keras_mp.testing import to_numpy


def _rng():
    return np.random.default_rng(0)


def _mlp():
    x = keras.Input((32,))
    h = keras.layers.Dense(64, activation="relu", name="up")(x)
    h = keras.layers.Dense(32, activation="relu", name="mid")(h)
    return keras.Model(x, keras.layers.Dense(4, name="logits")(h))


def _attention_model():
    x = keras.Input((8, 32))
    h = keras.layers.MultiHeadAttention(2, 16, name="mha")(x, x)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(x, keras.layers.Dense(4, name="logits")(h))


def _regression_data(shape):
    rng = _rng()
    x = rng.normal(size=(16, *shape)).astype("float32")
    w = rng.normal(size=(int(np.prod(shape)), 4)).astype("float32")
    y = (x.reshape(16, -1) @ w / np.sqrt(w.shape[0])).astype("float32")
    return x, y


def _stored(variable):
    with keras_mp.enable_autocast(None):
        return keras.ops.copy(variable)


class TestRouting:
    def test_dense_computes_its_gemm_with_fp8_dot(self):
        recipe = fp8.Recipe(granularity="rowwise")
        policy = keras_mp.Policy("mixed_bfloat16", fp8=recipe)
        layer = keras.layers.Dense(32, activation="relu", dtype=policy)
        x = _rng().normal(size=(4, 64)).astype("float32")
        out = layer(x)
        assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
        x16 = keras.ops.cast(x, "bfloat16")
        gemm = fp8.dot(
            x16,
            _stored(layer.kernel),
            recipe=recipe,
            output_dtype="bfloat16",
        )
        bias = keras.ops.cast(layer.bias, "bfloat16")
        expected = keras.ops.relu(keras.ops.add(gemm, bias))
        assert_bitwise_equal(to_numpy(out), to_numpy(expected))
        plain = keras.layers.Dense(32, activation="relu", dtype=policy.name)
        plain.build((None, 64))
        plain.set_weights(layer.get_weights())
        # FP8 rounding shows: the routing really ran.
        assert not np.array_equal(to_numpy(plain(x)), to_numpy(out))

    def test_einsum_dense_computes_its_gemm_with_fp8_einsum(self):
        policy = keras_mp.Policy("float32", fp8=True)
        layer = keras.layers.EinsumDense(
            "abc,cde->abde", (8, 2, 16), bias_axes="de", dtype=policy
        )
        x = _rng().normal(size=(2, 8, 32)).astype("float32")
        out = layer(x)
        expected = fp8.einsum(
            "abc,cde->abde",
            keras.ops.convert_to_tensor(x),
            _stored(layer.kernel),
            recipe=fp8.DEFAULT_RECIPE,
            output_dtype="float32",
        )
        expected = keras.ops.add(expected, layer.bias)
        assert_bitwise_equal(to_numpy(out), to_numpy(expected))

    def test_the_kernel_gradient_reaches_the_float32_kernel(self):
        policy = keras_mp.Policy("mixed_bfloat16", fp8=True)
        model = keras.Sequential(
            [keras.Input((32,)), keras.layers.Dense(16, dtype=policy)]
        )
        model.compile(keras.optimizers.SGD(0.1), loss="mse")
        before = to_numpy(model.layers[0].kernel)
        x, y = _rng().normal(size=(2, 8, 32)).astype("float32")
        model.train_on_batch(x, y[:, :16])
        after = to_numpy(model.layers[0].kernel)
        assert after.dtype == np.float32
        assert np.isfinite(after).all() and not np.array_equal(before, after)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_fit_trains_under_the_global_fp8_rules(kind, jit_compile):
    # The steps users run: tf.function with and without XLA; JAX's jit
    # (without it Keras runs the step op by op, a debugging mode); torch's
    # eager step (torch.compile of a step takes a minute on a 2-core CPU).
    backend = keras.backend.backend()
    if (backend == "jax" and not jit_compile) or (
        backend == "torch" and jit_compile
    ):
        pytest.skip(f"jit_compile={jit_compile} is not {backend}'s fit step")
    keras_mp.set_global_policy("mixed_bfloat16", fp8=True)
    keras.utils.set_random_seed(0)
    model = _mlp() if kind == "mlp" else _attention_model()
    fp8_layers = [
        row["layer"]
        for row in keras_mp.explain_precision(model, print_fn=None)
        if "/" in row["fp8"]
    ]
    assert len(fp8_layers) == (2 if kind == "mlp" else 4)
    x, y = _regression_data(model.inputs[0].shape[1:])
    model.compile(
        keras.optimizers.Adam(3e-2), loss="mse", jit_compile=jit_compile
    )
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    losses = history.history["loss"]
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.8 * losses[0], losses


class TestCheckpoints:
    def _trained(self, steps):
        keras_mp.set_global_policy("mixed_bfloat16", fp8=True)
        keras.utils.set_random_seed(0)
        model = _mlp()
        model.compile(keras.optimizers.Adam(1e-2), loss="mse")
        self._train(model, 0, steps)
        return model

    def _train(self, model, start, stop):
        x, y = _regression_data((32,))
        for step in range(start, stop):
            batch = slice(8 * (step % 2), 8 * (step % 2) + 8)
            model.train_on_batch(x[batch], y[batch])

    def test_keras_file_reloads_the_recipes_and_resumes_exactly(self, tmp_path):
        straight = self._trained(4)
        model = self._trained(2)
        paths = [w.path for w in model.weights]
        path = str(tmp_path / "model.keras")
        model.save(path)
        keras_mp.set_global_policy(None)
        restored = keras.models.load_model(path)
        assert [w.path for w in restored.weights] == paths
        assert restored.get_layer("up").dtype_policy.fp8 == fp8.DEFAULT_RECIPE
        x = _regression_data((32,))[0]
        assert_bitwise_equal(
            to_numpy(restored.predict(x, verbose=0)),
            to_numpy(model.predict(x, verbose=0)),
        )
        self._train(restored, 2, 4)
        for got, want in zip(
            restored.get_weights(), straight.get_weights(), strict=True
        ):
            assert_bitwise_equal(got, want)

    def test_weights_file_and_set_weights_between_fresh_and_reloaded(
        self, tmp_path
    ):
        model = self._trained(2)
        path = str(tmp_path / "model.weights.h5")
        model.save_weights(path)
        fresh = self._trained(0)
        fresh.load_weights(path)
        x = _regression_data((32,))[0]
        assert_bitwise_equal(
            to_numpy(fresh.predict(x, verbose=0)),
            to_numpy(model.predict(x, verbose=0)),
        )
        keras_path = str(tmp_path / "model.keras")
        model.save(keras_path)
        restored = keras.models.load_model(keras_path)
        fresh.set_weights(restored.get_weights())
        restored.set_weights(fresh.get_weights())

    @pytest.mark.slow
    def test_a_fresh_process_reloads_and_predicts_the_same(self, tmp_path):
        model = self._trained(2)
        path = str(tmp_path / "model.keras")
        model.save(path)
        x = _regression_data((32,))[0]
        np.save(tmp_path / "x.npy", x)
        output = run_python(
            f"""
            import json
            import keras
            import numpy as np
            import keras_mp

            model = keras.models.load_model({path!r})
            x = np.load({str(tmp_path / "x.npy")!r})
            rows = keras_mp.explain_precision(model, print_fn=None)
            print("RESULT " + json.dumps({{
                "prediction": np.asarray(
                    model.predict(x, verbose=0), "float32"
                ).tolist(),
                "fp8": {{row["layer"]: row["fp8"] for row in rows}},
            }}))
            """
        )
        result = json.loads(output.split("RESULT ")[-1])
        assert result["fp8"]["up"] == "current/tensorwise/hybrid"
        assert_bitwise_equal(
            np.asarray(result["prediction"], "float32"),
            np.asarray(to_numpy(model.predict(x, verbose=0)), "float32"),
        )


@pytest.mark.parametrize("overflow", [True, False])
def test_an_inf_in_an_fp8_layer_output_gradient_skips_the_step(overflow):
    """mixed_float16 with a loss scale of 2**15: targets of 1e4 make the
    float16 gradient of the FP8 output layer's output overflow to inf (the
    float32 loss and its gradient stay finite), so the step must be
    skipped and the scale halved, every weight and slot bit-identical."""
    keras_mp.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    policy = keras_mp.Policy("mixed_float16", fp8=True)
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(16, dtype=policy, name="fp8_out"),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-3), loss="mse")
    optimizer = model.optimizer
    assert isinstance(optimizer, keras_mp.LossScaleOptimizer)
    optimizer.build(model.trainable_variables)
    x = _rng().normal(size=(8, 32)).astype("float32")
    y = np.full((8, 16), 1e4 if overflow else 0.1, "float32")
    state = [*model.weights, *optimizer.inner_optimizer.variables]
    before = [to_numpy(v) for v in state]
    model.train_on_batch(x, y)
    if overflow:
        for value, variable in zip(before, state, strict=True):
            assert_bitwise_equal(to_numpy(variable), value, variable.path)
        assert int(to_numpy(optimizer.skipped_steps)) == 1
        assert float(to_numpy(optimizer.loss_scale())) == 2.0**14
    else:
        assert int(to_numpy(optimizer.skipped_steps)) == 0
        assert float(to_numpy(optimizer.loss_scale())) == 2.0**15
        kernel = model.get_layer("fp8_out").kernel
        assert not np.array_equal(to_numpy(kernel), before[2])


def test_keras_float8_quantization_keeps_its_own_path():
    layer = keras.layers.Dense(
        32, dtype=keras_mp.Policy("float32", fp8=True), name="quantized"
    )
    layer.build((None, 64))
    layer.quantize("float8")
    assert layer.quantization_mode == "float8"
    assert keras_mp.policy.layer_policy(layer).quantization_mode == "float8"
    out = to_numpy(layer(_rng().normal(size=(2, 64)).astype("float32")))
    assert out.shape == (2, 32) and np.isfinite(out).all()


@pytest.mark.backends("torch")
@pytest.mark.parametrize("layer_kind", ["dense", "einsum_dense"])
def test_torch_quantizes_each_kernel_once_per_optimizer_step(
    layer_kind, monkeypatch
):
    """Micro-steps of gradient accumulation and repeated calls share the
    kernel's FP8 codes until the optimizer updates it; training gives the
    bits of quantizing the kernel at every call."""
    quantizer_base = importlib.import_module("keras_mp._fp8.quantizers.base")
    from keras_mp.backend.torch import versions as torch_versions

    policy = keras_mp.Policy("float32", fp8=True)
    x = _rng().normal(size=(64, 32)).astype("float32")
    y = x[:, :16] * 0.5

    def train():
        keras.utils.set_random_seed(0)
        if layer_kind == "dense":
            layer = keras.layers.Dense(16, dtype=policy)
        else:
            layer = keras.layers.EinsumDense(
                "ab,bc->ac", 16, bias_axes="c", dtype=policy
            )
        model = keras.Sequential([keras.Input((32,)), layer])
        optimizer = keras.optimizers.SGD(0.01, gradient_accumulation_steps=2)
        model.compile(optimizer, loss="mse")
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return to_numpy(layer.kernel)

    counted = []
    operand = quantizer_base.operand

    def counting(t, *args, **kwargs):
        # Not the output-shape inference of Keras's build, on `meta`.
        if tuple(t.shape) == (32, 16) and t.device.type != "meta":
            counted.append(1)
        return operand(t, *args, **kwargs)

    monkeypatch.setattr(quantizer_base, "operand", counting)
    kernel = train()
    # 4 batches, 2 optimizer updates: the kernel is quantized for the
    # first micro-step and again after each update.
    assert len(counted) == 2, counted
    monkeypatch.setattr(
        torch_versions, "reuse", lambda tensor, key, compute: compute()
    )
    counted.clear()
    fresh = train()
    assert len(counted) == 4
    assert_bitwise_equal(kernel, fresh)

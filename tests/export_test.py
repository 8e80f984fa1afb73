"""`model.export` after training under keras_mp's policies and wrappers
(issue 35): the SavedModel serves what `predict` gives.

TensorFlow and JAX export to a TensorFlow SavedModel (JAX through
jax2tf). On PyTorch, Keras 3.15's `tf_saved_model` export fails inside
`torch.export` (a dynamic-shapes mismatch, with torch 2.13), so no test
runs there. ONNX export on TensorFlow needs `tf2onnx`; without it the test
checks that the export gets past keras_mp's variables to that import.
"""

import importlib.util

import keras
import numpy as np
import pytest

import keras_mp

pytestmark = [
    pytest.mark.backends("tensorflow", "jax"),
    # The CPU has no native float16 or bfloat16: the policy check warns.
    pytest.mark.filterwarnings("ignore:Mixed precision compatibility check"),
]


def _optimizer(case):
    if case == "loss_scale":
        keras_mp.set_global_policy("mixed_float16")
        return "adam"
    if case == "wrapper":
        keras_mp.set_global_policy("mixed_bfloat16")
        return keras_mp.OptimizerWrapper(
            keras.optimizers.Adam(1e-3),
            transform_gradients=["clip_by_global_norm"],
            state_dtype="bfloat16",
        )
    if case == "fp8_current":
        keras_mp.set_global_policy("mixed_bfloat16", fp8=True)
    else:
        keras_mp.set_global_policy(
            "mixed_bfloat16", fp8=keras_mp.fp8.Recipe(scaling="delayed")
        )
    return "adam"


def _trained_model(case):
    optimizer = _optimizer(case)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(16)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(16)(hidden))
    model.compile(optimizer, "mse")
    rng = np.random.default_rng(0)
    x = rng.random((16, 16)).astype("float32")
    y = rng.random((16, 16)).astype("float32")
    model.fit(x, y, batch_size=8, verbose=0)
    if case == "fp8_frozen":
        keras_mp.fp8.freeze(model)
    return model, x


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    ["loss_scale", "wrapper", "fp8_current", "fp8_delayed", "fp8_frozen"],
)
def test_saved_model_serves_what_predict_gives(case, tmp_path):
    import tensorflow as tf

    model, x = _trained_model(case)
    if case == "loss_scale":
        assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    if case.startswith("fp8"):
        rows = keras_mp.explain_precision(model, print_fn=None)
        assert any("/" in row.get("fp8", "") for row in rows)
    path = str(tmp_path / "served")
    model.export(path, format="tf_saved_model", verbose=False)
    expected = model.predict(x, verbose=0)
    # Kept in a name: the served function reads the loaded object's
    # variables, which go with it.
    loaded = tf.saved_model.load(path)
    served = loaded.serve(tf.constant(x)).numpy()
    assert served.dtype == expected.dtype
    np.testing.assert_array_equal(served, expected)


@pytest.mark.backends("tensorflow")
def test_onnx_export_gets_past_the_loss_scale_state(tmp_path):
    model, _ = _trained_model("loss_scale")
    path = str(tmp_path / "model.onnx")
    if importlib.util.find_spec("tf2onnx") is not None:
        model.export(path, format="onnx", verbose=False)
        assert (tmp_path / "model.onnx").stat().st_size > 0
        return
    # Before the fix: "Unable to save the object ListWrapper([<Variable
    # path=loss_scale_optimizer/loss_scale ...". Now only the missing
    # converter stops it.
    with pytest.raises(ImportError, match="onnx"):
        model.export(path, format="onnx", verbose=False)

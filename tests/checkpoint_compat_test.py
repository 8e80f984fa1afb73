"""Checkpoints written by keras_mp 0.3.5 load and train on bit for bit
(issue 47: users resume runs across upgrades).

`tests/fixtures/make_0_3_5_checkpoints.py` wrote, with 0.3.5 and on each
backend, a `.keras` and a `.weights.h5` file of a tiny model per variant
(each optimizer state dtype, master weights, stateful gradient transforms,
loss scaling, each FP8 recipe, each frozen FP8 format), and the reference:
its weights and every optimizer variable after one more training step
that 0.3.5 took right after saving, or, for a frozen model, its
predictions. Here each file is loaded both ways a user would (a `.keras`
file with `load_model`, under no global policy; a `.weights.h5` file into
the model and optimizer rebuilt by the same code, under the same policy,
the optimizer built first), takes that step, and must match bit for bit.

Only keras_mp's public API is used, so the test holds across internal
moves. The fixtures are never regenerated with a newer version.

To run it against another checkout's keras_mp, put that checkout first
and keep Python from putting the current directory before it (`-P`):

    KERAS_BACKEND=jax PYTHONPATH=/path/to/checkout \
        python -P -m pytest tests/checkpoint_compat_test.py
"""

import importlib.util
import json
import pathlib
import warnings

import keras
import ml_dtypes
import numpy as np
import pytest

import keras_mp

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
DIRECTORY = FIXTURES / "checkpoints_0_3_5" / keras.backend.backend()


def _generator():
    """The generator script, for the code that built the models."""
    path = FIXTURES / "make_0_3_5_checkpoints.py"
    spec = importlib.util.spec_from_file_location("make_0_3_5", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generator = _generator()
MANIFEST = json.loads((DIRECTORY / "manifest.json").read_text())
VARIANTS = sorted(MANIFEST["variants"])


def _spec(variant):
    return MANIFEST["variants"][variant]["spec"]


def _dtype(name):
    """A dtype by the name NumPy or ml_dtypes gives it."""
    if hasattr(ml_dtypes, name):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def _reference(reference, prefix):
    """`[(path, array)]` of `prefix` ("weights", "optimizer") in an npz
    written by `generator.packed`."""
    index = json.loads(str(reference[f"{prefix}_index"]))
    arrays = []
    for name, path, dtype, shape in index:
        key = prefix if prefix == "predictions" else f"{prefix}_{name}"
        bits = reference[key]
        array = bits.view(_dtype(dtype)).reshape(shape)
        arrays.append((path, array))
    return arrays


def _actual(values):
    return [
        (path, np.asarray(keras.ops.convert_to_numpy(value)))
        for path, value in values
    ]


def _assert_bits_equal(actual, expected, what, compare_paths=True):
    """Same number of arrays, in the same order, each of the same dtype,
    shape and bits; the paths too where `compare_paths`."""
    actual_paths = [path for path, _ in actual]
    expected_paths = [path for path, _ in expected]
    assert len(actual) == len(expected), (
        f"{what}: {len(actual)} arrays, 0.3.5 had {len(expected)}:\n"
        f"{actual_paths}\n!=\n{expected_paths}"
    )
    if compare_paths:
        assert actual_paths == expected_paths, what
    differ = []
    for (path, a), (expected_path, e) in zip(actual, expected):
        a = np.ascontiguousarray(a)
        name = f"{what} {path} (0.3.5: {expected_path})"
        if a.dtype != e.dtype or a.shape != e.shape:
            differ.append(f"{name}: {a.dtype}{a.shape} != {e.dtype}{e.shape}")
        elif a.tobytes() != e.tobytes():
            mismatched = np.count_nonzero(
                a.reshape(-1).view(f"u{a.itemsize}")
                != e.reshape(-1).view(f"u{e.itemsize}")
            )
            differ.append(f"{name}: {mismatched} of {a.size} values differ")
    assert not differ, "\n".join(differ)


def _rebuilt(variant, x):
    """The variant's model and optimizer built by the code that wrote the
    checkpoint, under its policy (left set for the step), with its
    `.weights.h5` loaded."""
    spec = _spec(variant)
    with warnings.catch_warnings():
        # master_weights's "bfloat16" policy, which it is the cure for.
        warnings.filterwarnings(
            "ignore", "The global policy 'bfloat16'", UserWarning
        )
        generator.set_policy(spec)
    model = generator.build_model(spec)
    generator.compile_model(model, spec)
    if spec["freeze"]:
        keras_mp.fp8.freeze(model, calibration_data=x)
    else:
        model.optimizer.build(model.trainable_variables)
    model.load_weights(DIRECTORY / f"{variant}.weights.h5")
    return model


@pytest.mark.parametrize("saved_as", [".keras", ".weights.h5"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_0_3_5_checkpoint_resumes_bit_for_bit(variant, saved_as):
    spec = _spec(variant)
    reference = np.load(DIRECTORY / f"{variant}.npz")
    x, y = reference["x"], reference["y"]
    if saved_as == ".keras":
        # A frozen model is for inference: its file also holds the state
        # of the optimizer it trained with, whose kernels it no longer has.
        model = keras.saving.load_model(
            DIRECTORY / f"{variant}.keras", compile=not spec["freeze"]
        )
    else:
        model = _rebuilt(variant, x)
    if spec["freeze"]:
        predictions = model.predict_on_batch(x)
        _assert_bits_equal(
            _actual([("predictions", predictions)]),
            _reference(reference, "predictions"),
            "predictions",
        )
    else:
        model.train_on_batch(x, y)
        _assert_bits_equal(
            _actual((v.path, v) for v in model.optimizer.variables),
            _reference(reference, "optimizer"),
            "optimizer variable",
            compare_paths=False,
        )
    _assert_bits_equal(
        _actual((w.path, w) for w in model.weights),
        _reference(reference, "weights"),
        "weight",
    )


def test_the_fixtures_are_0_3_5s_and_complete():
    assert MANIFEST["keras_mp_version"] == "0.3.5"
    assert MANIFEST["backend"] == keras.backend.backend()
    assert set(MANIFEST["variants"]) == set(generator.VARIANTS)
    for variant in VARIANTS:
        for suffix in (".keras", ".weights.h5", ".npz"):
            assert (DIRECTORY / f"{variant}{suffix}").is_file()

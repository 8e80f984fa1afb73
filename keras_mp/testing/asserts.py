"""Comparisons of tensors of any backend: within a dtype's tolerance, bit
for bit, and the NumPy arrays they are read into."""

import numpy as np

_TOLERANCES = {
    "float16": 1e-2,
    "bfloat16": 4e-2,
    "float32": 1e-5,
    "float64": 1e-9,
}


def to_numpy(value):
    """A NumPy array of a tensor or variable of any backend."""
    import keras

    if isinstance(value, keras.Variable):
        value = value.value
    return np.asarray(keras.ops.convert_to_numpy(value))


def tolerance(dtype):
    """Relative and absolute tolerance that fits a dtype's precision."""
    return _TOLERANCES[str(dtype)]


def assert_close(actual, expected, dtype="float32", msg=""):
    """Asserts two numeric structures agree within the dtype's tolerance."""
    tol = tolerance(dtype)
    np.testing.assert_allclose(
        to_numpy(actual).astype("float64"),
        to_numpy(expected).astype("float64"),
        rtol=tol,
        atol=tol,
        err_msg=msg,
    )


def assert_bitwise_equal(actual, expected, msg=""):
    """Asserts two arrays hold identical bits (NaNs included)."""
    a, e = to_numpy(actual), to_numpy(expected)
    assert a.dtype == e.dtype, f"{msg} dtype {a.dtype} != {e.dtype}"
    assert a.shape == e.shape, f"{msg} shape {a.shape} != {e.shape}"
    assert a.tobytes() == e.tobytes(), f"{msg} bits differ:\n{a}\n!=\n{e}"

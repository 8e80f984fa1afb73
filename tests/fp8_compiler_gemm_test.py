"""GEMMs in the form the compiler's FP8 path takes (issue 32, item 3).

- A GEMM whose result is cast to bfloat16 asks for bfloat16 itself (JAX
  `preferred_element_type`; TensorFlow under XLA: operands upcast to
  bfloat16), then multiplies by its power-of-two scales. Proved here first:
  that gives the bits of the float32 result times the scales, rounded to
  bfloat16, for scales across the float32 range.
- Tensorwise scales are multiplied as one factor.
- `fp8.einsum` reaches the GEMM with one contracting dimension.
- TensorFlow without XLA has no FP8 GEMM: it says so once.
"""

import math
import warnings

import keras
import ml_dtypes
import numpy as np
import pytest
from keras import ops

from keras_mp import fp8
from keras_mp.backend import fp8 as fp8_backend
from keras_mp.testing import to_numpy


def _codes(shape, rng, fmt):
    dtype = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
    fmax = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    values = rng.normal(size=shape) * np.exp2(rng.uniform(-6, 8, (1, 1)))
    return np.clip(values, -fmax, fmax).astype(dtype[fmt])


def _operand(codes):
    """What the backend's GEMM multiplies: FP8 codes, or on PyTorch's CPU
    their values in float32."""
    if fp8_backend.rounds_to_values(ops.zeros(())):
        return ops.convert_to_tensor(codes.astype("float32"))
    return ops.cast(ops.convert_to_tensor(codes.astype("float32")), codes.dtype)


def _bits(x):
    return to_numpy(ops.cast(x, "bfloat16")).view("uint16")


def _narrow(a, b):
    """The product as the backend gives it for a bfloat16 result (on
    TensorFlow under XLA, the only place it differs there)."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.function(fp8_backend.einsum_float32, jit_compile=True)(
            "mk,kn->mn", a, b, "bfloat16"
        )
    return fp8_backend.einsum_float32("mk,kn->mn", a, b, "bfloat16")


# Not on PyTorch's CPU: its bfloat16 GEMM of values on the FP8 grid sums in
# another order than its float32 one (1 ulp apart at K = 257).
@pytest.mark.backends("jax", "tensorflow")
@pytest.mark.parametrize("formats", [("e4m3", "e4m3"), ("e5m2", "e4m3")])
def test_a_bfloat16_product_times_a_power_of_two_is_the_rounded_float32_one(
    formats,
):
    rng = np.random.default_rng(0)
    for m, k, n in [(1, 1, 1), (16, 128, 16), (33, 257, 17), (64, 1024, 8)]:
        a = _operand(_codes((m, k), rng, formats[0]))
        b = _operand(_codes((k, n), rng, formats[1]))
        wide = fp8_backend.einsum_float32("mk,kn->mn", a, b)
        narrow = _narrow(a, b)
        assert keras.backend.standardize_dtype(narrow.dtype) == "bfloat16"
        # From the smallest normal float32 scale to near the largest.
        for exponent in range(-126, 100, 7):
            scale = ops.convert_to_tensor(np.float32(2.0**exponent))
            expected = wide * scale
            # Normal results (a subnormal one rounds twice either way).
            normal = np.abs(to_numpy(expected)) >= 2.0**-126
            np.testing.assert_array_equal(
                _bits(ops.cast(narrow, "float32") * scale)[normal],
                _bits(expected)[normal],
                err_msg=exponent,
            )


def test_folding_the_scales_keeps_every_bit():
    """`p * (sx * sw)` is float64's `p * sx * sw` rounded once, for float32
    products `p` of codes and power-of-two scales whose product is a
    float32 number; `(p * sx) * sw`, the unfolded form, gives the same bits
    wherever `p * sx` is a normal float32 number (where it is not, only
    the folded form is right)."""
    rng = np.random.default_rng(1)
    p = (rng.normal(size=4096) * 448.0 * 448.0 * 64).astype("float32")
    tiny = np.finfo("float32").tiny
    for ex in range(-126, 128, 11):
        for ew in range(-126, 128, 13):
            if not -149 <= ex + ew <= 127:
                continue
            sx, sw = np.float32(2.0**ex), np.float32(2.0**ew)
            with np.errstate(over="ignore", under="ignore"):
                folded = p * (sx * sw)
                exact = (p.astype("float64") * 2.0 ** (ex + ew)).astype(
                    "float32"
                )
                partial = p * sx
                unfolded = partial * sw
            np.testing.assert_array_equal(
                folded.view("int32"), exact.view("int32")
            )
            normal = np.isfinite(partial) & (np.abs(partial) >= tiny)
            np.testing.assert_array_equal(
                unfolded[normal].view("int32"), folded[normal].view("int32")
            )


def _jaxpr(function, *args):
    import jax
    import jax.extend.core

    return jax.make_jaxpr(function)(*args).jaxpr


def _equations(jaxpr):
    """Every equation of `jaxpr`, those of its sub-jaxprs included."""
    import jax
    import jax.extend.core

    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            values = value if isinstance(value, (list, tuple)) else [value]
            for sub in values:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _equations(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _equations(sub)


def _users(jaxpr, var):
    return [
        eqn
        for eqn in _equations(jaxpr)
        if any(v is var for v in eqn.invars if hasattr(v, "aval"))
    ]


@pytest.mark.backends("jax")
def test_jax_tensorwise_gemms_return_bfloat16_and_take_one_scale_factor():
    import jax
    import jax.extend.core
    import jax.numpy as jnp

    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(32, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)

    def step(x, w):
        out, vjp = jax.vjp(lambda x, w: fp8.dot(x, w), x, w)
        return out, vjp(out)

    jaxpr = _jaxpr(step, x, w)
    dots = [e for e in _equations(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 3
    # The forward product and the input gradient are bfloat16 (x is);
    # the kernel gradient is float32 (the kernel is).
    outputs = sorted(str(e.params["preferred_element_type"]) for e in dots)
    assert outputs == ["bfloat16", "bfloat16", "float32"], outputs
    for dot in dots:
        (user,) = _users(jaxpr, dot.outvars[0])
        if user.primitive.name == "convert_element_type":
            (user,) = _users(jaxpr, user.outvars[0])
        # One multiply by a scalar factor, and no second one after it.
        assert user.primitive.name == "mul", user
        shapes = [v.aval.shape for v in user.invars]
        assert any(math.prod(shape) == 1 for shape in shapes), shapes
        after = _users(jaxpr, user.outvars[0])
        assert all(e.primitive.name != "mul" for e in after), after


@pytest.mark.backends("jax")
def test_jax_emulated_block_gemms_ask_for_float32():
    """MXFP8's and NVFP4's GEMMs multiply float32 values on a GPU without
    their tensor cores, and cuBLASLt has no float32 GEMM writing bfloat16:
    an MXFP8 step with a bfloat16 output failed so on an H200. Their
    GEMMs ask for float32 (the result cast after), FP8 codes' for
    bfloat16."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(32, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
    expected = {
        "mxfp8": ["float32"] * 3,
        "nvfp4": ["float32"] * 3,
        "tensorwise": ["bfloat16", "bfloat16", "float32"],
    }
    recipes = {
        "mxfp8": fp8.Recipe(formats="mxfp8"),
        "nvfp4": fp8.Recipe(formats="nvfp4"),
        "tensorwise": fp8.Recipe(),
    }
    for name, recipe in recipes.items():

        def step(x, w, recipe=recipe):
            out, vjp = jax.vjp(
                lambda x, w: fp8.dot(x, w, recipe, output_dtype="bfloat16"),
                x,
                w,
            )
            return out, vjp(out)

        dots = [
            e
            for e in _equations(_jaxpr(step, x, w))
            if e.primitive.name == "dot_general"
        ]
        types = sorted(str(e.params["preferred_element_type"]) for e in dots)
        assert types == expected[name], (name, types)


@pytest.mark.backends("jax")
def test_einsum_reaches_the_gemm_with_one_contracting_dimension():
    import jax
    import jax.extend.core
    import jax.numpy as jnp

    x = jnp.ones((2, 3, 4, 16), jnp.float32)
    kernel = jnp.ones((4, 16, 8), jnp.float32)

    def step(x, kernel):
        function = lambda x, k: fp8.einsum("abcd,cde->abe", x, k)  # noqa: E731
        out, vjp = jax.vjp(function, x, kernel)
        return out, vjp(out)

    dots = [
        e
        for e in _equations(_jaxpr(step, x, kernel))
        if e.primitive.name == "dot_general"
    ]
    assert len(dots) == 3
    for dot in dots:
        (contracting, _), (batch, _) = dot.params["dimension_numbers"]
        assert len(contracting) == 1 and not batch, dot.params
        assert all(len(v.aval.shape) == 2 for v in dot.invars)


@pytest.mark.backends("tensorflow")
def test_tensorflow_under_xla_upcasts_the_codes_to_bfloat16():
    import tensorflow as tf

    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(size=(32, 64)), tf.bfloat16)
    w = tf.constant(rng.normal(size=(64, 16)), tf.float32)

    def step(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            out = fp8.dot(x, w)
        return out, tape.gradient(out, [x, w], output_gradients=out)

    hlo = tf.function(step, jit_compile=True).experimental_get_compiler_ir(
        x, w
    )(stage="hlo")
    # GemmRewriter's pattern: dot(convert(f8), convert(f8)), in the
    # compute dtype where the result is cast to it.
    bf16_dots = [
        line
        for line in hlo.splitlines()
        if " dot(" in line and line.split("=")[1].strip().startswith("bf16")
    ]
    assert len(bf16_dots) == 2, hlo
    assert "bf16" in hlo and "convert(f8e4m3fn" in hlo.replace(" ", "")
    # Outside XLA the codes stay float32 (oneDNN's bfloat16 matmul does
    # not round its float32 sum once), and every result stays the same.
    eager = step(x, w)
    compiled = tf.function(step, jit_compile=True)(x, w)
    for a, b in zip(
        [eager[0], *eager[1]], [compiled[0], *compiled[1]], strict=True
    ):
        np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.backends("tensorflow")
def test_tensorflow_without_xla_on_a_gpu_warns_once(monkeypatch):
    monkeypatch.setattr(fp8_backend, "_tensorflow_has_gpu", lambda: True)
    monkeypatch.setattr(fp8_backend, "_warned_no_xla", False)
    x = np.ones((4, 16), "float32")
    w = np.ones((16, 4), "float32")
    with pytest.warns(UserWarning, match="no FP8 GEMM without XLA"):
        fp8.dot(x, w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8.dot(x, w)
    assert keras.backend.backend() == "tensorflow"

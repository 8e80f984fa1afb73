"""`keras_mp.fp8.dot` and `fp8.einsum`: three FP8 GEMMs against NumPy.

The reference (`keras_mp.testing.fp8_reference.gemms`) quantizes each
GEMM's operands with the NumPy + `ml_dtypes` oracle and multiplies in
float64; the library accumulates in float32, so each result must be
within 1e-6 times the sum of absolute products (float32 accumulation
rounding), on every backend.
"""

import functools
import importlib

import keras
import numpy as np
import pytest
from keras import ops

from keras_mp import fp8
from keras_mp._fp8 import stats as fp8_stats
from keras_mp.testing import fp8_reference as reference
from keras_mp.testing import gemm_and_gradients as _run
from keras_mp.testing import to_numpy


def _operands(m, k, n, seed=0):
    """x, kernel and output gradient whose rows and columns span 16
    binades, so per-row and per-tile scales differ from per-tensor ones."""
    rng = np.random.default_rng(seed)

    def spread(rows, columns, axis):
        values = rng.normal(size=(rows, columns))
        size = (rows, 1) if axis == 0 else (1, columns)
        return (values * np.exp2(rng.uniform(-8, 8, size))).astype("float32")

    return spread(m, k, 0), spread(k, n, 1), spread(m, n, 0)


@functools.cache
def _dot(recipe):
    """One function per recipe, so that JAX compiles it once per shape."""
    return lambda x, kernel: fp8.dot(x, kernel, recipe)


def _assert_matches_reference(results, expected):
    for name, value in zip(("out", "dx", "dw"), results):
        value = to_numpy(value).astype(np.float64)
        exact, bound = expected[name]
        error = np.abs(value - exact)
        tolerance = reference.accumulation_error()
        assert (error <= tolerance * bound).all(), (
            f"{name}: error {error.max()} above {tolerance} x the sum of "
            "|products|"
            f" ({(error / np.maximum(bound, 1e-300)).max()} relative)"
        )


SHAPES = {
    "tensorwise": [
        (16, 16, 16),
        (128, 384, 16),
        (384, 128, 384),
        (16, 384, 128),
    ],
    "rowwise": [(16, 16, 16), (128, 384, 16), (384, 128, 384), (16, 384, 128)],
    # The kernel's dimensions are multiples of 128; 16 tokens make the
    # kernel gradient's token tile a partial one.
    "block": [(16, 128, 128), (384, 384, 128), (128, 128, 384)],
}
CASES = [
    (granularity, formats, shape)
    for granularity, shapes in SHAPES.items()
    for formats in ("hybrid", "e4m3")
    for shape in shapes
]


@pytest.mark.parametrize(
    "granularity, formats, shape", CASES, ids=lambda v: str(v).replace(" ", "")
)
def test_forward_and_gradients_match_numpy_to_float32_accumulation(
    granularity, formats, shape
):
    recipe = fp8.Recipe(granularity=granularity, formats=formats)
    x, kernel, g = _operands(*shape)
    results = _run(_dot(recipe), x, kernel, g)
    assert [to_numpy(r).dtype for r in results] == [np.float32] * 3
    _assert_matches_reference(
        results, reference.gemms(x, kernel, g, granularity, formats)
    )


def test_finer_granularities_keep_the_rows_a_tensor_scale_flushes():
    x, kernel, g = _operands(128, 128, 128, seed=1)
    x[:64] = np.random.default_rng(1).normal(size=(64, 128)) * 2.0**-20
    exact = x.astype(np.float64) @ kernel

    def error(granularity):
        recipe = fp8.Recipe(granularity=granularity)
        out = to_numpy(_run(_dot(recipe), x, kernel, g)[0])
        return np.abs(out - exact)[:64].max() / np.abs(exact[:64]).max()

    # One scale for the tensor flushes the rows 2**20 below its amax.
    assert error("tensorwise") > 0.5
    assert error("rowwise") < 0.1
    assert error("block") < 0.1


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "block"])
def test_three_dimensional_inputs_match_their_two_dimensional_reference(
    granularity,
):
    recipe = fp8.Recipe(granularity=granularity)
    x, kernel, g = _operands(256, 128, 128, seed=2)
    x3, g3 = x.reshape(2, 128, 128), g.reshape(2, 128, 128)
    results = _run(_dot(recipe), x3, kernel, g3)
    assert tuple(results[0].shape) == (2, 128, 128)
    assert tuple(results[1].shape) == (2, 128, 128)
    flat = [
        ops.reshape(results[0], (256, 128)),
        ops.reshape(results[1], (256, 128)),
    ]
    _assert_matches_reference(
        [*flat, results[2]], reference.gemms(x, kernel, g, granularity)
    )


EQUATIONS = [
    # equation, x shape, kernel shape: each a [16, 128] x [128, 128] dot.
    ("ab,bc->ac", (16, 128), (128, 128)),
    ("abc,cd->abd", (2, 8, 128), (128, 128)),
    ("abc,cde->abde", (2, 8, 128), (128, 2, 64)),
    ("abcd,cde->abe", (2, 8, 2, 64), (2, 64, 128)),
    ("...b,bc->...c", (2, 2, 4, 128), (128, 128)),
    ("abc,dce->abde", (2, 8, 128), (2, 128, 64)),
]


def _as_dot(equation, x, kernel):
    """The operands of the `dot` that `equation` is, by NumPy."""
    if equation == "abc,dce->abde":
        return x.reshape(16, 128), kernel.transpose(1, 0, 2).reshape(128, 128)
    return x.reshape(-1, 128), kernel.reshape(128, -1)


@pytest.mark.parametrize("equation, x_shape, kernel_shape", EQUATIONS)
def test_einsum_is_the_dot_of_its_reshaped_operands(
    equation, x_shape, kernel_shape
):
    rng = np.random.default_rng(3)
    x = rng.normal(size=x_shape).astype("float32")
    kernel = rng.normal(size=kernel_shape).astype("float32")
    expected_shape = np.einsum(equation, x, kernel).shape
    g = rng.normal(size=expected_shape).astype("float32")
    recipe = fp8.Recipe(granularity="block")
    out, dx, dkernel = _run(
        lambda a, b: fp8.einsum(equation, a, b, recipe), x, kernel, g
    )
    assert tuple(out.shape) == expected_shape
    assert tuple(dx.shape) == x_shape and tuple(dkernel.shape) == kernel_shape
    x2, kernel2 = _as_dot(equation, x, kernel)
    g2 = g.reshape(x2.shape[0], -1)
    expected = reference.gemms(x2, kernel2, g2, "block")
    out2 = ops.reshape(out, (x2.shape[0], -1))
    dx2 = ops.reshape(dx, x2.shape)
    dkernel2 = _as_dot(equation, x, to_numpy(dkernel))[1]
    _assert_matches_reference([out2, dx2, dkernel2], expected)


@pytest.mark.parametrize("factor", [2.0, 0.5])
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "block"])
def test_a_loss_scale_changes_no_code_and_scales_gradients_exactly(
    granularity, factor
):
    recipe = fp8.Recipe(granularity=granularity)
    x, kernel, g = _operands(128, 128, 256, seed=4)
    _, dx, dw = _run(_dot(recipe), x, kernel, g)
    _, dx_scaled, dw_scaled = _run(_dot(recipe), x, kernel, g * factor)
    np.testing.assert_array_equal(to_numpy(dx_scaled), to_numpy(dx) * factor)
    np.testing.assert_array_equal(to_numpy(dw_scaled), to_numpy(dw) * factor)
    codes, scale = fp8.quantize(g, "e5m2", granularity)
    codes_scaled, scale_scaled = fp8.quantize(g * factor, "e5m2", granularity)
    np.testing.assert_array_equal(
        to_numpy(ops.cast(codes_scaled, "float32")),
        to_numpy(ops.cast(codes, "float32")),
    )
    np.testing.assert_array_equal(
        to_numpy(scale_scaled), to_numpy(scale) * factor
    )


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "block"])
def test_a_nonfinite_output_gradient_gives_nonfinite_gradients(
    granularity, bad
):
    recipe = fp8.Recipe(granularity=granularity)
    x, kernel, g = _operands(128, 128, 128, seed=5)
    g[7, 3] = bad
    _, dx, dw = _run(_dot(recipe), x, kernel, g)
    assert not np.isfinite(to_numpy(dx)).all()
    assert not np.isfinite(to_numpy(dw)).all()
    x[2, 9] = bad
    out = to_numpy(_run(_dot(recipe), x, kernel, g)[0])
    assert not np.isfinite(out).all()


def test_output_and_gradients_take_the_requested_dtypes():
    x, kernel, g = _operands(16, 128, 16, seed=6)
    x16 = ops.convert_to_tensor(x, "bfloat16")
    out, dx, dw = _run(fp8.dot, x16, kernel, g)
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
    assert keras.backend.standardize_dtype(dx.dtype) == "bfloat16"
    assert keras.backend.standardize_dtype(dw.dtype) == "float32"
    out32 = fp8.dot(x16, kernel, output_dtype="float32")
    assert keras.backend.standardize_dtype(out32.dtype) == "float32"
    # bfloat16 rounding of the float32 result, nothing else.
    np.testing.assert_array_equal(
        to_numpy(ops.cast(out32, "bfloat16")).astype("float32"),
        to_numpy(out).astype("float32"),
    )


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "block"])
def test_compiled_steps_give_the_eager_results(granularity):
    backend = keras.backend.backend()
    if backend == "jax" and granularity != "block":
        # Op by op, JAX compiles each op anew (7 s a recipe); "block" runs
        # every kind of op the other two do.
        pytest.skip("on JAX, the block recipe stands for the three")
    recipe = fp8.Recipe(granularity=granularity)
    x, kernel, g = _operands(16, 128, 128, seed=7)
    function = _dot(recipe)
    eager = _run(function, x, kernel, g, jit=False)
    if backend == "jax":
        compiled = [_run(function, x, kernel, g)]
    elif backend == "tensorflow":
        import tensorflow as tf

        def step(a, b, g):
            with tf.GradientTape() as tape:
                tape.watch([a, b])
                out = function(a, b)
            return (out, *tape.gradient(out, [a, b], output_gradients=g))

        # Graph mode, XLA, and a graph whose batch size is unknown.
        signature = [
            tf.TensorSpec((None, 128)),
            tf.TensorSpec((128, 128)),
            tf.TensorSpec((None, 128)),
        ]
        compiled = [
            tf.function(step)(x, kernel, g),
            tf.function(step, jit_compile=True)(x, kernel, g),
            tf.function(step, input_signature=signature)(x, kernel, g),
        ]
    else:
        pytest.skip("PyTorch runs eagerly: nothing to compile")
    for results in compiled:
        for value, expected in zip(results, eager):
            np.testing.assert_array_equal(to_numpy(value), to_numpy(expected))


@pytest.mark.backends("torch")
def test_torch_scaled_mm_and_the_cpu_upcast_give_the_same_bits(monkeypatch):
    import torch

    from keras_mp.backend import fp8 as backend_fp8

    x, kernel, g = _operands(16, 32, 48)
    upcast = _run(fp8.dot, x, kernel, g)
    monkeypatch.setattr(backend_fp8, "SCALED_MM_ON_CPU", True)
    calls = []
    scaled_mm = torch._scaled_mm

    def counting(a, b, *args, **kwargs):
        calls.append((a.dtype, b.dtype))
        return scaled_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    scaled = _run(fp8.dot, x, kernel, g)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    assert calls == [(e4m3, e4m3), (e5m2, e4m3), (e4m3, e5m2)]
    for a, b in zip(scaled, upcast):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


@pytest.mark.backends("torch")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("stats", [False, True])
def test_torch_codes_of_16bit_inputs_are_made_without_a_float32_copy(
    dtype, stats, monkeypatch
):
    """Tensorwise codes of a bfloat16 or float16 input and output gradient
    are made from them as they are (`torch_fp8_operands.encode` is handed
    the 16-bit tensors, not float32 casts), bit for bit the values path,
    which casts to float32 first; statistics included."""
    import torch

    from keras_mp.backend import fp8 as backend_fp8
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

    x, kernel, g = _operands(16, 32, 48)
    x, g = x.astype(dtype), g.astype(dtype)
    recipe = fp8.Recipe(stats=stats)

    def run():
        carrier = ops.zeros(fp8_stats.SHAPE) if stats else None
        carrier = carrier if carrier is None else carrier.requires_grad_(True)

        def function(x, kernel):
            return fp8.dot(x, kernel, recipe, stats=carrier)

        results = _run(function, x, kernel, g)
        return (*results, *([carrier.grad] if stats else []))

    upcast = run()
    monkeypatch.setattr(backend_fp8, "SCALED_MM_ON_CPU", True)
    encoded = []
    encode = torch_fp8_operands.encode

    def recording(t, *args):
        encoded.append(t.dtype)
        return encode(t, *args)

    monkeypatch.setattr(torch_fp8_operands, "encode", recording)
    scaled = run()
    source = getattr(torch, dtype)
    assert encoded == [source, torch.float32, source]
    assert scaled[0].dtype == upcast[0].dtype == source
    for a, b in zip(scaled, upcast):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"recipe": fp8.Recipe(granularity="block")}, ValueError, "multiples"),
        ({"recipe": fp8.Recipe(scaling="delayed")}, ValueError, "state"),
        ({"recipe": "hybrid"}, TypeError, "Recipe"),
        ({"output_dtype": "int8"}, ValueError, "output_dtype"),
    ],
)
def test_bad_dot_arguments_raise_with_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        fp8.dot(
            np.ones((16, 64), "float32"), np.ones((64, 32), "float32"), **kwargs
        )


def test_bad_operands_raise():
    with pytest.raises(TypeError, match="floating point"):
        fp8.dot(np.ones((4, 16), "int32"), np.ones((16, 16), "float32"))
    with pytest.raises(ValueError, match="last dimension"):
        fp8.dot(np.ones((4, 8), "float32"), np.ones((16, 16), "float32"))
    with pytest.raises(ValueError, match="2-D kernel"):
        fp8.dot(np.ones((4, 16), "float32"), np.ones((16, 2, 8), "float32"))


@pytest.mark.parametrize(
    "equation", ["abc,acd->abd", "abc,cd->ad", "ab,cd->abcd", "abc,cd"]
)
def test_einsum_that_is_not_one_dot_raises_naming_the_equation(equation):
    with pytest.raises(ValueError, match="Received: equation="):
        fp8.einsum(
            equation,
            np.ones((2, 4, 16), "float32"),
            np.ones((16, 16), "float32"),
        )


def test_gradients_reach_keras_variables():
    from keras_mp.backend import gradients

    x, kernel, g = _operands(16, 32, 16, seed=8)
    x_variable, kernel_variable = keras.Variable(x), keras.Variable(kernel)
    dx, dw = gradients.compute_gradients(
        lambda: ops.sum(
            fp8.dot(x_variable, kernel_variable) * ops.convert_to_tensor(g)
        ),
        [x_variable, kernel_variable],
    )
    _, expected_dx, expected_dw = _run(_dot(fp8.DEFAULT_RECIPE), x, kernel, g)
    np.testing.assert_array_equal(to_numpy(dx), to_numpy(expected_dx))
    np.testing.assert_array_equal(to_numpy(dw), to_numpy(expected_dw))


class _FP8Dense(keras.layers.Dense):
    def call(self, inputs):
        return fp8.dot(inputs, self.kernel) + self.bias


def test_a_layer_calling_dot_trains_in_fit_under_mixed_bfloat16():
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((32,)), _FP8Dense(16, activation="relu"), _FP8Dense(1)]
    )
    model.compile(keras.optimizers.SGD(0.05), "mse")
    rng = np.random.default_rng(9)
    x = rng.normal(size=(64, 32)).astype("float32")
    y = x[:, :1]
    before = [to_numpy(w) for w in model.trainable_weights]
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["loss"][-1] < history.history["loss"][0]
    after = [to_numpy(w) for w in model.trainable_weights]
    assert all((a != b).any() for a, b in zip(after, before))


@pytest.mark.backends("jax")
def test_jax_feeds_the_fp8_codes_themselves_to_dot_general():
    import jax

    x, kernel, g = _operands(16, 128, 128)
    jaxpr = jax.make_jaxpr(lambda *args: _run(fp8.dot, *args, jit=False))(
        x, kernel, g
    )
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    # The forward, input gradient and kernel gradient GEMMs.
    assert len(dots) == 3, jaxpr
    for eqn in dots:
        assert str(eqn.params["preferred_element_type"]) == "float32"
    operand_types = [
        tuple(str(var.aval.dtype) for var in eqn.invars) for eqn in dots
    ]
    e4m3, e5m2 = "float8_e4m3fn", "float8_e5m2"
    assert sorted(operand_types) == sorted(
        [(e4m3, e4m3), (e5m2, e4m3), (e4m3, e5m2)]
    )


def _record_scaled_mm(monkeypatch):
    """Every `torch._scaled_mm` call's arguments, as the meta replay needs
    them, with `SCALED_MM_ON_CPU` on."""
    import torch

    from keras_mp.backend import fp8 as backend_fp8

    monkeypatch.setattr(backend_fp8, "SCALED_MM_ON_CPU", True)
    calls = []
    scaled_mm = torch._scaled_mm

    def recording(a, b, scale_a, scale_b, **kwargs):
        calls.append(
            {
                "operands": [(t.shape, t.stride(), t.dtype) for t in (a, b)],
                "scales": (scale_a.clone(), scale_b.clone()),
                **kwargs,
            }
        )
        return scaled_mm(a, b, scale_a, scale_b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    return calls


def _replay_on_meta(call):
    """The call again on `meta` tensors, whose kernel checks what CUDA's
    does: a row-major A, a column-major B, sizes and scales."""
    import torch

    a, b = (
        torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        for shape, stride, dtype in call["operands"]
    )
    scales = [scale.to("meta") for scale in call["scales"]]
    options = {k: v for k, v in call.items() if k not in ("operands", "scales")}
    # The operator itself: `torch._scaled_mm` is the recording stand-in.
    return torch.ops.aten._scaled_mm(a, b, *scales, **options)


@pytest.mark.backends("torch")
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_torch_scaled_mm_calls_pass_the_cuda_layout_checks_on_meta_tensors(
    granularity, monkeypatch
):
    import torch

    calls = _record_scaled_mm(monkeypatch)
    recipe = fp8.Recipe(granularity=granularity)
    x, kernel, g = _operands(32, 64, 48, seed=10)
    x16 = ops.convert_to_tensor(x, "bfloat16")
    _run(lambda a, b: fp8.dot(a, b, recipe), x16, kernel, g)
    assert len(calls) == 3
    for call in calls:
        out = _replay_on_meta(call)
        assert out.dtype == call["out_dtype"]
    # The meta kernel does check: B row-major is refused.
    (shape, _, dtype) = calls[0]["operands"][1]
    wrong = dict(calls[0], operands=[calls[0]["operands"][0]])
    wrong["operands"].append((shape, (shape[1], 1), dtype))
    with pytest.raises(RuntimeError, match="col_major|column"):
        _replay_on_meta(wrong)
    fast = [call.get("use_fast_accum", False) for call in calls]
    out_dtypes = [call["out_dtype"] for call in calls]
    if granularity == "rowwise":
        # The forward GEMM (E4M3 x E4M3, a bfloat16 result) takes its row
        # and column scales and writes bfloat16, as CUDA's rowwise GEMM
        # does; the gradients' (E5M2 x E4M3: CUDA has no rowwise GEMM of
        # them) are multiplied by theirs after a GEMM of unit scales.
        assert fast == [False] * 3
        assert out_dtypes == [torch.bfloat16, torch.float32, torch.float32]
        _, sx = fp8.quantize(x16, "e4m3", "rowwise", axis=1)
        _, sw = fp8.quantize(kernel, "e4m3", "rowwise", axis=0)
        row, column = calls[0]["scales"]
        assert tuple(row.shape) == (32, 1) and tuple(column.shape) == (1, 48)
        np.testing.assert_array_equal(to_numpy(row), to_numpy(sx))
        np.testing.assert_array_equal(to_numpy(column), to_numpy(sw))
        assert all(float(s) == 1.0 for c in calls[1:] for s in c["scales"])
        return
    # The forward GEMM alone accumulates fast; each GEMM takes its scales
    # (sx * sw as one factor) and writes the dtype of its result: the
    # forward product and the input gradient bfloat16 (x is), the kernel
    # gradient float32 (the kernel is).
    assert fast == [True, False, False]
    assert out_dtypes == [torch.bfloat16, torch.bfloat16, torch.float32]
    _, sx = fp8.quantize(x16, "e4m3")
    _, sw = fp8.quantize(kernel, "e4m3")
    _, sg = fp8.quantize(
        ops.cast(ops.convert_to_tensor(g, "bfloat16"), "float32"), "e5m2"
    )
    factors = [float(call["scales"][0]) for call in calls]
    assert factors == [
        float(sx) * float(sw),
        float(sg) * float(sw),
        float(sx) * float(sg),
    ]
    assert all(float(call["scales"][1]) == 1.0 for call in calls)


@pytest.mark.backends("torch")
@pytest.mark.parametrize("formats", ["hybrid", "e4m3"])
def test_torch_rowwise_scales_in_the_gemm_give_the_values_paths_bits(
    formats, monkeypatch
):
    """Rowwise GEMMs whose row and column scales go into `_scaled_mm`
    (E4M3 x E4M3 into bfloat16; with `formats="e4m3"` all three GEMMs)
    give the bits of the CPU's values path, which multiplies a float32
    product by them; `ROWWISE_SCALES_IN_GEMM` off gives them too."""
    from keras_mp.backend import fp8 as backend_fp8

    recipe = fp8.Recipe(granularity="rowwise", formats=formats)
    x, kernel, g = _operands(32, 64, 48, seed=11)
    x16, kernel16 = (ops.convert_to_tensor(t, "bfloat16") for t in (x, kernel))

    def run():
        return _run(lambda a, b: fp8.dot(a, b, recipe), x16, kernel16, g)

    values = run()
    calls = _record_scaled_mm(monkeypatch)
    in_gemm = run()
    epilogues = [c for c in calls if tuple(c["scales"][0].shape) != ()]
    assert len(epilogues) == (3 if formats == "e4m3" else 1)
    monkeypatch.setattr(backend_fp8, "ROWWISE_SCALES_IN_GEMM", False)
    calls.clear()
    after = run()
    assert len(calls) == 3
    assert all(tuple(c["scales"][0].shape) == () for c in calls)
    for a, b, c in zip(in_gemm, values, after):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
        np.testing.assert_array_equal(to_numpy(c), to_numpy(b))


@pytest.mark.backends("torch")
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_torch_operands_reach_scaled_mm_in_its_layouts_without_copies(
    granularity, monkeypatch
):
    """The quantizer writes each operand in the layout its GEMM takes:
    no transpose or copy between it and `_scaled_mm`, and the bits of the
    CPU's values path."""
    import torch

    upcast = _run(
        _dot(fp8.Recipe(granularity=granularity)), *_operands(32, 64, 48)
    )
    calls = _record_scaled_mm(monkeypatch)
    copies = []
    contiguous = torch.Tensor.contiguous

    def counting(self, *args, **kwargs):
        if self.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            copies.append(self.shape)
        return contiguous(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", counting)
    recipe = fp8.Recipe(granularity=granularity)
    scaled = _run(lambda a, b: fp8.dot(a, b, recipe), *_operands(32, 64, 48))
    assert len(calls) == 3 and copies == []
    for a, b in zip(scaled, upcast):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


def _count_kernel_quantizations(monkeypatch, kernel_shapes):
    """A list that grows by one per quantization of a tensor of one of
    `kernel_shapes`."""
    # Every quantizer's kernel operand goes through `base.operand`.
    quantizer_base = importlib.import_module("keras_mp._fp8.quantizers.base")
    counted = []
    operand = quantizer_base.operand

    def counting(x, *args, **kwargs):
        if tuple(x.shape) in kernel_shapes:
            counted.append(tuple(x.shape))
        return operand(x, *args, **kwargs)

    monkeypatch.setattr(quantizer_base, "operand", counting)
    return counted


@pytest.mark.backends("torch")
@pytest.mark.parametrize(
    "granularity, per_step",
    [("tensorwise", 1), ("rowwise", 2), ("block", 1)],
)
def test_torch_quantizes_an_unchanged_kernel_once_across_calls(
    granularity, per_step, monkeypatch
):
    """Calls and micro-steps that share a kernel share its FP8 codes; an
    in-place update of the kernel (an optimizer step, an assign) makes
    new ones, the bits of quantizing it afresh."""
    from keras_mp.backend import gradients

    counted = _count_kernel_quantizations(
        monkeypatch, {(128, 256), (1, 128, 2, 128)}
    )
    recipe = fp8.Recipe(granularity=granularity)
    x, kernel, g = _operands(16, 128, 256, seed=11)
    variable = keras.Variable(kernel)
    g_tensor = ops.convert_to_tensor(g)

    def micro_step():
        out = fp8.dot(x, variable, recipe)
        return gradients.compute_gradients(
            lambda: ops.sum(fp8.dot(x, variable, recipe) * g_tensor), [variable]
        )[0], out

    first = [micro_step() for _ in range(3)]
    assert len(counted) == per_step
    variable.assign(variable * 0.75 + 0.125)
    updated = micro_step()
    assert len(counted) == 2 * per_step
    # The cached codes are those of a fresh quantization, before and
    # after the update: a plain tensor of the same values has no cache.
    for (dw, out), values in [(first[-1], kernel), (updated, variable)]:
        expected_out, _, expected_dw = _run(
            _dot(recipe), x, to_numpy(values), g
        )
        np.testing.assert_array_equal(to_numpy(out), to_numpy(expected_out))
        np.testing.assert_array_equal(to_numpy(dw), to_numpy(expected_dw))

"""`keras_mp.backend.torch.fp8_operands`: PyTorch's FP8 GEMM operands
written in both layouts in one pass, bit for bit the oracle's codes.

Each implementation (the eager copies, `torch.compile`, the Triton kernel
under `TRITON_INTERPRET=1`) is compared with the NumPy + `ml_dtypes`
oracle (`keras_mp.testing.fp8_reference.encode`) and with the eager
`keras_mp._fp8.quantize.encode`, over every bfloat16 bit pattern (signs,
subnormals, ±0, inf, NaN), ties and values beyond the format's range.
"""

import importlib.util
import sys
import textwrap
import types

import numpy as np
import pytest

from keras_mp.testing import fp8_reference as reference
from keras_mp.testing import run_triton_interpreted

pytestmark = pytest.mark.backends("torch")

FORMATS = ["e4m3", "e5m2"]


def _inputs(fmt):
    """`(x, scale)`: 2-D float32 `x` whose `x / scale` holds every
    bfloat16 bit pattern, ties between codes and values beyond `±fmax`."""
    patterns = (np.arange(2**16, dtype=np.uint32) << 16).view(np.float32)
    fmax = reference.FORMATS[fmt][1]
    grid = reference.encode(np.linspace(-fmax, fmax, 4001), 1.0, fmt)
    grid = grid.astype(np.float32)
    ties = (grid[1:] + grid[:-1]) / 2
    beyond = np.float32([1.01, 1.1, 1.5, 3e5, 3e33]) * fmax
    y = np.concatenate([patterns, ties, beyond, -beyond])
    y = np.resize(y, (len(y) // 96 + 1) * 96).reshape(-1, 96)
    with np.errstate(over="ignore", invalid="ignore"):
        x = (y.astype(np.float64) * 8).astype(np.float32)
    return x, np.float32(8.0)


def _assert_codes(codes, expected):
    """Equal code bits, NaN-ness compared (payloads differ by backend)."""
    import torch

    values = codes.float().numpy()
    expected_values = expected.astype(np.float32)
    nan = np.isnan(expected_values)
    np.testing.assert_array_equal(np.isnan(values), nan)
    bits = codes.contiguous().view(torch.uint8).numpy()
    np.testing.assert_array_equal(bits[~nan], expected.view(np.uint8)[~nan])


def _assert_layouts(row, column, shape):
    assert tuple(row.shape) == tuple(column.shape) == shape
    assert row.stride() == (shape[1], 1)
    assert column.stride() == (1, shape[0])


def _failing(*arguments):
    raise RuntimeError("no such PTX instruction")


@pytest.fixture
def triton_serves(monkeypatch):
    """Triton's kernels taken to serve every tensor, none failed yet: the
    module, for a test to make its kernels fail (`_failing`)."""
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

    monkeypatch.setattr(torch_fp8_operands, "_failed", set())
    monkeypatch.setattr(
        torch_fp8_operands, "implementation_for", lambda x: "triton"
    )
    return torch_fp8_operands


def test_failing_delayed_kernels_warn_and_hand_over(monkeypatch, triton_serves):
    """Where delayed scaling's kernels cannot build, torch's operations
    fold the carrier and make its gradient from then on, with one warning
    each, and the same values."""
    import torch

    import keras_mp
    from keras_mp._fp8 import delayed
    from keras_mp._fp8 import stats
    from keras_mp.backend.torch import delayed as torch_delayed

    torch_fp8_operands = triton_serves
    monkeypatch.setattr(torch_delayed, "_triton_fold", _failing)
    monkeypatch.setattr(torch_delayed, "_triton_carrier_gradient", _failing)
    # The scales' kernel is not under test: torch's operations make them.
    monkeypatch.setattr(torch_fp8_operands, "_triton_scales", _failing)
    torch_fp8_operands._failed.add("triton_scales")
    recipe = keras_mp.fp8.Recipe(scaling="delayed")
    carrier = torch.zeros(delayed.CARRIER_SHAPE)
    carrier[:, 300] = 1.0
    carrier[0, delayed.PARITY] = 1.0
    history = torch.zeros((3, 4))
    with pytest.warns(UserWarning, match="kernel of delayed scaling's fold"):
        folded, folds, scaling, written = delayed.fold_and_scaling(
            history, torch.tensor(0, dtype=torch.int32), carrier, recipe
        )
    assert int(folds) == 1 and not written
    # Bin 300: biased exponent 150, 2**23.
    assert folded[:, 0].tolist() == [2.0**23] * 3
    amaxes = [torch.tensor([[3.0]])] * 3
    arguments = (
        amaxes,
        (1.0, 2.0, 3.0),
        torch.tensor([0.0, 1.0]),
        stats.HISTOGRAM_BINS,
        stats.MANTISSA_ABOVE_1_75,
        delayed.CARRIER_WIDTH,
        delayed.PARITY,
    )
    with pytest.warns(UserWarning, match="delayed scaling's statistics"):
        gradient = torch_delayed.carrier_gradient_of_amaxes(*arguments)
    assert torch_fp8_operands._failed == {
        "triton_scales",
        "triton_fold",
        "triton_carrier_gradient",
    }
    assert gradient[:, stats.HISTOGRAM_BINS].tolist() == [1.0, 2.0, 3.0]


def test_a_failing_scales_kernel_warns_and_hands_over(
    monkeypatch, triton_serves
):
    """Where the scales' kernel cannot build, torch's operations make the
    scales from then on (`scales` gives None), with one warning; the codes'
    kernel is not given up."""
    import torch

    torch_fp8_operands = triton_serves
    monkeypatch.setattr(torch_fp8_operands, "_triton_scales", _failing)
    magnitudes = torch.tensor([[3.0]])
    with pytest.warns(UserWarning, match="kernel of FP8 scales failed"):
        assert torch_fp8_operands.scales(magnitudes, 8, 0, 1, 254) is None
    assert torch_fp8_operands._failed == {"triton_scales"}
    assert torch_fp8_operands.scales(magnitudes, 8, 0, 1, 254) is None


@pytest.mark.parametrize("source", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("implementation", ["copy", "compiled"])
def test_both_layouts_hold_the_oracles_codes_bit_for_bit(
    implementation, fmt, source, monkeypatch
):
    """From float32, and from bfloat16 and float16 read as they are (the
    oracle takes their values in float32)."""
    import torch

    from keras_mp._fp8.formats.e4m3_e5m2 import encode
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

    monkeypatch.setattr(torch_fp8_operands, "FORCED", implementation)
    x, scale = _inputs(fmt)
    x = torch.from_numpy(x).to(getattr(torch, source))
    row, column = torch_fp8_operands.encode(
        x, torch.tensor(scale), fmt, ("row", "column")
    )
    _assert_layouts(row, column, tuple(x.shape))
    values = x.float()
    expected = reference.encode(values.numpy(), scale, fmt)
    _assert_codes(row, expected)
    _assert_codes(column, expected)
    eager = encode(values / torch.tensor(scale), fmt)
    np.testing.assert_array_equal(
        row.view(torch.uint8).numpy(), eager.view(torch.uint8).numpy()
    )
    (alone,) = torch_fp8_operands.encode(
        x, torch.tensor(scale), fmt, ("column",)
    )
    assert alone.stride() == column.stride()
    _assert_codes(alone, expected)


_TRITON_SCRIPT = textwrap.dedent(
    """
    import sys

    import ml_dtypes
    import numpy as np
    import torch

    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

    torch_fp8_operands.FORCED = "triton"
    rng = np.random.default_rng(0)
    failures = []
    for fmt, dtype in (("e4m3", ml_dtypes.float8_e4m3fn),
                       ("e5m2", ml_dtypes.float8_e5m2)):
        fmax = float(ml_dtypes.finfo(dtype).max)
        # 97 x 150: edge tiles that the masks must cut.
        codes = np.clip(rng.normal(size=(97, 150)) * fmax / 8, -fmax, fmax)
        codes = codes.astype(dtype)
        y = codes.astype(np.float32)
        specials = [np.inf, -np.inf, np.nan, 4 * fmax, -4 * fmax, -0.0]
        for i, value in enumerate(specials):
            y[i, i] = value
        for scale_shape in ((), (97, 1), (1, 150)):
            scale = np.exp2(rng.integers(-20, 20, scale_shape))
            scale = np.asarray(scale, np.float32)
            # The values are exact in bfloat16 too, which is read as is.
            for source in (torch.float32, torch.bfloat16):
                x = torch.from_numpy(y * scale).to(source)
                row, column = torch_fp8_operands.encode(
                    x, torch.from_numpy(scale), fmt, ("row", "column")
                )
                where = (fmt, scale_shape, str(source))
                if row.stride() != (150, 1) or column.stride() != (1, 97):
                    failures.append((*where, "strides"))
                expected = np.clip(y, -fmax, fmax)
                expected = np.where(np.isinf(y), y, expected).astype(dtype)
                nan = np.isnan(expected.astype(np.float32))
                for name, got in (("row", row), ("column", column)):
                    values = got.float().numpy()
                    bits = got.contiguous().view(torch.uint8).numpy()
                    if (np.isnan(values) != nan).any() or (
                        bits[~nan] != expected.view(np.uint8)[~nan]
                    ).any():
                        failures.append((*where, name))
    # The cast with its amax (delayed scaling's): the same codes, and the
    # programs' maxima, whose max is the largest `|x|` with NaN as inf,
    # bit for bit NumPy's of the values torch holds: one value, edge tiles
    # and several programs, bfloat16 subnormals (read as bits), -0.
    tiny = {torch.float32: 2.0**-140, torch.bfloat16: 2.0**-130,
            torch.float16: 2.0**-20}
    for shape in ((1, 1), (97, 150), (130, 64)):
        for source in (torch.float32, torch.bfloat16, torch.float16):
            for case in ("normal", "subnormal", "nan", "inf", "zeros"):
                y = rng.normal(size=shape) * (
                    tiny[source] if case == "subnormal" else 1.0
                )
                x = torch.from_numpy(y.astype(np.float32)).to(source)
                if case == "nan":
                    x[-1, -1] = np.nan
                elif case == "inf":
                    x[0, -1] = -np.inf
                elif case == "zeros":
                    x = torch.full(shape, -0.0, dtype=source)
                scale = torch.tensor(2.0**-3)
                layouts = ("row", "column")
                codes, maxima = torch_fp8_operands.encode_with_amax(
                    x, scale, "e5m2", layouts
                )
                alone = torch_fp8_operands.encode(x, scale, "e5m2", layouts)
                where = (shape, str(source), case)
                for got, expected in zip(codes, alone):
                    if got.stride() != expected.stride() or not torch.equal(
                        got.view(torch.uint8), expected.view(torch.uint8)
                    ):
                        failures.append((*where, "codes"))
                values = x.float().numpy()
                amax = np.where(np.isnan(values), np.inf, np.abs(values)).max()
                programs = -(-shape[0] // 64) * -(-shape[1] // 64)
                got = maxima.max().numpy()
                if maxima.shape != (programs,) or got.tobytes() != (
                    np.float32(amax).tobytes()
                ):
                    failures.append((*where, "amax", got, amax))
    print(failures)
    sys.exit(1 if failures else 0)
    """
)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"
)
def test_the_triton_kernel_writes_both_layouts_under_the_interpreter():
    """Indexing, masks, per-row and per-column scales and the special values,
    from float32 and from bfloat16 read as it is; with the amax written by the
    same pass (delayed scaling's casts), bit for bit NumPy's, through
    subnormals, NaN, inf and -0; finite values on the FP8 grid only, since the
    interpreter's FP8 cast rounds ties away and loses carries (triton 3.9.0): a
    GPU checks the rounding. In a fresh process: `TRITON_INTERPRET` is read
    when Triton is imported, and Triton's LLVM clashes with TensorFlow's in one
    process."""
    run_triton_interpreted(_TRITON_SCRIPT)


def test_a_failing_implementation_warns_and_hands_over(monkeypatch):
    import torch

    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

    monkeypatch.setattr(torch_fp8_operands, "_failed", set())

    def failing(*arguments):
        raise RuntimeError("no such PTX instruction")

    x = torch.tensor([[1.0, -500.0], [float("inf"), 3.0]])
    scale = torch.tensor(1.0)
    with pytest.warns(UserWarning, match="'triton' FP8 quantization failed"):
        written = torch_fp8_operands._falling_back(
            "triton",
            failing,
            (x, scale, 448.0, torch.float8_e4m3fn, False, ("row", "column")),
            "e4m3",
        )
    assert torch_fp8_operands._failed == {"triton"}
    expected = reference.encode(x.numpy(), np.float32(1.0), "e4m3")
    for codes in written:
        _assert_codes(codes, expected)
    monkeypatch.setattr(torch_fp8_operands, "FORCED", "compiled")
    with pytest.raises(RuntimeError, match="PTX"):
        torch_fp8_operands._falling_back(
            "compiled",
            failing,
            (x, scale, 448.0, torch.float8_e4m3fn, False, ("row",)),
            "e4m3",
        )


@pytest.mark.parametrize(
    "shape, layouts, match",
    [
        ((4, 4), ("row",), "fmt"),
        ((2, 3, 4), ("row",), "2-D float32"),
        ((4, 4), ("rows",), "layouts"),
        ((4, 4), ("row", "row"), "layouts"),
        ((4, 4), (), "layouts"),
    ],
)
def test_bad_operands_raise_naming_the_fix(shape, layouts, match):
    import torch

    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

    fmt = "e3m4" if match == "fmt" else "e4m3"
    with pytest.raises(ValueError, match=match):
        torch_fp8_operands.encode(
            torch.ones(shape), torch.tensor(1.0), fmt, layouts
        )


def test_triton_is_never_imported_after_tensorflow(monkeypatch):
    """Importing Triton in a process that loaded TensorFlow aborts it (the
    two LLVMs' options clash): with TensorFlow loaded, CUDA operands are
    written by copies, neither the Triton kernel nor Inductor's."""
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

    monkeypatch.setattr(torch_fp8_operands, "triton_available", lambda: True)
    monkeypatch.setitem(sys.modules, "tensorflow", types.ModuleType("tf"))
    assert not torch_fp8_operands.triton_usable()
    monkeypatch.delitem(sys.modules, "tensorflow")
    assert torch_fp8_operands.triton_usable()


_SCALES_SCRIPT = textwrap.dedent(
    """
    import sys

    import ml_dtypes
    import numpy as np
    import torch

    import keras_mp
    from keras_mp._fp8.formats import e4m3_e5m2
    from keras_mp.backend import fp8 as backend_fp8
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands
    from keras_mp.backend.torch import ops as torch_ops
    from keras_mp.testing import fp8_reference as reference

    torch_fp8_operands.FORCED = "triton"
    failures = []
    rng = np.random.default_rng(0)
    patterns = np.arange(2**16, dtype=np.uint16)
    # Non-negative float32 bit patterns (NaNs among them), and each
    # format's thresholds one ulp either side, at every exponent.
    bits = rng.integers(0, 2**31, 100_000, dtype=np.uint32)
    with np.errstate(over="ignore"):
        powers = np.exp2(np.arange(-150, 130.0)).astype(np.float32)
        edges = np.concatenate([448.0 * powers, 57344.0 * powers])
    edges = edges[np.isfinite(edges) & (edges > 0)].astype(np.float32)
    up, down = np.float32(np.inf), np.float32(0)
    edges = np.concatenate(
        [edges, np.nextafter(edges, down), np.nextafter(edges, up)]
    )
    specials = np.array(
        [0.0, 1e-45, 2.0**-126, 2.0**-127, 3.4e38, np.inf, np.nan], np.float32
    )
    sources = {
        "bfloat16": patterns.view(ml_dtypes.bfloat16).astype(np.float32),
        "float16": patterns.view(np.float16).astype(np.float32),
        "float32": np.concatenate([bits.view(np.float32), edges, specials]),
    }
    for dtype, values in sources.items():
        values = np.abs(values)
        amax = np.where(np.isnan(values), np.float32(np.inf), values)
        magnitudes = torch.from_numpy(values).to(getattr(torch, dtype))
        for fmt in ("e4m3", "e5m2"):
            for margin in (0, 2):
                exponent, carry = e4m3_e5m2._torch_thresholds(
                    e4m3_e5m2._threshold(fmt, margin)
                )
                for shape in ((-1,), (-1, 1)):
                    scale, inverse = torch_fp8_operands.scales(
                        magnitudes.reshape(shape), exponent, carry, 1, 254
                    )
                    expected = reference.scale(amax, fmt, margin)
                    # `torch_ops.amax`'s float32 cast and NaN made inf,
                    # then `torch_ops.scale_from_amax`.
                    eager = torch_ops.scale_from_amax(
                        torch.from_numpy(amax), exponent, carry, 1, 254
                    ).numpy()
                    where = (dtype, fmt, margin, shape)
                    if scale.shape != magnitudes.reshape(shape).shape:
                        failures.append((*where, "shape"))
                    scale = scale.reshape(-1).numpy()
                    for name, want in (("oracle", expected), ("eager", eager)):
                        wrong = scale.view(np.uint32) != want.view(np.uint32)
                        if wrong.any():
                            failures.append((*where, name, values[wrong][:3]))
                    with np.errstate(divide="ignore"):
                        reciprocal = np.float32(1.0) / expected
                    got = inverse.reshape(-1).numpy().view(np.uint32)
                    if (got != reciprocal.view(np.uint32)).any():
                        failures.append((*where, "inverse"))
        # `torch_ops.amax`'s float32 cast and NaN made inf, in the kernel.
        got = torch_fp8_operands.amaxes(magnitudes).numpy()
        if (got.view(np.uint32) != amax.view(np.uint32)).any():
            failures.append((dtype, "amax"))
        # `torch_ops.scale_from_amax` of float32 amaxes (a NaN gives a NaN
        # scale), one format per column, as delayed scaling's three
        # tensors are scaled at once.
        thresholds = [
            e4m3_e5m2._threshold(fmt, 1) for fmt in ("e4m3", "e4m3", "e5m2")
        ]
        exponent, carry = e4m3_e5m2._torch_thresholds(thresholds)
        columns = torch.from_numpy(values[: len(values) // 3 * 3]).reshape(-1, 3)
        torch_fp8_operands.FUSED_KERNELS = False
        eager = torch_ops.scale_from_amax(columns, exponent, carry, 1, 254)
        torch_fp8_operands.FUSED_KERNELS = True
        got = torch_ops.scale_from_amax(columns, exponent, carry, 1, 254)
        if not torch.equal(got.view(torch.int32), eager.view(torch.int32)):
            failures.append((dtype, "columns"))

    # fp8.dot with the scales from the kernel, and from torch's operations:
    # the same bits, forward and both gradients, tensorwise and rowwise.
    backend_fp8.SCALED_MM_ON_CPU = True
    for granularity in ("tensorwise", "rowwise"):
        recipe = keras_mp.fp8.Recipe(granularity=granularity)
        for magnitude in (2.0**-30, 1.0, 2.0**40):
            x = torch.from_numpy(rng.normal(size=(48, 64)) * magnitude)
            x = x.to(torch.bfloat16).requires_grad_(True)
            w = torch.from_numpy(rng.normal(size=(64, 32)).astype(np.float32))
            w = w.requires_grad_(True)
            results = []
            for fused in (True, False):
                torch_fp8_operands.FUSED_KERNELS = fused
                y = keras_mp.fp8.dot(x, w, recipe, output_dtype="bfloat16")
                results.append((y, *torch.autograd.grad(y.sum(), (x, w))))
            if not all(torch.equal(a, b) for a, b in zip(*results)):
                failures.append(("dot", granularity, magnitude))
    print(failures)
    sys.exit(1 if failures else 0)
    """
)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"
)
def test_the_triton_scales_kernel_gives_the_oracle_scales_under_the_interpreter():
    """The scale and its reciprocal of every bfloat16 and float16 magnitude,
    random float32 ones, each format's thresholds one ulp either side at
    every exponent, 0, subnormals, inf and NaN, in both formats and with a
    margin: bit for bit the NumPy oracle's and torch's eager operations';
    and `fp8.dot` gives the same bits with the kernel's scales as with the
    eager ones. Integer and float32 operations alone: the interpreter's
    bits are a GPU's."""
    run_triton_interpreted(_SCALES_SCRIPT)


_FOLD_SCRIPT = textwrap.dedent(
    """
    import sys

    import numpy as np
    import torch

    import keras_mp
    from keras_mp._fp8 import delayed
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

    torch_fp8_operands.FORCED = "triton"
    rng = np.random.default_rng(0)


    def same(a, b):
        # Bit for bit: the dtype, the shape and every value's bits.
        return a.dtype == b.dtype and a.shape == b.shape and (
            torch.equal(a.view(torch.int32), b.view(torch.int32))
            if a.dtype == torch.float32
            else torch.equal(a, b)
        )


    recipes = [
        keras_mp.fp8.Recipe(scaling="delayed"),
        keras_mp.fp8.Recipe(scaling="delayed", amax_algo="most_recent"),
        keras_mp.fp8.Recipe(scaling="delayed", margin=2, formats="e4m3"),
    ]
    failures = []
    cases = 0
    for length in (1, 3, 16, 1024):
        for trial in range(12):
            carrier = np.zeros(delayed.CARRIER_SHAPE, np.float32)
            for row in range(3):
                # No bin, finite bins, or the non-finite ones (510, 511).
                choice = trial % 4
                if choice == 1:
                    carrier[row, rng.integers(0, 510, 3)] = 1.0
                elif choice == 2:
                    carrier[row, rng.integers(0, 512, 5)] = 2.0
                elif choice == 3:
                    carrier[row, rng.integers(505, 512)] = 1.0
            carrier[0, delayed.PARITY : delayed.PARITY + 2] = rng.integers(
                0, 2, 2
            )
            carrier[0, delayed.LOSS_SCALE] = (0.0, -1.0, 1024.0, 3.5)[trial % 4]
            history = np.abs(rng.normal(size=(3, length))).astype(np.float32)
            history *= np.exp2(rng.integers(-60, 60, (3, 1))).astype(np.float32)
            history[:, rng.integers(0, length)] = 0.0
            if trial == 5:
                history[1, 0] = np.inf
            folds = np.int32((0, 1, 2, 5, 2**30)[trial % 5])
            for recipe in recipes:
                results = []
                # Fused into new tensors, fused in place into the layer's
                # state (the scales it stores: 0 while the count is 0), and
                # torch's operations.
                for fused, in_place in ((True, False), (True, True), (False, False)):
                    torch_fp8_operands.FUSED_KERNELS = fused
                    h = torch.from_numpy(history.copy())
                    f = torch.tensor(folds)
                    stored = torch.full((3,), -7.0)
                    state = (h, f, stored) if in_place else None
                    h, f, scaling, written = delayed.fold_and_scaling(
                        h, f, torch.from_numpy(carrier.copy()), recipe,
                        state=state,
                    )
                    if written != in_place or (
                        in_place and (h is not state[0] or f is not state[1])
                    ):
                        failures.append((length, trial, "in place"))
                    gradient_scale = scaling.scales[2:] * scaling.loss_scale
                    if fused:
                        gradient_scale = scaling.gradient_scale
                    if not in_place:
                        stored = torch.where(scaling.first, 0.0, scaling.scales)
                    results.append(
                        [h, f, scaling.scales, scaling.first, scaling.parity,
                         scaling.loss_scale, gradient_scale, stored]
                    )
                cases += 1
                for name, *got in zip(
                    ("history", "folds", "scales", "first", "parity",
                     "loss_scale", "gradient_scale", "stored"),
                    *results,
                ):
                    if not all(same(got[0], g) for g in got[1:]):
                        failures.append((length, trial, str(recipe), name))
    # The carrier's gradient from the three amaxes (`delayed.dot`'s
    # statistics on PyTorch): zeros, subnormals, the 1.75 mantissa edge,
    # inf; sizes above 2**24 (rounded to float32 alike).
    from keras_mp._fp8 import stats
    from keras_mp.backend.torch import delayed as torch_delayed

    edge = np.float32(1.75) * np.exp2(np.arange(-140, 120)).astype(np.float32)
    values = np.concatenate(
        [
            np.array([0.0, 1e-45, np.inf, 3.4e38], np.float32),
            edge,
            np.nextafter(edge, np.float32(np.inf)),
            np.abs(rng.normal(size=60)).astype(np.float32),
        ]
    )
    for trial in range(0, len(values) - 2, 3):
        amaxes = [torch.tensor(values[trial + i]).reshape(1, 1) for i in range(3)]
        parity = torch.tensor([float(trial % 2), float(1 - trial % 2)])
        sizes = (float(trial + 1), 2.0**24 + 1.0 + trial, 12345678901.0)
        results = []
        for fused in (True, False):
            torch_fp8_operands.FUSED_KERNELS = fused
            results.append(
                torch_delayed.carrier_gradient_of_amaxes(
                    amaxes,
                    sizes,
                    parity,
                    stats.HISTOGRAM_BINS,
                    stats.MANTISSA_ABOVE_1_75,
                    delayed.CARRIER_WIDTH,
                    delayed.PARITY,
                )
            )
        cases += 1
        if not torch.equal(results[0].view(torch.int32), results[1].view(torch.int32)):
            failures.append(("gradient", values[trial : trial + 3]))
    print(cases, failures)
    sys.exit(1 if failures or cases != 144 + len(values) // 3 else 0)
    """
)


_ROWWISE_SCRIPT = textwrap.dedent(
    """
    import sys

    import numpy as np
    import torch

    from keras_mp._fp8.formats.e4m3_e5m2 import quantize_reduced
    from keras_mp._fp8.formats.e4m3_e5m2 import torch_scale_constants
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands
    from keras_mp.backend import fp8 as backend_fp8
    from keras_mp.testing import fp8_reference

    # FP8 codes on the CPU, as on a CUDA device.
    backend_fp8.SCALED_MM_ON_CPU = True
    torch_fp8_operands.FORCED = "triton"
    rng = np.random.default_rng(0)
    failures = []
    cases = 0
    tiny = {torch.float32: 2.0**-140, torch.bfloat16: 2.0**-130,
            torch.float16: 2.0**-20}
    # One value, edge tiles both ways, several programs both ways.
    for shape in ((1, 1), (97, 150), (130, 64), (64, 200)):
        for source in (torch.float32, torch.bfloat16, torch.float16):
            for fmt, margin in (("e4m3", 0), ("e5m2", 0), ("e4m3", 2)):
                y = rng.normal(size=shape) * np.exp2(
                    rng.integers(-30, 30, (shape[0], 1))
                )
                if source is torch.float16:
                    y = y * 2.0**-40
                y = y.astype(np.float32)
                # A row and a column of subnormals, a zero row, NaN, inf.
                y[shape[0] // 2, :] *= tiny[source]
                if shape[0] > 2 and shape[1] > 2:
                    y[:, 1] *= tiny[source]
                    y[-1, :] = 0.0
                    y[0, 2] = np.nan
                    y[1, -1] = -np.inf
                x = torch.from_numpy(y).to(source)
                constants = torch_scale_constants(fmt, margin)
                got = torch_fp8_operands.rowwise_operands(x, fmt, *constants)
                # The same, one GEMM operand at a time (the reductions, the
                # scales and each layout's cast apart).
                torch_fp8_operands.FUSED_KERNELS = False
                (row,), row_scales = quantize_reduced(
                    x, fmt, 1, margin, None, ("row",)
                )
                (column,), column_scales = quantize_reduced(
                    x, fmt, 0, margin, None, ("column",)
                )
                torch_fp8_operands.FUSED_KERNELS = True
                values = x.float().numpy()
                magnitude = np.where(np.isnan(values), np.inf, np.abs(values))
                expected = (row, row_scales, column, column_scales)
                oracle = (
                    None,
                    fp8_reference.scale(magnitude.max(1, keepdims=True), fmt, margin),
                    None,
                    fp8_reference.scale(magnitude.max(0, keepdims=True), fmt, margin),
                )
                where = (shape, str(source), fmt, margin)
                cases += 1
                for name, a, b, c in zip(
                    ("row", "row_scales", "column", "column_scales"),
                    got,
                    expected,
                    oracle,
                ):
                    if a.dtype != b.dtype or a.shape != b.shape or (
                        a.stride() != b.stride()
                    ):
                        failures.append((*where, name, "layout"))
                    elif a.dtype == torch.float32:
                        if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                            failures.append((*where, name))
                        if a.numpy().tobytes() != c.tobytes():
                            failures.append((*where, name, "oracle"))
                    elif not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                        failures.append((*where, name))
    print(cases, failures)
    sys.exit(1 if failures or cases != 36 else 0)
    """
)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"
)
def test_the_rowwise_operands_in_two_launches_under_the_interpreter_triton():
    """A tensor's two rowwise operands in two Triton launches (the rows'
    and columns' maxima, then the scales and both layouts' codes): the
    scales bit for bit NumPy's power-of-two scales of each row's and
    column's amax (NaN as inf), and the scales and codes bit for bit those
    of one operand at a time (a reduction, the scales' kernel and a cast
    per layout), in the same layouts, from float32, bfloat16 and float16,
    both formats and a margin, through subnormal rows and columns, a
    zero row, NaN and inf, edge tiles and several programs each way."""
    run_triton_interpreted(_ROWWISE_SCRIPT)


_ROWWISE_MEMORY_SCRIPT = textwrap.dedent(
    """
    import gc
    import sys
    import weakref

    import torch

    from keras_mp import fp8
    from keras_mp._fp8 import quantizers
    from keras_mp.backend import fp8 as backend_fp8
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

    backend_fp8.SCALED_MM_ON_CPU = True
    torch_fp8_operands.FORCED = "triton"
    calls = []
    init = quantizers.Call.__init__


    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        calls.append(self)


    quantizers.Call.__init__ = recording
    kept = {}
    for role in (None, "backward"):
        w = torch.nn.Parameter(torch.randn(128, 96) * 0.1)
        h = torch.randn(64, 128).requires_grad_(True).to(torch.bfloat16)
        alive = weakref.ref(h)
        recipe = fp8.Recipe(granularity="rowwise", high_precision=role)
        y = fp8.dot(h, w, recipe, output_dtype="float32")
        del h
        gc.collect()
        # The input's column codes, made for a quantized kernel gradient
        # alone.
        kept[role] = (alive() is not None, "cx_m" in calls[-1].saved)
        y.sum().backward()
        assert torch.isfinite(w.grad).all()
    print(kept)
    # Rowwise alone holds its input's column codes, not the input; a
    # high-precision kernel gradient multiplies the input itself.
    sys.exit(0 if kept == {None: (False, True), "backward": (True, False)} else 1)
    """
)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"
)
def test_rowwise_on_the_triton_path_lets_the_bfloat16_input_go_triton():
    """Where Triton's kernel makes a rowwise GEMM's operands, the forward
    makes the input's column-scaled codes for the kernel gradient with its
    own, and the graph lets the bfloat16 input go (half its bytes held
    instead); with a high-precision backward, the input stays and no
    column codes are held."""
    run_triton_interpreted(_ROWWISE_MEMORY_SCRIPT)


_DELAYED_TRAINING_SCRIPT = textwrap.dedent(
    """
    import sys

    import keras
    import numpy as np

    import keras_mp
    from keras_mp.backend import fp8 as backend_fp8
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands
    from keras_mp.backend.torch import ops as backend_torch_ops
    from keras_mp.testing import branched_fp8_model
    from keras_mp.testing import count_torch_launches
    from keras_mp.testing import to_numpy

    # A CUDA device's path: FP8 codes, `_scaled_mm`, Triton's kernels.
    backend_fp8.SCALED_MM_ON_CPU = True
    torch_fp8_operands.FORCED = "triton"
    recipes = [
        keras_mp.fp8.Recipe(scaling="delayed", amax_history=4),
        keras_mp.fp8.Recipe(
            scaling="delayed", amax_history=3, amax_algo="most_recent"
        ),
        keras_mp.fp8.Recipe(
            scaling="delayed", amax_history=5, margin=1, formats="e4m3"
        ),
    ]


    def loss(y_true, y_pred):
        return keras.ops.sum(y_true * keras.ops.cast(y_pred, "float32"), -1)


    def run(fused, bit_ops):
        torch_fp8_operands.FUSED_KERNELS = fused
        backend_torch_ops.BIT_OPS = bit_ops
        keras.utils.set_random_seed(7)
        model = branched_fp8_model(recipes, "mixed_bfloat16", use_bias=False)
        model.compile(
            keras_mp.LossScaleOptimizer(
                keras.optimizers.Adam(1e-3),
                keras_mp.DynamicLossScale(
                    initial_loss_scale=2.0**10, increment_period=2
                ),
            ),
            loss=loss,
        )
        rng = np.random.default_rng(8)
        initial = model.get_weights()
        triton = {}
        for step in range(8):
            x = rng.normal(size=(16, 32)) * 2.0 ** rng.integers(-6, 7)
            c = rng.normal(size=(16, 2, 16)) * 2.0 ** rng.integers(
                -8, 8, (1, 2, 1)
            )
            c = c.reshape(16, 32)
            if step == 3:
                c[0, 0] = np.inf  # a skipped step
            if step == 5:
                # The state back to its start: current scales again.
                model.set_weights(initial)
            with count_torch_launches() as count:
                model.train_on_batch(x.astype("float32"), c.astype("float32"))
            triton = dict(count.triton)
        assert int(to_numpy(model.optimizer.skipped_steps)) == 1
        return {v.path: to_numpy(v) for v in model.variables}, triton


    fast, triton = run(True, True)
    # The last step's casts wrote their amaxes (no scales' kernel), in
    # four calls (one layer called twice).
    assert triton == {"fold": 4, "quantize": 12, "carrier_gradient": 4}, triton
    failures = []
    for fused, bit_ops in ((False, True), (False, False)):
        other, _ = run(fused, bit_ops)
        assert fast.keys() == other.keys()
        for path, value in fast.items():
            a = np.atleast_1d(value).view(np.uint8)
            if not np.array_equal(a, np.atleast_1d(other[path]).view(np.uint8)):
                failures.append((fused, bit_ops, path))
    print(len(fast), failures)
    sys.exit(1 if failures else 0)
    """
)


_ROWWISE_TRAINING_SCRIPT = textwrap.dedent(
    """
    import sys

    import keras
    import numpy as np

    import keras_mp
    from keras_mp.backend import fp8 as backend_fp8
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands
    from keras_mp.testing import branched_fp8_model
    from keras_mp.testing import count_torch_launches
    from keras_mp.testing import to_numpy

    backend_fp8.SCALED_MM_ON_CPU = True
    torch_fp8_operands.FORCED = "triton"
    rowwise = dict(granularity="rowwise")
    recipes = [
        keras_mp.fp8.Recipe(**rowwise),
        keras_mp.fp8.Recipe(**rowwise, save_activations="fp8"),
        keras_mp.fp8.Recipe(**rowwise, high_precision="forward"),
        keras_mp.fp8.Recipe(**rowwise, high_precision="backward"),
        keras_mp.fp8.Recipe(**rowwise, formats="e4m3", margin=1),
        keras_mp.fp8.Recipe(**rowwise, stats=True),
    ]


    def run(fused):
        torch_fp8_operands.FUSED_KERNELS = fused
        keras.utils.set_random_seed(7)
        model = branched_fp8_model(recipes, "mixed_bfloat16")
        model.compile(keras.optimizers.Adam(1e-3), loss="mse")
        rng = np.random.default_rng(8)
        for step in range(4):
            x = rng.normal(size=(16, 32)) * 2.0 ** rng.integers(-6, 7)
            y = rng.normal(size=(16, 80))
            with count_torch_launches() as count:
                model.train_on_batch(x.astype("float32"), y.astype("float32"))
        return {v.path: to_numpy(v) for v in model.variables}, dict(count.triton)


    fast, triton = run(True)
    # Two launches a tensor: the two calls' inputs and output gradients,
    # and the kernel once, of the plain layer; the others as their recipes
    # ask (none in a high-precision role, the input's again from the
    # saved codes' values).
    assert triton.get("quantize") and "scales" in triton, triton
    other, _ = run(False)
    failures = [
        path
        for path, value in fast.items()
        if not np.array_equal(
            np.atleast_1d(value).view(np.uint8),
            np.atleast_1d(other[path]).view(np.uint8),
        )
    ]
    print(len(fast), triton, failures)
    sys.exit(1 if failures or fast.keys() != other.keys() else 0)
    """
)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"
)
def test_rowwise_training_on_the_triton_kernels_gives_the_same_bits():
    """Rowwise FP8 trained on a CUDA device's path under the Triton
    interpreter, each tensor's two operands from one pass after its
    maxima (the input's second kept for the kernel gradient, the kernel's
    made once a step): every weight and optimizer variable after four
    steps is bit for bit that of one operand at a time, through a layer
    called twice, `save_activations="fp8"`, a high-precision forward or
    backward, one format and a margin, and statistics (their carrier's
    counts too)."""
    run_triton_interpreted(_ROWWISE_TRAINING_SCRIPT)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"
)
def test_delayed_training_on_the_triton_kernels_gives_the_bits_of_keras_ops():
    """Delayed scaling trained on a CUDA device's path under the Triton
    interpreter, where each cast writes its amax (no reduction of its
    own), the fold writes the layer's state in place and the carrier's
    gradient reduces the casts' maxima: every weight, history, count,
    scale, carrier and optimizer variable after eight steps is bit for bit
    that of torch's operations and that of `keras.ops`, through a layer
    called twice, both amax algorithms, a margin, a skipped step and the
    state set back to its start (the casts' amaxes alone, through
    subnormals, NaN and inf: the layouts' test above)."""
    run_triton_interpreted(_DELAYED_TRAINING_SCRIPT)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"
)
def test_the_triton_fold_gives_the_eager_fold_and_scales_under_the_interpreter():
    """Delayed scaling's fold of a carrier into the amax history and the
    history's scales in one Triton kernel: the new history, the fold count, the
    scales, the parity, the loss scale and the output gradient's scale times it
    bit for bit torch's eager operations', into new tensors or into the layer's
    state in place (with the scales it stores), over histories of 1 to 1024
    amaxes, carriers with no bin, finite bins or non-finite ones, both parity
    marks, loss scales of 0, -1 and above, and the three recipes' formats,
    margins and amax algorithms; and the carrier's gradient from a call's three
    amaxes, in one kernel too, bit for bit, across the float32 range."""
    run_triton_interpreted(_FOLD_SCRIPT)

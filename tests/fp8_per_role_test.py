"""Per-role formats (issue 33 item 5): MXFP8 with E5M2 gradient blocks
(`formats="mxfp8_hybrid"`, Transformer Engine's HYBRID MXFP8), and one
role's GEMMs in high precision (`high_precision="backward"`, TE's
`backward_override="high_precision"`; `"forward"`, e.g. NVFP4 gradients
under a high-precision forward). Each GEMM is checked bit for bit against
the backend's float32 GEMM of what that role multiplies."""

import functools

import numpy as np
import pytest

from keras_mp import fp8
from keras_mp.testing import backend_einsum
from keras_mp.testing import block_spread_operands
from keras_mp.testing import fp8_mlp_fit_and_reload
from keras_mp.testing import fp8_reference as reference
from keras_mp.testing import gemm_and_gradients
from keras_mp.testing import to_numpy

_operands = functools.partial(block_spread_operands, m=64, k=96, n=64)


def _mx(t, axis, fmt="e4m3"):
    codes, scale = reference.mx_quantize(t, axis, "rceil", fmt)
    return reference.mx_dequantize(codes, scale, axis).astype(np.float32)


def _run(recipe, x, w, g):
    return gemm_and_gradients(lambda a, b: fp8.dot(a, b, recipe), x, w, g)


def test_mxfp8_hybrid_quantizes_the_output_gradient_in_e5m2_blocks():
    x, w, g = _operands()
    out, dx, dw = _run(fp8.Recipe(formats="mxfp8_hybrid"), x, w, g)
    np.testing.assert_array_equal(
        to_numpy(out), backend_einsum("mk,kn->mn", _mx(x, 1), _mx(w, 0))
    )
    np.testing.assert_array_equal(
        to_numpy(dx), backend_einsum("mn,kn->mk", _mx(g, 1, "e5m2"), _mx(w, 1))
    )
    np.testing.assert_array_equal(
        to_numpy(dw), backend_einsum("mk,mn->kn", _mx(x, 0), _mx(g, 0, "e5m2"))
    )
    # E5M2 keeps 2 mantissa bits where E4M3 keeps 3: another result.
    _, dx_e4m3, _ = _run(fp8.Recipe(formats="mxfp8"), x, w, g)
    assert (to_numpy(dx) != to_numpy(dx_e4m3)).any()
    assert fp8.Recipe(formats="mxfp8_hybrid").backward_format == "e5m2"


def test_a_high_precision_backward_multiplies_the_unquantized_operands():
    x, w, g = _operands(seed=1)
    recipe = fp8.Recipe(formats="mxfp8", high_precision="backward")
    out, dx, dw = _run(recipe, x, w, g)
    expected_out, _, _ = _run(fp8.Recipe(formats="mxfp8"), x, w, g)
    np.testing.assert_array_equal(to_numpy(out), to_numpy(expected_out))
    np.testing.assert_array_equal(
        to_numpy(dx), backend_einsum("mn,kn->mk", g, w)
    )
    np.testing.assert_array_equal(
        to_numpy(dw), backend_einsum("mk,mn->kn", x, g)
    )


@pytest.mark.parametrize("formats", ["nvfp4", "mxfp8"])
def test_a_high_precision_forward_keeps_the_quantized_gradients(formats):
    x, w, g = _operands(seed=2)
    recipe = fp8.Recipe(formats=formats, high_precision="forward")
    out, dx, dw = _run(recipe, x, w, g)
    _, expected_dx, expected_dw = _run(fp8.Recipe(formats=formats), x, w, g)
    np.testing.assert_array_equal(
        to_numpy(out), backend_einsum("mk,kn->mn", x, w)
    )
    np.testing.assert_array_equal(to_numpy(dx), to_numpy(expected_dx))
    np.testing.assert_array_equal(to_numpy(dw), to_numpy(expected_dw))


def test_bad_combinations_raise_naming_the_fix():
    with pytest.raises(ValueError, match="reuses the forward GEMM's codes"):
        fp8.Recipe(high_precision="forward")
    with pytest.raises(ValueError, match="reuses the forward GEMM's codes"):
        fp8.Recipe(granularity="block", high_precision="forward")
    with pytest.raises(ValueError, match="no scales to keep"):
        fp8.Recipe(scaling="delayed", high_precision="backward")
    with pytest.raises(ValueError, match="no statistics to count"):
        fp8.Recipe(stats=True, high_precision="backward")
    with pytest.raises(ValueError, match="high_precision"):
        fp8.Recipe(high_precision="both")
    recipe = fp8.Recipe(granularity="rowwise", high_precision="forward")
    assert fp8.Recipe.from_config(recipe.get_config()) == recipe
    assert "high_precision" not in fp8.Recipe().get_config()


def test_a_model_trains_and_reloads_with_a_high_precision_forward(tmp_path):
    recipe = fp8.Recipe(formats="mxfp8_hybrid", high_precision="backward")
    run = fp8_mlp_fit_and_reload(recipe, tmp_path / "model.keras", outputs=4)
    assert run["fp8"][0] == (
        "current/microblock/mxfp8_hybrid backward in high precision"
    )
    assert run["losses"][-1] < run["losses"][0]
    assert run["restored_recipe"] == recipe
    np.testing.assert_array_equal(*run["predictions"])

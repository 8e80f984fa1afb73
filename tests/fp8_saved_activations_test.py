"""What an FP8 GEMM keeps for its backward (issue 34 item 2), read from
the residuals JAX saves between the forward and the backward pass.

Tensorwise FP8 keeps the forward's E4M3 codes of the layer's input (its
kernel gradient multiplies them, as the forward did): half the bytes of
the bfloat16 input a bfloat16 GEMM keeps, with gradients that are, by
construction, those of the codes. Recipes whose gradients quantize the
input again along another axis (rowwise, MXFP8, NVFP4) keep the input in
its own dtype, the argument itself: never a float32 copy.
"""

import numpy as np
import pytest

from keras_mp import fp8

pytestmark = pytest.mark.backends("jax")

M, K, N = 256, 512, 512


def _residuals(function, x, w):
    from jax._src.ad_checkpoint import saved_residuals

    return saved_residuals(function, x, w)


def _input_residuals(function):
    """`(dtype, bytes, description)` of the saved residuals of the
    input's shape."""
    import jax.numpy as jnp

    x = jnp.ones((M, K), jnp.bfloat16)
    w = jnp.ones((K, N), jnp.float32)
    found = []
    for aval, description in _residuals(function, x, w):
        if tuple(aval.shape) == (M, K):
            nbytes = int(np.prod(aval.shape)) * aval.dtype.itemsize
            found.append((str(aval.dtype), nbytes, description))
    return found


def _loss(recipe):
    import jax.numpy as jnp

    if recipe is None:
        return lambda x, w: jnp.sum(x @ w.astype(jnp.bfloat16))
    return lambda x, w: jnp.sum(fp8.dot(x, w, recipe).astype(jnp.float32))


def test_tensorwise_keeps_the_input_as_e4m3_codes_half_of_bfloat16():
    bfloat16 = _input_residuals(_loss(None))
    tensorwise = _input_residuals(_loss(fp8.Recipe()))
    assert [(dtype, n) for dtype, n, _ in bfloat16] == [("bfloat16", M * K * 2)]
    assert [(dtype, n) for dtype, n, _ in tensorwise] == [
        ("float8_e4m3fn", M * K)
    ]
    ratio = tensorwise[0][1] / bfloat16[0][1]
    assert ratio == 0.5  # issue 34's target: at most 0.55


@pytest.mark.parametrize(
    "recipe",
    [
        fp8.Recipe(granularity="rowwise"),
        fp8.Recipe(formats="mxfp8"),
        fp8.Recipe(formats="nvfp4"),
    ],
    ids=["rowwise", "mxfp8", "nvfp4"],
)
def test_requantizing_recipes_keep_the_input_itself_never_a_float32_copy(
    recipe,
):
    residuals = _input_residuals(_loss(recipe))
    assert residuals, "the kernel gradient needs the input"
    for dtype, _, description in residuals:
        assert dtype == "bfloat16", residuals
        assert "argument x" in description, residuals

"""`keras_mp.testing.count_torch_launches`: the kernel launches of a PyTorch
step, counted on a CPU (issue 46).

Each ATen operation that queues a kernel counts one launch; views and
allocations count none; a Triton launch counts one, and what Triton's
launcher dispatches inside it counts nothing. The counts of a Keras step are
the same from one step to the next, so a budget per step can be asserted.
"""

import functools
import importlib.util

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.testing import count_torch_launches
from keras_mp.testing import run_triton_interpreted

pytestmark = pytest.mark.backends("torch")


def test_kernels_are_counted_and_views_are_not():
    import torch

    x = torch.ones(4, 4)
    with count_torch_launches() as count:
        y = x * 2  # one kernel
        y = y.view(16)  # a view
        y = y.reshape(4, 4).t()  # views
        z = torch.empty(3)  # an allocation without a fill
        y = y + 1  # one kernel
        total = y.sum()  # one kernel
        float(total)  # a scalar read: a host sync, not a launch
    assert z.shape == (3,)
    assert dict(count.ops) == {"aten::mul": 1, "aten::add": 1, "aten::sum": 1}
    assert count.launches == 3
    assert count.views == 5
    assert not count.triton
    # Nothing is counted once the context has closed.
    x * 2
    assert count.launches == 3


def _train_on_batch_counts(policy, fp8, steps=3):
    keras.utils.set_random_seed(0)
    with keras_mp.policy_scope(policy, fp8=fp8):
        model = keras.Sequential(
            [
                keras.Input((32,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(32),
                keras.layers.Dense(4, dtype="float32"),
            ]
        )
    model.compile(keras.optimizers.Adam(1e-3), loss="mse")
    x = np.random.default_rng(0).normal(size=(16, 32)).astype("float32")
    y = np.zeros((16, 4), "float32")
    # The first step builds the optimizer; the second still makes what an
    # FP8 step makes once (61 more launches for two FP8 layers on
    # 2026-11-28), and the steps after it are all alike.
    for _ in range(2):
        model.train_on_batch(x, y)
    counts = []
    for _ in range(steps):
        with count_torch_launches() as count:
            model.train_on_batch(x, y)
        counts.append(count)
    return counts


@pytest.mark.parametrize("fp8", [None, True], ids=["bf16", "fp8"])
def test_a_keras_step_counts_the_same_launches_every_step(fp8):
    counts = _train_on_batch_counts("mixed_bfloat16", fp8)
    assert counts[0].launches > 0
    assert [c.launches for c in counts] == [counts[0].launches] * len(counts)
    assert [c.ops for c in counts[1:]] == [counts[0].ops] * (len(counts) - 1)


def test_fp8_layers_add_launches_over_bf16():
    """The counter sees what issue 46 measures: the FP8 layers' quantization
    adds work to a step (the budgets tighten as the fast paths land)."""
    bf16 = _train_on_batch_counts("mixed_bfloat16", None, steps=1)[0]
    fp8 = _train_on_batch_counts("mixed_bfloat16", True, steps=1)[0]
    assert fp8.launches > bf16.launches


_TRITON_SCRIPT = """
    import torch

    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands
    from keras_mp.testing import count_torch_launches

    torch_fp8_operands.FORCED = "triton"
    x = torch.linspace(-3, 3, 64 * 48).reshape(64, 48)
    scale = torch.tensor(1.0)
    torch_fp8_operands.encode(x, scale, "e4m3", ("row", "column"))  # compiles
    with count_torch_launches() as count:
        torch_fp8_operands.encode(x, scale, "e4m3", ("row", "column"))
    print((dict(count.triton), dict(count.ops)))
    """


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"
)
def test_a_triton_launch_counts_one_under_the_interpreter():
    """Under `TRITON_INTERPRET=1` the interpreter runs the kernel with torch
    and NumPy on the host; the counter takes it as the one launch it is on
    a GPU. In a fresh process, as `torch_fp8_operands_test.py` explains
    (`.ci/run` installs Triton for this check and that one)."""
    stdout = run_triton_interpreted(_TRITON_SCRIPT)
    triton, ops = eval(stdout.strip().splitlines()[-1])
    # One kernel writes both layouts, the scale's reciprocal made inside
    # it, and nothing the interpreter runs inside is counted.
    assert triton == {"quantize": 1}, stdout
    assert ops == {}, stdout


_DOT_BUDGET_SCRIPT = """
    import torch

    import keras_mp
    from keras_mp.backend import fp8 as backend_fp8
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands
    from keras_mp.testing import count_torch_launches

    # The path a CUDA device takes: FP8 codes, `_scaled_mm`, Triton's
    # kernels (run by the interpreter, counted as the launches they are).
    backend_fp8.SCALED_MM_ON_CPU = True
    torch_fp8_operands.FORCED = "triton"
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(128, 96, requires_grad=True)

    def step(product):
        with torch.no_grad():
            w.add_(0.0)  # the optimizer's write: the kernel's codes anew
        y = product()
        return torch.autograd.grad(y, (x, w), torch.ones_like(y))

    products = {
        "bf16": lambda: x @ w.to(torch.bfloat16),
        "tensorwise": lambda: keras_mp.fp8.dot(
            x, w, keras_mp.fp8.Recipe(), output_dtype="bfloat16"
        ),
    }
    counts = {}
    for name, product in products.items():
        step(product)
        step(product)
        with count_torch_launches() as count:
            step(product)
        counts[name] = (count.launches, dict(count.ops), dict(count.triton))
    print(counts)
    """


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"
)
def test_a_tensorwise_fp8_layer_adds_at_most_12_launches_a_step_triton():
    """Issue 46's first budget: an FP8 current tensorwise GEMM, forward and
    both gradients with its kernel updated in between, adds at most 12
    kernel launches to the bf16 GEMM's, counted on a CUDA device's path
    under the Triton interpreter. Each of its three operands is one
    reduction, one kernel of its scale and reciprocal
    (`torch/fp8_operands.scales`) and one of its codes; each GEMM takes
    its scale factor from one multiply: 10 added. (63 before the scales'
    kernel: a dozen and a half eager operations an operand.)"""
    stdout = run_triton_interpreted(_DOT_BUDGET_SCRIPT)
    counts = eval(stdout.strip().splitlines()[-1])
    (bf16, _, _), (fp8, ops, triton) = counts["bf16"], counts["tensorwise"]
    assert triton == {"scales": 3, "quantize": 3}, counts
    # A CPU reduces `|x|` in two operations where CUDA runs one infinity
    # norm (`torch/ops.largest_magnitudes`): the CUDA path's count.
    fp8 -= ops.get("aten::abs", 0)
    assert fp8 - bf16 <= 12, counts


_RECIPE_BUDGET_SCRIPT = """
    import collections

    import keras
    import numpy as np

    import keras_mp
    from keras_mp.backend import fp8 as backend_fp8
    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands
    from keras_mp.testing import count_torch_launches

    backend_fp8.SCALED_MM_ON_CPU = True
    torch_fp8_operands.FORCED = "triton"


    def step_counts(fp8, layers):
        keras.utils.set_random_seed(0)
        with keras_mp.policy_scope("mixed_bfloat16", fp8=fp8):
            model = keras.Sequential(
                [keras.Input((32,))]
                + [keras.layers.Dense(32) for _ in range(layers)]
                # The output layer stays out of FP8 (the default rules).
                + [keras.layers.Dense(4)]
            )
        fp8_layers = sum(
            1 for layer in model.layers if layer.dtype_policy.fp8 is not None
        )
        model.compile(keras.optimizers.Adam(1e-3), loss="mse")
        x = np.random.default_rng(0).normal(size=(32, 32)).astype("float32")
        y = np.zeros((32, 4), "float32")
        for _ in range(3):
            model.train_on_batch(x, y)
        with count_torch_launches() as count:
            model.train_on_batch(x, y)
        # A CPU reduces `|x|` in two operations where CUDA runs one
        # infinity norm (`torch/ops.largest_magnitudes`): CUDA's count.
        launches = count.launches - count.ops.get("aten::abs", 0)
        return fp8_layers, launches, dict(count.triton)


    recipes = {
        "current": True,
        "delayed": keras_mp.fp8.Recipe(scaling="delayed"),
        "rowwise": keras_mp.fp8.Recipe(granularity="rowwise"),
    }
    counts = {}
    for layers in (2, 8):
        counts[layers] = {
            name: step_counts(recipe, layers) for name, recipe in recipes.items()
        }
    print(counts)
    """


@functools.cache
def _recipe_counts():
    """`(FP8 layers, launches, Triton launches)` of a step per recipe, for
    models of 2 and 8 FP8 layers (one interpreted run for both budgets)."""
    stdout = run_triton_interpreted(_RECIPE_BUDGET_SCRIPT)
    return eval(stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"
)
def test_a_delayed_step_costs_at_most_16_launches_over_current_triton():
    """Issue 46's second budget: a step of delayed scaling costs at most 16
    kernel launches more than a step of current scaling, with 2 FP8
    layers as with 8, counted on a CUDA device's path under the Triton
    interpreter. Transformer Engine's way: each cast takes its scale from
    the layer's state and writes its amax in the same pass (no reduction,
    no scales' kernel), and the fold writes the state in place; what a
    delayed layer adds per step is its fold, its carrier's gradient, the
    optimizer's assignment of the carrier and the loss scale written into
    it. (Before: 8 launches a layer more than current, 56 for 8 layers.)"""
    counts = _recipe_counts()
    for layers, variants in counts.items():
        (fp8_layers, current, _), (same, delayed, triton) = (
            variants["current"],
            variants["delayed"],
        )
        assert fp8_layers == same == layers, counts
        # Each operand one cast, no scales' kernel: the amax from the cast.
        assert triton == {
            "fold": layers,
            "quantize": 3 * layers,
            "carrier_gradient": layers,
        }, counts
        assert delayed - current <= 16, counts


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"
)
def test_a_rowwise_layer_adds_at_most_4_launches_over_tensorwise_triton():
    """Issue 46's third budget: a rowwise FP8 layer adds at most 4 kernel
    launches a step to a tensorwise (current) one, counted on a CUDA
    device's path under the Triton interpreter. Each of its three tensors
    is two launches (`torch/fp8_operands.rowwise_operands`: the rows' and
    columns' maxima, then the scales and both layouts' codes, the kernel's
    once a step), read in 16 bits; its GEMMs take their scales as vectors.
    (Before: 17 a layer over tensorwise, counted on a CPU; 14 on CUDA.)"""
    counts = _recipe_counts()
    for layers, variants in counts.items():
        (fp8_layers, current, _), (same, rowwise, triton) = (
            variants["current"],
            variants["rowwise"],
        )
        assert fp8_layers == same == layers, counts
        assert triton == {"quantize": 6 * layers}, counts
        assert rowwise - current <= 4 * layers, counts

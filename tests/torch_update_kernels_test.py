"""`keras_mp.backend.torch.update_kernels`: Adam's update of bfloat16,
float16 and float8 state in one Triton kernel per variable (CUDA's path),
bit for bit the batch path of in-place calls and the update Keras's
`update_step` makes with the same state (the per-variable path), NaNs by
place; the batch path where the kernel cannot build; issue 46's budget of
launches.

The kernels run under `TRITON_INTERPRET=1` in a fresh process
(`keras_mp.testing.run_triton_interpreted`)."""

import importlib.util
import json
import textwrap

import numpy as np
import pytest

from keras_mp.testing import run_triton_interpreted

pytestmark = pytest.mark.backends("torch")
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"
)


# Trains one optimizer setting three ways (the kernel, the batch path, and
# Keras's `update_step` per variable) and compares every variable's bits.
_SCRIPT = textwrap.dedent(
    """
    import sys

    import keras
    import ml_dtypes
    import numpy as np
    from keras import ops

    import keras_mp
    from keras_mp.backend.torch import fp8_operands
    from keras_mp.backend.torch import fused_state_update
    from keras_mp.backend.torch import update_kernels
    from keras_mp.testing import count_torch_launches

    import torch
    from triton.runtime import interpreter

    fp8_operands.FORCED = "triton"
    # The kernel's square root is the correctly rounded one (`sqrt_rn`), as
    # torch's CUDA `sqrt` is; torch's CPU `sqrt` is not (1 ulp off on some
    # inputs), and the interpreter's is NumPy's: here it is torch's, so
    # that the comparison with the CPU's torch paths checks the rest.
    interpreter.InterpreterBuilder.create_precise_sqrt = (
        lambda self, arg: self.unary_op(
            arg, lambda a: torch.from_numpy(a).sqrt().numpy()
        )
    )
    OPTIMIZERS = {
        "adam": lambda: keras.optimizers.Adam(0.01),
        "amsgrad": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
        "adamw": lambda: keras.optimizers.AdamW(
            0.01, weight_decay=0.01, epsilon=1e-30
        ),
        # The moments are the gradient and its square: ties of 16-bit
        # rounding where the gradients are ties (below).
        "ties": lambda: keras.optimizers.Adam(0.01, beta_1=0.0, beta_2=0.0),
    }
    # Sizes: a scalar, sizes that fill no program of 1024, several programs;
    # the last variable's gradients are ties of bfloat16 and float16.
    SHAPES = [(), (7,), (3, 5), (2100,), (41, 3), (64,)]


    def ties(rng):
        # Halfway between two bfloat16 values (low half 0x8000), then
        # halfway between two float16 values, both parities of each.
        upper = rng.integers(0x3C00, 0x4400, 32).astype(np.uint32)
        bfloat16 = ((upper << 16) | 0x8000).view(np.float32)
        half = rng.uniform(0.5, 4, 32).astype(np.float16).astype(np.float32)
        ulp = np.spacing(half.astype(np.float16)).astype(np.float32)
        return np.concatenate([bfloat16, half + ulp / 2])


    def gradients(rng, step):
        grads = []
        for shape in SHAPES:
            # 8 decades, and near bfloat16's subnormals: g * g and the
            # moments pass below float32's smallest normal.
            g = rng.normal(size=shape).astype("float32")
            g = g * np.float32(10.0 ** rng.integers(-6, 2))
            if shape == (41, 3):
                g = g * np.float32(1e-20)
            if shape == (64,):
                g = ties(rng)
            grads.append(g)
        if step == 2:
            grads[3][[5, 7, 1500, 2099]] = [np.nan, -np.inf, np.inf, 3e38]
        return grads


    def trained(name, state_dtype, stochastic, path):
        update_kernels.UPDATE_KERNELS = path == "kernel"
        fused_state_update.FUSED_TORCH_UPDATES = path != "update_step"
        keras.utils.set_random_seed(1)
        optimizer = keras_mp.OptimizerWrapper(
            OPTIMIZERS[name](),
            state_dtype=state_dtype,
            stochastic_rounding=stochastic,
        )
        rng = np.random.default_rng(0)
        variables = [
            keras.Variable(rng.normal(size=s).astype("float32"))
            for s in SHAPES
        ]
        launches = []
        for step in range(4):
            grads = [ops.convert_to_tensor(g) for g in gradients(rng, step)]
            with count_torch_launches() as count:
                optimizer.apply(grads, variables)
            launches.append(count)
        values = [
            ops.convert_to_numpy(v).reshape(-1)
            for v in variables + optimizer.variables
        ]
        return values, [v.path for v in optimizer.variables], launches


    def same(a, b):
        # Equal bits, where the NaNs are equal (a NaN's sign and payload
        # are the device's arithmetic's: NumPy's here, torch's vector loops
        # there).
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
            nan = np.isnan(a.astype(np.float32))
            if not np.array_equal(nan, np.isnan(b.astype(np.float32))):
                return False
            a, b = a[~nan], b[~nan]
        return np.array_equal(a.view(np.uint8), b.view(np.uint8))


    failures = []
    for name in OPTIMIZERS:
        for state_dtype, stochastic in [
            ("bfloat16", True),
            ("bfloat16", False),
            ("float16", False),
            ("float8", True),
            ("float8", False),
        ]:
            setting = f"{name} {state_dtype} stochastic={stochastic}"
            kernel, paths, launches = trained(
                name, state_dtype, stochastic, "kernel"
            )
            # One launch a variable, each step (float8 state with amsgrad
            # runs per variable, as on every device).
            float8 = state_dtype == "float8"
            kernel_name = "adam_float8" if float8 else "adam_16bit"
            expected = 0 if float8 and name == "amsgrad" else len(SHAPES)
            for count in launches:
                if count.triton[kernel_name] != expected:
                    failures.append(f"{setting}: launches {count.triton}")
            batch, _, _ = trained(name, state_dtype, stochastic, "batch")
            keras_own, _, _ = trained(
                name, state_dtype, stochastic, "update_step"
            )
            names = ["variable"] * len(SHAPES) + paths
            for other, label in [(batch, "batch"), (keras_own, "update_step")]:
                for path, a, b in zip(names, kernel, other):
                    if not same(a, b):
                        bytes_a, bytes_b = a.view(np.uint8), b.view(np.uint8)
                        where = np.flatnonzero(bytes_a != bytes_b)[:3]
                        where = where // a.itemsize
                        failures.append(
                            f"{setting}: {label} differs at {path} "
                            f"{a.shape} {where} {a[where]} {b[where]}"
                        )
    print("\\n".join(failures))
    sys.exit(1 if failures else 0)
    """
)


@needs_triton
def test_the_triton_adam_kernel_gives_update_step_bits():
    """bfloat16 state stochastically and to nearest, float16 state; Adam,
    amsgrad and AdamW; NaN, inf, float32's largest values and subnormal
    moments: the kernel's variables and slots are the per-variable path's
    and the batch path's bits (float16's NaN payloads aside), one launch
    a variable and step."""
    run_triton_interpreted(_SCRIPT)


def test_a_failing_update_kernel_warns_and_the_batch_path_runs(monkeypatch):
    """Where the kernel cannot build, one warning, and the batch path makes
    the same bits, the seed drawn once: no half-applied update."""
    import keras
    from keras import ops

    import keras_mp
    from keras_mp.backend.torch import fp8_operands
    from keras_mp.backend.torch import update_kernels
    from keras_mp.testing import assert_bitwise_equal
    from keras_mp.testing import to_numpy

    def trained():
        keras.utils.set_random_seed(1)
        optimizer = keras_mp.OptimizerWrapper(
            keras.optimizers.Adam(0.01),
            state_dtype="bfloat16",
            stochastic_rounding=True,
        )
        variable = keras.Variable(np.linspace(-1, 1, 300, dtype="float32"))
        for step in range(3):
            gradient = np.cos(np.arange(300, dtype="float32") * (step + 1))
            optimizer.apply([ops.convert_to_tensor(gradient)], [variable])
        return [to_numpy(v) for v in [variable] + optimizer.variables]

    monkeypatch.setattr(update_kernels, "UPDATE_KERNELS", False)
    expected = trained()

    def failing(*arguments):
        raise RuntimeError("no such PTX instruction")

    monkeypatch.setattr(update_kernels, "UPDATE_KERNELS", True)
    monkeypatch.setattr(fp8_operands, "_failed", set())
    monkeypatch.setattr(fp8_operands, "implementation_for", lambda x: "triton")
    monkeypatch.setattr(update_kernels, "_triton_adam", failing)
    with pytest.warns(UserWarning, match="kernel of the optimizer update"):
        got = trained()
    assert "triton_adam" in fp8_operands._failed
    for a, b in zip(got, expected):
        assert_bitwise_equal(a, b)


_BUDGET_SCRIPT = textwrap.dedent(
    """
    import json

    import keras
    import numpy as np
    from keras import ops

    import keras_mp
    from keras_mp.backend.torch import fp8_operands
    from keras_mp.testing import count_torch_launches

    import triton  # noqa: F401 (the launch counter counts its launches)

    fp8_operands.FORCED = "triton"


    def launches(variables, state_dtype):
        keras.utils.set_random_seed(0)
        optimizer = keras.optimizers.Adam(1e-3)
        if state_dtype is not None:
            optimizer = keras_mp.OptimizerWrapper(
                optimizer, state_dtype=state_dtype
            )
        rng = np.random.default_rng(0)
        weights = [
            keras.Variable(rng.normal(size=(64, 3)).astype("float32"))
            for _ in range(variables)
        ]
        grads = [ops.convert_to_tensor(rng.normal(size=(64, 3)).astype("float32"))
                 for _ in range(variables)]
        for _ in range(2):
            optimizer.apply(grads, weights)
        with count_torch_launches() as count:
            optimizer.apply(grads, weights)
        return {"launches": count.launches, "triton": dict(count.triton)}


    print(json.dumps({
        f"{state} {n}": launches(n, None if state == "float32" else state)
        for state in ("float32", "bfloat16", "float16", "float8")
        for n in (4, 16)
    }))
    """
)


@needs_triton
def test_low_precision_state_adds_at_most_2_launches_a_variable_triton():
    """Issue 46's budget on CUDA's path: with bfloat16 (stochastically
    rounded), float16 or float8 state, an Adam update launches at most 2
    kernels per variable more than Keras's own Adam on float32 state, for 4
    and 16 variables (before the kernels: 11 and 99 a variable on the
    launch benchmark's GPT-2)."""
    stdout = run_triton_interpreted(_BUDGET_SCRIPT)
    counts = json.loads(stdout.strip().splitlines()[-1])
    for state_dtype in ("bfloat16", "float16", "float8"):
        kernel = "adam_float8" if state_dtype == "float8" else "adam_16bit"
        for n in (4, 16):
            ours = counts[f"{state_dtype} {n}"]
            plain = counts[f"float32 {n}"]
            assert ours["triton"] == {kernel: n}, counts
            assert ours["launches"] - plain["launches"] <= 2 * n, counts


def test_a_variable_past_int32_indices_takes_the_batch_path(monkeypatch):
    """The kernels index elements in int32: an update with a variable of
    `_LARGEST` elements or more runs whole on the batch path, no kernel
    launched for any of its variables."""
    import keras
    from keras import ops

    import keras_mp
    from keras_mp.backend.torch import fp8_operands
    from keras_mp.backend.torch import update_kernels

    launches = []

    def launched(*arguments):
        launches.append(arguments)
        raise RuntimeError("the kernel was launched")

    monkeypatch.setattr(fp8_operands, "_failed", set())
    monkeypatch.setattr(fp8_operands, "implementation_for", lambda x: "triton")
    monkeypatch.setattr(update_kernels, "_triton_adam", launched)
    monkeypatch.setattr(update_kernels, "_LARGEST", 300)
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(0.01), state_dtype="bfloat16"
    )
    variables = [
        keras.Variable(np.ones(size, dtype="float32")) for size in (3, 300)
    ]
    grads = [ops.ones((size,)) for size in (3, 300)]
    optimizer.apply(grads, variables)
    assert not launches
    assert float(ops.convert_to_numpy(variables[1])[0]) < 1.0

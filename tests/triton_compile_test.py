"""keras_mp's Triton kernels compile for a Hopper GPU, on the CPU.

Triton's interpreter (`TRITON_INTERPRET=1`) runs a kernel's Python on the
host: the bit-for-bit tests of the other `*_triton` tests use it. It never
runs Triton's compiler, so a kernel the interpreter runs may still fail to
build on a GPU (a construct the compiler's front end refuses, a type it
cannot lower), and there keras_mp would warn and hand over to a slower
path. Triton's wheel carries its CUDA back end and `ptxas`: a kernel
compiles to a cubin for sm_90 (H100, H200) without a GPU. This test runs
every path that launches a keras_mp kernel under the interpreter,
records each launch's argument types and compile-time constants, and
compiles every variant launched for sm_90.
"""

import importlib.util
import pathlib
import textwrap

import pytest

import keras_mp
from keras_mp.testing import run_python
from keras_mp.testing import run_triton_interpreted

pytestmark = [
    pytest.mark.backends("torch"),
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="needs triton"
    ),
]

_SCRIPT = textwrap.dedent(
    """
    import sys

    import keras
    import numpy as np
    import torch
    from triton.runtime import interpreter

    import keras_mp
    from keras_mp.backend import fp8 as backend_fp8
    from keras_mp.backend.torch import fp8_operands

    # Every launch: the kernel's function, its arguments and options.
    launches = []
    run = interpreter.InterpretedFunction.run


    def recording(self, *args, grid, warmup, **kwargs):
        launches.append((self.fn, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)


    interpreter.InterpretedFunction.run = recording
    backend_fp8.SCALED_MM_ON_CPU = True
    fp8_operands.FORCED = "triton"

    # The paths that launch a kernel: FP8 layers under each recipe with
    # 16-bit and float8 Adam state, and amsgrad.
    recipes = [
        True,
        keras_mp.fp8.Recipe(scaling="delayed"),
        keras_mp.fp8.Recipe(scaling="delayed", amax_algo="most_recent"),
        keras_mp.fp8.Recipe(granularity="rowwise"),
        keras_mp.fp8.Recipe(formats="e4m3"),
    ]
    states = [
        ("bfloat16", True, False),
        ("bfloat16", False, True),
        ("float16", False, False),
        ("float8", True, False),
    ]
    for recipe, (state, stochastic, amsgrad) in zip(recipes, states + states):
        keras.utils.set_random_seed(0)
        with keras_mp.policy_scope("mixed_bfloat16", fp8=recipe):
            model = keras.Sequential(
                [keras.Input((32,)), keras.layers.Dense(48), keras.layers.Dense(4)]
            )
        model.compile(
            keras_mp.OptimizerWrapper(
                keras.optimizers.Adam(1e-3, amsgrad=amsgrad),
                state_dtype=state,
                stochastic_rounding=stochastic,
            ),
            loss="mse",
        )
        x = np.random.default_rng(0).normal(size=(16, 32)).astype("float32")
        for _ in range(3):
            model.train_on_batch(x, np.zeros((16, 4), "float32"))
    # The casts from float32 and float16 too, and E5M2's.
    for dtype in (torch.float32, torch.float16):
        t = torch.randn(40, 24).to(dtype)
        fp8_operands.encode(t, torch.tensor(0.5), "e5m2", ("row", "column"))

    TYPES = {
        torch.float32: "fp32",
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.int16: "i16",
        torch.int32: "i32",
        torch.int64: "i64",
        torch.uint8: "u8",
        torch.bool: "i1",
    }


    def type_of(value):
        if isinstance(value, torch.Tensor):
            return "*" + TYPES[value.dtype]
        if isinstance(value, bool):
            return "i1"
        if isinstance(value, int):
            return "i32" if -(2**31) <= value < 2**31 else "i64"
        if isinstance(value, float):
            return "fp32"
        raise TypeError(f"an argument of type {type(value)}")


    variants = set()
    for fn, args, kwargs in launches:
        names = list(fn.__code__.co_varnames[: fn.__code__.co_argcount])
        signature = {}
        for name, value in zip(names, args):
            signature[name] = type_of(value)
        constants = {k: v for k, v in kwargs.items() if k in names}
        for name in constants:
            signature[name] = "constexpr"
        if list(signature) != names:
            raise AssertionError(f"{fn.__name__}: arguments {list(signature)}")
        # Launch options (`num_warps`, `enable_fp_fusion`) are no argument
        # of the kernel's.
        options = {k: v for k, v in kwargs.items() if k not in names}
        variants.add(
            (
                fn.__name__,
                tuple(signature.items()),
                tuple(sorted(constants.items())),
                tuple(sorted(options.items())),
            )
        )
    print(sorted(variants))
    """
)

# Compiled in a process without the interpreter (which patches
# `triton.language`): each kernel from the factory that makes it.
_COMPILE_SCRIPT = """
    import sys

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from keras_mp.backend.torch import delayed
    from keras_mp.backend.torch import fp8_operands
    from keras_mp.backend.torch import update_kernels

    FACTORIES = {
        "quantize": fp8_operands._triton_kernel,
        "scales": fp8_operands._triton_scales_kernel,
        "fold": delayed._triton_fold_kernel,
        "carrier_gradient": delayed._make_gradient_kernel,
        "adam_16bit": update_kernels._adam_kernel,
        "adam_float8": update_kernels._float8_kernel,
    }
    compiled = {}
    failures = []
    target = GPUTarget("cuda", 90, 32)
    for name, signature, constants, options in VARIANTS:
        kernel = FACTORIES[name]()
        source = ASTSource(
            fn=kernel, signature=dict(signature), constexprs=dict(constants)
        )
        try:
            binary = triton.compile(source, target=target, options=dict(options))
            assert binary.asm["cubin"], "no cubin"
        except Exception as error:
            failures.append((name, constants, str(error)[-1500:]))
        else:
            compiled[name] = compiled.get(name, 0) + 1
    print(compiled)
    print(failures)
    sys.exit(1 if failures else 0)
    """


def test_every_triton_kernel_variant_launched_compiles_for_sm90_triton():
    """Each kernel keras_mp launches on a CUDA device's paths (the FP8
    operands' casts, scales and rowwise operands, delayed scaling's fold
    and statistics, Adam's update of 16-bit and float8 state), with the
    argument types and compile-time constants those paths give it,
    compiles to a cubin for sm_90: what the interpreter's bit-for-bit
    tests cannot check."""
    stdout = run_triton_interpreted(_SCRIPT)
    variants = stdout.strip().splitlines()[-1]
    package = pathlib.Path(keras_mp.__file__).resolve().parents[1]
    stdout = run_python(
        textwrap.dedent(_COMPILE_SCRIPT).replace(
            "import sys", f"import sys\nVARIANTS = {variants}", 1
        ),
        env={
            "KERAS_BACKEND": "torch",
            "TRITON_INTERPRET": "0",
            "PYTHONPATH": str(package),
        },
        timeout=900,
    )
    compiled = eval(stdout.strip().splitlines()[-2])
    assert set(compiled) == {
        "quantize",
        "scales",
        "fold",
        "carrier_gradient",
        "adam_16bit",
        "adam_float8",
    }, compiled

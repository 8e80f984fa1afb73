"""FP8 against 16-bit on a GPU, every section of issue 32 in one process.

`benchmarks/gpu/run.sh` runs this once per backend (torch, then jax) on a
GPU machine with no Keras and no package index; `--smoke` runs every
section at toy sizes on the CPU (`tests/gpu_benchmark_test.py`), so the
script cannot rot between GPU runs. Sections:

- (a) `gemm`: the GEMM ceiling, bfloat16 against FP8 codes (E4M3 x E4M3)
  at 8192^3, (8192, 4096, 16384), (8192, 16384, 4096), (1024, 2048,
  1024); FP8 with a float32 and a bfloat16 result, and on torch with fast
  accumulation.
- (b) `quantize`: GB/s of an 8192^2 bfloat16 tensor made E4M3 codes
  (amax, scale, cast), and made codes in the transposed layout too, per
  candidate path (bytes = the bfloat16 input read once): on torch also
  the amax alone, `fp8.dot`'s operand pass alone and the Triton kernel's
  other tiles and warps, and a check that the device's operand pass gives
  the eager copies' codes for every bfloat16 bit pattern.
- (c) `dot`: `keras_mp.fp8.dot` forward + backward against a bfloat16
  matmul's, at (M, K, N) = (8192, 4096, 16384); on torch a
  `torch.profiler` summary of one call of each (`PROFILES`), whether a
  rowwise GEMM gives the same bits with its scales in `_scaled_mm`
  (`rowwise_in_gemm_bits_agree`), and whether delayed and rowwise
  training give the same bits with the fused FP8 kernels as with torch's
  operations between the casts (`fused_kernel_bits_agree`).
- (d) `decoder`: a pre-LN GPT decoder training step (d=4096, 4 layers,
  32 heads, sequence 2048, batch 8: 16k tokens; vocabulary 8192; inputs
  on the device) under mixed_bfloat16, and FP8 current tensorwise,
  delayed tensorwise and current rowwise, with peak memory and, on
  torch, host syncs per step (`count_host_syncs`, and on CUDA the
  synchronizing calls PyTorch's sync debug mode reports: a blocking copy
  from the host too) and a profile of one step of each variant.
- (e) `policies`: the same decoder at d=1024 (2 layers) in float32,
  mixed_bfloat16 and mixed_float16, with Keras alone (timed before
  keras_mp is imported) and with keras_mp, the keras_mp variants in
  paired rounds; mixed_bfloat16 with `keras_mp.LossScaleOptimizer`
  against the plain optimizer (on torch also `skip_on_device=True`); on
  torch,
  host syncs per step (`keras_mp.testing.count_host_syncs`; Keras's
  `train_on_batch` reads its loss, so 1 is the floor).
- (f) `hlo` (JAX only): the compiled FP8 decoder step's optimized HLO:
  FP8 GEMM custom calls, float16 GEMMs, float32-output GEMMs, FP8
  transposes; and the FP8 dots before optimization.
- (g) `state`: Adam's state in float32, bfloat16 and float8
  (`keras_mp.OptimizerWrapper(state_dtype=...)`, issue 34) on the (e)
  decoder under mixed_bfloat16: step time, state bytes per parameter read
  from the variables, device memory held after a step, the allocator's
  peak and, on JAX, the compiled step's own peak (XLA's
  `memory_analysis()`: its temporaries included, the process's earlier
  peaks not). On torch also `bfloat16_batch` and `float8_batch`: the same
  states updated by the batch path of in-place calls instead of one
  Triton kernel a variable (`backend/torch/update_kernels.py`, issue 46
  item 4), side by side; and whether the two give the same bits on the
  device (`update_kernel_bits_agree`).
- (h) `gpt2`: a GPT-2-small-shaped model (12 layers, 12 heads, d=768) on
  bytes (vocabulary 256: about 85M parameters, GPT-2's 124M less its
  50257-token embedding), sequence 512, batch 16, trained for a fixed 30
  steps under mixed_bfloat16, FP8 current tensorwise and MXFP8, from the
  same float32 weights on the same batches: `benchmarks/convergence.py`'s
  data (the standard library's bytes), model (keras-hub's `GPT2Backbone`),
  optimizer and variants, imported. One row per variant: the last step's
  training loss (and its gap to mixed_bfloat16's), tokens per second (the
  median step after two warm-up steps), the first step's seconds, and
  where `keras_mp.fp8.is_available` says the recipe's GEMMs run emulated
  (MXFP8 on Hopper), why.

Each section has a share of `--budget` seconds (what a section leaves
unused passes on) and checks it between measurements: a section out of
time stops, keeps what it measured, and says so; a section that fails
records its error, and a candidate of a paired measurement that fails or
finds no time left in its warm-up is dropped with the reason (`--smoke`
re-raises every error). Results go to
`$OUT/<backend>.json` after every section; `--table` merges the JSON files
of a directory into `table.md`.

    KERAS_BACKEND=jax python benchmarks/gpu/fp8_speed.py --out /tmp/out
    KERAS_BACKEND=torch python benchmarks/gpu/fp8_speed.py --smoke
    python benchmarks/gpu/fp8_speed.py --table /tmp/out
"""

import argparse
import contextlib
import functools
import gc
import json
import os
import pathlib
import re
import statistics
import sys
import time
import traceback

# Where the decoder's sizes come from: full run / --smoke.
SIZES = {
    "gemm": (
        [
            (8192, 8192, 8192),
            (8192, 4096, 16384),
            (8192, 16384, 4096),
            (1024, 2048, 1024),
        ],
        [(32, 48, 64), (16, 32, 16)],
    ),
    "quantize": (8192, 64),
    "dot": ((8192, 4096, 16384), (32, 48, 64)),
    # d, heads, layers, sequence, batch, vocabulary
    "decoder": ((4096, 32, 4, 2048, 8, 8192), (32, 2, 1, 16, 2, 64)),
    "policies": ((1024, 8, 2, 2048, 8, 8192), (32, 2, 1, 16, 2, 64)),
    # layers, heads, d, sequence, batch: GPT-2 small's shape on bytes
    # (the smoke's d=64 keeps MXFP8's blocks of 32 whole)
    "gpt2": ((12, 12, 768, 512, 16), (1, 2, 64, 16, 2)),
}
# Share of the budget per section.
WEIGHTS = {
    "gemm": 20,
    "quantize": 15,
    "dot": 20,
    "decoder": 90,
    "policies": 45,
    "hlo": 15,
    # On JAX each state also compiles its step once more for its peak.
    "state": 35,
    # 60 of 300: 38 s of torch's 190 and 60 s of JAX's 300 where every
    # section before it uses its whole share, and it runs last, so it also
    # gets what they leave (in the H200's run 5, about 100 s on each
    # backend). Sized by estimate, not yet measured: 30 steps of 8192
    # tokens at about 0.57 GFLOP a token (6 x 85M parameters, and
    # attention's 12 x layers x d x sequence) are 140 TFLOP a variant:
    # under 1 s at a bf16 rate of 300 TFLOP/s, a third of the H200's dense
    # peak, and seconds for MXFP8 emulated; the time goes to building the
    # models and, on JAX, compiling three 12-layer steps, estimated at 10
    # to 30 s each from the d=4096 4-layer decoders' 10 s.
    "gpt2": 60,
    # PyTorch only: the decoder as a plain torch module under torchao's
    # float8 training, eager (and compiled, where the time allows).
    "torchao": 40,
}
SECTIONS = tuple(WEIGHTS)
LETTERS = dict(zip("abcdefghi", SECTIONS))
# The order they run in: the HLO audit (one compilation) before the
# decoders, whose compilations on JAX can use up what is left; GPT-2 last,
# with its share and whatever the others left.
ORDER = (
    "gemm",
    "quantize",
    "dot",
    "hlo",
    "decoder",
    "torchao",
    "policies",
    "state",
    "gpt2",
)
# Rounds of each measurement (full run / --smoke) and calls per round.
ROUNDS = (7, 2)
CALLS = (10, 1)
STEPS = (5, 1)  # timed decoder steps per variant
WARMUP = (2, 1)
# GPT-2's training steps per variant (the warm-up's included: the loss is
# the last step's), and the seconds a first variant is expected to need
# (build and compile): a section with less is skipped rather than started.
GPT2_STEPS = (30, 2)
GPT2_FIRST_VARIANT_S = (30.0, 0.0)


class OutOfTime(Exception):
    """A section's budget ran out."""


class Clock:
    """One section's deadline."""

    def __init__(self, seconds):
        self.deadline = time.monotonic() + seconds

    def check(self, what="", need=0.0):
        """Raises `OutOfTime(what)` unless `need` seconds are left."""
        if time.monotonic() + need > self.deadline:
            raise OutOfTime(what)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="toy sizes on any device, errors re-raised",
    )
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT", "."),
        help="directory of the JSON (default: $OUT or .)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for all sections (default 200; 900 with --smoke)",
    )
    parser.add_argument(
        "--sections",
        default="".join(LETTERS),
        help="letters of the sections to run (default all)",
    )
    parser.add_argument(
        "--table",
        metavar="DIR",
        default=None,
        help="only merge DIR/*.json into DIR/table.md",
    )
    args = parser.parse_args(argv)
    if args.budget is None:
        args.budget = 900.0 if args.smoke else 200.0
    unknown = set(args.sections) - set(LETTERS)
    if unknown:
        parser.error(
            f"--sections takes letters of {''.join(LETTERS)}. "
            f"Received: {args.sections!r}"
        )
    return args


# ---------------------------------------------------------------- helpers


def backend():
    import keras

    return keras.backend.backend()


def synchronize(value=None):
    if backend() == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif value is not None:
        import jax

        jax.block_until_ready(value)


def on_gpu():
    if backend() == "torch":
        import torch

        return torch.cuda.is_available()
    import jax

    return jax.devices()[0].platform == "gpu"


def describe_device():
    if backend() == "torch":
        import torch

        name = (
            torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        )
        return f"{name} (torch {torch.__version__})"
    import jax

    flags = os.environ.get("XLA_FLAGS", "").strip()
    flags = f", XLA_FLAGS={flags}" if flags else ""
    return f"{jax.devices()[0].device_kind} (jax {jax.__version__}{flags})"


def paired(functions, clock, smoke):
    """ABAB rounds of `functions` ({name: fn}, the first the baseline):
    {name: median ms per call}, {name: median per-round ratio baseline /
    name}, {name: why it was not measured}. Each function is called twice
    first (compilation, warm-up). Outside `--smoke`, a candidate whose
    warm-up raises is dropped with its error, and the candidates not yet
    warmed when the section's time runs out are dropped with that reason:
    the others are still measured (two rounds at least)."""
    rounds, calls = ROUNDS[smoke], CALLS[smoke]
    functions = dict(functions)
    dropped = {}
    names = list(functions)
    for index, name in enumerate(names):
        if index and time.monotonic() > clock.deadline:
            for rest in names[index:]:
                dropped[rest] = "out of time in warm-up"
                del functions[rest]
            break
        try:
            synchronize(functions[name]())
            synchronize(functions[name]())
        except Exception as error:
            if smoke or index == 0:
                raise
            traceback.print_exc()
            dropped[name] = f"failed: {type(error).__name__}: {error}"[:300]
            del functions[name]
    clock.check("warm-up of the baseline")
    times = {name: [] for name in functions}
    names = list(functions)
    for index in range(rounds):
        order = names if index % 2 == 0 else names[::-1]
        for name in order:
            start = time.perf_counter()
            for _ in range(calls):
                out = functions[name]()
            synchronize(out)
            times[name].append((time.perf_counter() - start) / calls)
        if index and time.monotonic() > clock.deadline:
            break  # two rounds measured: keep them
    base = names[0]
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    ratios = {
        name: statistics.median(b / t for b, t in zip(times[base], times[name]))
        for name in names[1:]
    }
    return ms, ratios, dropped


def dropped_note(dropped):
    """The note of the candidates `paired` dropped ("" if none)."""
    return "; ".join(
        f"{name} not measured: {why}" for name, why in dropped.items()
    )


def rows_of(section, item, ms, ratios, note="", **extra):
    return [
        {
            "section": section,
            "item": item,
            "ms": ms,
            "ratios": ratios,
            "note": note,
            **extra,
        }
    ]


def _jit(fn):
    if backend() == "jax":
        import jax

        return jax.jit(fn)
    return fn


def _normal(shape, seed, dtype="bfloat16", scale=1.0):
    import keras
    import numpy as np

    rng = np.random.default_rng(seed)
    value = rng.standard_normal(shape, dtype="float32") * scale
    return keras.ops.convert_to_tensor(value, dtype)


# ------------------------------------------------------------- (a) GEMMs


def _fp8_gemm_functions(a, b):
    """{name: fn} of the FP8 products of the bf16 operands' codes."""
    if backend() == "torch":
        import torch

        a8 = a.to(torch.float8_e4m3fn).contiguous()
        # Column-major B: the layout cuBLASLt's FP8 GEMM takes.
        b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device=a.device)

        def make(out_dtype, fast):
            return lambda: torch._scaled_mm(
                a8, b8, one, one, out_dtype=out_dtype, use_fast_accum=fast
            )

        return {
            "fp8_f32": make(torch.float32, False),
            "fp8_bf16": make(torch.bfloat16, False),
            "fp8_bf16_fast": make(torch.bfloat16, True),
        }
    import jax
    import jax.numpy as jnp

    a8, b8 = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)

    def make(dtype):
        f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=dtype))
        return lambda: f(a8, b8)

    return {"fp8_f32": make(jnp.float32), "fp8_bf16": make(jnp.bfloat16)}


def section_gemm(clock, smoke):
    import keras

    rows = []
    for m, k, n in SIZES["gemm"][smoke]:
        clock.check(f"GEMM {m}x{k}x{n}")
        a, b = _normal((m, k), 0), _normal((k, n), 1)
        matmul = _jit(keras.ops.matmul)
        functions = {"bf16": lambda a=a, b=b, f=matmul: f(a, b)}
        functions.update(_fp8_gemm_functions(a, b))
        ms, ratios, dropped = paired(functions, clock, smoke)
        tflops = {name: 2 * m * k * n / t / 1e9 for name, t in ms.items()}
        rows += rows_of(
            "a",
            f"GEMM {m}x{k}x{n}",
            ms,
            ratios,
            dropped_note(dropped),
            tflops={n: round(v, 1) for n, v in tflops.items()},
        )
    return rows


# --------------------------------------------------------- (b) quantize


def _quantize_functions(x):
    """{name: fn}: ways to make E4M3 codes of `x` (and their transpose)."""
    import keras_mp

    if backend() == "torch":
        import torch

        def quantize():
            return keras_mp.fp8.quantize(x)[0]

        def quantize_t():
            codes = keras_mp.fp8.quantize(x)[0]
            return codes, codes.t().contiguous()

        def torch_cast_t():
            amax = torch.amax(torch.abs(x)).float()
            y = (x.float() / (amax / 448.0)).clamp(-448, 448)
            codes = y.to(torch.float8_e4m3fn)
            return codes, codes.t().contiguous()

        def empty_strided_t():
            amax = torch.amax(torch.abs(x)).float()
            y = (x.float() / (amax / 448.0)).clamp(-448, 448)
            rows, cols = y.shape
            col = torch.empty_strided(
                (rows, cols),
                (1, rows),
                dtype=torch.float8_e4m3fn,
                device=y.device,
            )
            col.copy_(y)
            return y.to(torch.float8_e4m3fn), col

        from keras_mp.backend import fp8 as backend_fp8
        from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

        def amax():
            return backend_fp8.amax(x, None)

        scale = torch.ones((), device=x.device)

        def operands_t():
            # `fp8.dot`'s pass alone (the device's implementation) on the
            # bfloat16 input as it is, given its scale.
            return torch_fp8_operands.encode(
                x, scale, "e4m3", ("row", "column")
            )

        def amax_abs():
            return torch.amax(torch.abs(x))

        functions = {
            "keras_mp_cast": quantize,
            "keras_mp_cast_t": quantize_t,
            "amax": amax,
            "amax_abs": amax_abs,
            "operands_t": operands_t,
        }
        if torch_fp8_operands.implementation_for(x) == "triton":
            # The kernel's other tiles and warps (the default is 64, 4).
            for block, warps in ((32, 4), (64, 8), (128, 8)):
                functions[f"operands_t_{block}_{warps}"] = functools.partial(
                    _with_tile, block, warps, operands_t
                )
        functions.update(
            torch_cast_t=torch_cast_t, empty_strided_t=empty_strided_t
        )
        if torch.cuda.is_available():
            both = torch.compile(torch_cast_t, fullgraph=True)
            functions["compiled_cast_t"] = both
        return functions
    import jax

    cast = jax.jit(lambda t: keras_mp.fp8.quantize(t)[0])

    def both(t):
        codes = keras_mp.fp8.quantize(t)[0]
        return codes, codes.T

    both = jax.jit(both)
    return {
        "keras_mp_cast": lambda: cast(x),
        "keras_mp_cast_t": lambda: both(x),
    }


def section_quantize(clock, smoke):
    size = SIZES["quantize"][smoke]
    x = _normal((size, size), 2)
    functions = _quantize_functions(x)
    # The first is the baseline of the ratios; times are what matter.
    ms, ratios, dropped = paired(functions, clock, smoke)
    gbs = {name: size * size * 2 / (ms[name] * 1e-3) / 1e9 for name in ms}
    note = dropped_note(dropped)
    if not on_gpu() and backend() == "torch":
        note = "; ".join(filter(None, [note, "torch.compile path: CUDA only"]))
    if backend() == "torch":
        note = _joined(note, operands_check())
    return rows_of(
        "b",
        f"quantize {size}x{size} bf16",
        ms,
        ratios,
        note,
        gb_per_s={n: round(v, 1) for n, v in gbs.items()},
    )


def _with_tile(block, warps, function):
    """`function()` with the Triton kernel's tile and warps set to these."""
    from keras_mp.backend.torch import fp8_operands as operands

    saved = operands.TRITON_BLOCK, operands.TRITON_WARPS
    operands.TRITON_BLOCK, operands.TRITON_WARPS = block, warps
    try:
        return function()
    finally:
        operands.TRITON_BLOCK, operands.TRITON_WARPS = saved


def operands_check():
    """Whether the device's FP8 operand pass (`torch_fp8_operands`: the
    Triton kernel on CUDA) gives the codes of the eager copies, bit for
    bit (NaN as NaN), for every bfloat16 bit pattern read as it is,
    in both formats and layouts: Triton's interpreter on a CPU rounds
    ties its own way, so only a GPU checks the kernel's rounding."""
    import numpy as np
    import torch

    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

    device = "cuda" if torch.cuda.is_available() else "cpu"
    patterns = np.arange(2**16, dtype=np.uint32) << 16
    x = torch.from_numpy(patterns.view(np.float32).reshape(256, 256))
    x = x.to(device=device, dtype=torch.bfloat16)
    scale = torch.tensor(2.0**-4, device=device)
    path = torch_fp8_operands.implementation_for(x)
    mismatches = {}
    for fmt in ("e4m3", "e5m2"):
        got = torch_fp8_operands.encode(x, scale, fmt, ("row", "column"))
        expected = torch_fp8_operands.encode_layouts(
            x,
            scale,
            *_operand_format(fmt),
            ("row",),
        )[0]
        bits = expected.view(torch.uint8)
        nan = torch.isnan(expected.float())
        for layout, codes in zip(("row", "column"), got):
            codes = codes.contiguous()
            same = (codes.view(torch.uint8) == bits) | (
                nan & torch.isnan(codes.float())
            )
            mismatches[f"{fmt} {layout}"] = int((~same).sum())
    wrong = {k: v for k, v in mismatches.items() if v}
    verdict = f"mismatches {wrong}" if wrong else "bit-identical"
    return f"operands check ({path} against copies, 65536 bf16 patterns): {verdict}"


def _operand_format(fmt):
    """`encode_layouts`' `(fmax, dtype, keeps_inf)` of `fmt`."""
    import torch

    from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

    name, fmax, keeps_inf = torch_fp8_operands._FORMATS[fmt]
    return fmax, getattr(torch, name), keeps_inf


# ----------------------------------------------------------- (c) fp8.dot


def _dot_functions(m, k, n):
    import keras

    import keras_mp

    x = _normal((m, k), 3)
    w = _normal((k, n), 4, "float32", 0.01)
    recipes = {
        "fp8_tensorwise": keras_mp.fp8.Recipe(),
        "fp8_rowwise": keras_mp.fp8.Recipe(granularity="rowwise"),
    }
    if backend() == "jax":
        import jax

        def loss_bf16(x, w):
            return keras.ops.sum(
                keras.ops.matmul(x, keras.ops.cast(w, x.dtype))
            )

        functions = {"bf16": loss_bf16}
        for name, recipe in recipes.items():
            functions[name] = lambda x, w, r=recipe: keras.ops.sum(
                keras_mp.fp8.dot(x, w, r, output_dtype="bfloat16")
            )
        grads = {
            name: jax.jit(jax.grad(f, argnums=(0, 1)))
            for name, f in functions.items()
        }
        return {name: (lambda g=g: g(x, w)) for name, g in grads.items()}
    import torch

    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)

    def bf16():
        y = torch.matmul(x, w.to(torch.bfloat16))
        return torch.autograd.grad(y.sum(), (x, w))

    functions = {"bf16": bf16}
    # Issue 46 item 3: the rowwise GEMM with its row and column scales in
    # `_scaled_mm`'s epilogue (the default), against the GEMM of unit
    # scales then a multiplication by each (`_post`).
    recipes["fp8_rowwise_post"] = recipes["fp8_rowwise"]
    for name, recipe in recipes.items():
        in_gemm = not name.endswith("_post")

        def fp8(recipe=recipe, in_gemm=in_gemm):
            with rowwise_scales_in_gemm(in_gemm):
                y = keras_mp.fp8.dot(x, w, recipe, output_dtype="bfloat16")
                return (y, *torch.autograd.grad(y.sum(), (x, w)))

        functions[name] = fp8
    return functions


@contextlib.contextmanager
def rowwise_scales_in_gemm(on):
    """`keras_mp.backend.fp8.ROWWISE_SCALES_IN_GEMM` set to `on` inside."""
    from keras_mp.backend import fp8 as backend_fp8

    before = backend_fp8.ROWWISE_SCALES_IN_GEMM
    backend_fp8.ROWWISE_SCALES_IN_GEMM = on
    try:
        yield
    finally:
        backend_fp8.ROWWISE_SCALES_IN_GEMM = before


def rowwise_bits_agree(m, k, n):
    """PyTorch: whether a rowwise `fp8.dot`'s output and both gradients
    are the same bits with the scales in `_scaled_mm` as after it, per
    format ({"hybrid": bool, "e4m3": bool}); None elsewhere."""
    if backend() != "torch":
        return None
    import torch

    import keras_mp

    x = _normal((m, k), 3).detach().requires_grad_(True)
    w = _normal((k, n), 4, "float32", 0.01).detach().requires_grad_(True)
    agree = {}
    for formats in ("hybrid", "e4m3"):
        recipe = keras_mp.fp8.Recipe(granularity="rowwise", formats=formats)
        results = []
        for in_gemm in (True, False):
            with rowwise_scales_in_gemm(in_gemm):
                y = keras_mp.fp8.dot(x, w, recipe, output_dtype="bfloat16")
                results.append((y, *torch.autograd.grad(y.sum(), (x, w))))
        agree[formats] = all(
            torch.equal(a, b) for a, b in zip(*results, strict=True)
        )
    return agree


def fused_kernel_bits_agree():
    """PyTorch: per recipe (delayed, rowwise), whether four training steps
    of a small model of FP8 layers give the same bits, every variable,
    with keras_mp's fused FP8 kernels (delayed casts that write their
    amaxes, the fold in place, rowwise operands in two launches) as with
    torch's operations between the casts (`fp8_operands.FUSED_KERNELS`);
    None without CUDA (the kernels run on CUDA alone)."""
    import keras
    import numpy as np
    import torch

    import keras_mp
    from keras_mp.backend.torch import fp8_operands

    if not torch.cuda.is_available():
        return None
    recipes = {
        "delayed": keras_mp.fp8.Recipe(scaling="delayed"),
        "rowwise": keras_mp.fp8.Recipe(granularity="rowwise"),
    }
    agree = {}
    for name, recipe in recipes.items():
        results = []
        for fused in (True, False):
            fp8_operands.FUSED_KERNELS = fused
            keras.utils.set_random_seed(0)
            with keras_mp.policy_scope("mixed_bfloat16", fp8=recipe):
                model = keras.Sequential(
                    [keras.Input((512,))]
                    + [keras.layers.Dense(512) for _ in range(3)]
                    + [keras.layers.Dense(16)]
                )
            model.compile(keras.optimizers.Adam(1e-3), loss="mse")
            rng = np.random.default_rng(0)
            for _ in range(4):
                x = rng.normal(size=(256, 512)).astype("float32")
                model.train_on_batch(x, np.zeros((256, 16), "float32"))
            results.append([v.value.detach().clone() for v in model.variables])
        fp8_operands.FUSED_KERNELS = True
        agree[name] = all(
            torch.equal(a, b) for a, b in zip(*results, strict=True)
        )
    return agree


def section_dot(clock, smoke):
    m, k, n = SIZES["dot"][smoke]
    functions = _dot_functions(m, k, n)
    ms, ratios, dropped = paired(functions, clock, smoke)
    for name in ("bf16", "fp8_tensorwise", "fp8_rowwise"):
        if name in functions:
            keep_profile("dot", name, functions[name])
    functions = None
    return rows_of(
        "c",
        f"fp8.dot fwd+bwd {m}x{k}x{n}",
        ms,
        ratios,
        dropped_note(dropped),
        rowwise_in_gemm_bits_agree=rowwise_bits_agree(m, k, n),
        fused_kernel_bits_agree=fused_kernel_bits_agree(),
    )


# ----------------------------------------------------- (d, e) decoder


def decoder(d, heads, layers, seq, vocab):
    """A pre-LN GPT decoder of Keras layers (no biases, no dropout)."""
    import keras
    from keras import ops

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.norm_1 = keras.layers.LayerNormalization(epsilon=1e-5)
            self.qkv = keras.layers.Dense(3 * d, use_bias=False)
            self.out = keras.layers.Dense(d, use_bias=False)
            self.norm_2 = keras.layers.LayerNormalization(epsilon=1e-5)
            self.up = keras.layers.Dense(
                4 * d, use_bias=False, activation="gelu"
            )
            self.down = keras.layers.Dense(d, use_bias=False)

        def call(self, x):
            batch = ops.shape(x)[0]
            qkv = ops.reshape(
                self.qkv(self.norm_1(x)), (batch, seq, 3, heads, d // heads)
            )
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            attended = ops.dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(ops.reshape(attended, (batch, seq, d)))
            return x + self.down(self.up(self.norm_2(x)))

    tokens = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(vocab, d)(tokens)
    for _ in range(layers):
        x = Block()(x)
    x = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    logits = keras.layers.Dense(vocab, use_bias=False, name="head")(x)
    return keras.Model(tokens, logits)


def build_decoder(
    sizes,
    policy,
    recipe=None,
    keras_alone=False,
    loss_scale_optimizer=False,
    state_dtype=None,
):
    """The decoder, compiled with Adam, under `policy` (and `recipe`); with
    `loss_scale_optimizer` (True, or a dict of its arguments), Adam in a
    `keras_mp.LossScaleOptimizer`; with `state_dtype`, in a
    `keras_mp.OptimizerWrapper` keeping its state in that dtype."""
    import keras

    d, heads, layers, seq, _, vocab = sizes
    keras.utils.set_random_seed(0)
    if keras_alone:
        keras.mixed_precision.set_global_policy(policy)
    else:
        import keras_mp

        keras_mp.set_global_policy(policy, fp8=recipe)
    try:
        model = decoder(d, heads, layers, seq, vocab)
        optimizer = keras.optimizers.Adam(1e-4)
        if loss_scale_optimizer:
            import keras_mp

            options = loss_scale_optimizer
            options = options if isinstance(options, dict) else {}
            optimizer = keras_mp.LossScaleOptimizer(optimizer, **options)
        if state_dtype is not None:
            import keras_mp

            optimizer = keras_mp.OptimizerWrapper(
                optimizer, state_dtype=state_dtype
            )
        model.compile(
            optimizer,
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    finally:
        if keras_alone:
            keras.mixed_precision.set_global_policy("float32")
        else:
            keras_mp.set_global_policy(None)
    return model


def device_batch(sizes):
    """Token ids and targets made once, on the device."""
    import keras
    import numpy as np

    _, _, _, seq, batch, vocab = sizes
    rng = np.random.default_rng(5)
    ids = rng.integers(0, vocab, size=(batch, seq + 1), dtype="int32")
    x = keras.ops.convert_to_tensor(ids[:, :-1])
    y = keras.ops.convert_to_tensor(ids[:, 1:])
    return x, y


def reset_peak():
    if backend() == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()


def _device_gib(torch_reader, jax_key):
    """GiB from torch's CUDA allocator (`torch_reader`, a function of
    `torch.cuda`) or JAX's `memory_stats()[jax_key]`; None where the
    device says nothing."""
    if backend() == "torch":
        import torch

        if torch.cuda.is_available():
            return torch_reader(torch.cuda) / 2**30
        return None
    import jax

    value = (jax.devices()[0].memory_stats() or {}).get(jax_key)
    return None if value is None else value / 2**30


def resident_gib():
    """Device memory held now (torch's allocator, JAX's `bytes_in_use`);
    None where the device says nothing."""
    return _device_gib(lambda cuda: cuda.memory_allocated(), "bytes_in_use")


def peak_gib():
    """Peak device memory since `reset_peak` (torch), or since the process
    started (JAX's `peak_bytes_in_use`: a later model shows the larger of
    its own peak and the earlier ones'); None where the device says
    nothing."""
    return _device_gib(
        lambda cuda: cuda.max_memory_allocated(), "peak_bytes_in_use"
    )


def _rounded(values, digits=2):
    """`values` ({name: GiB, MiB or None}) to `digits` decimals."""
    return {
        n: (None if v is None else round(v, digits)) for n, v in values.items()
    }


def _joined(*notes):
    """The non-empty notes, joined."""
    return "; ".join(filter(None, notes))


def time_steps(model, batch, clock, smoke, count_syncs=False):
    """(median ms per `train_on_batch` step, peak GiB, host syncs/step)."""
    x, y = batch
    reset_peak()
    ms = median_step_ms(lambda: model.train_on_batch(x, y), clock, smoke)
    syncs = step_syncs(model, batch) if count_syncs else None
    return ms, peak_gib(), syncs


def median_step_ms(step, clock, smoke):
    """Median ms of `step()` (which returns once its work is done) over
    `STEPS` calls after `WARMUP`. No clock in the warm-up: a model compiled
    is measured (two steps at least); the sections look at the clock before
    building the next."""
    for _ in range(WARMUP[smoke]):
        step()
    times = []
    for _ in range(STEPS[smoke]):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        if len(times) >= 2 and time.monotonic() > clock.deadline:
            break
    return statistics.median(times) * 1e3


def step_syncs(model, batch):
    """Host syncs of one `train_on_batch` step on torch: the reads
    `count_host_syncs` counts and, on CUDA, the synchronizing calls of
    PyTorch's sync debug mode (copies from the host included); None on
    JAX."""
    if backend() != "torch":
        return None
    from keras_mp.testing import count_host_syncs

    x, y = batch
    with count_host_syncs() as counts:
        model.train_on_batch(x, y)
    syncs = sum(counts.values())
    cuda = cuda_syncs(lambda: model.train_on_batch(x, y))
    return syncs if cuda is None else f"{syncs} counted, {cuda} CUDA"


def step_launches(model, batch):
    """Kernel launches of one `train_on_batch` step on torch, counted as
    the CPU tests count them (`keras_mp.testing.count_torch_launches`: one
    per ATen operation that queues a kernel, one per Triton launch); None
    on JAX."""
    if backend() != "torch":
        return None
    from keras_mp.testing import count_torch_launches

    x, y = batch
    with count_torch_launches() as count:
        model.train_on_batch(x, y)
    return count.launches


# Where the profiled calls go ({"<section> <variant>": what
# `profile_call` gave}): into the JSON beside the sections and the log.
PROFILES = {}


def profile_call(function, top=15):
    """One `function()` under `torch.profiler` (PyTorch only; None on JAX,
    whose HLO audit says what its step runs): `wall_ms` (the
    profiler's overhead included), `device_ms` (the kernels' summed time
    on CUDA; the aten ops' own CPU time on a CPU), `launches` (kernels, or
    aten ops on a CPU) and the `top` names by that time, as `[name,
    calls, ms]`. An error comes back as `{"error": ...}`: a profile never
    costs the section its timings."""
    if backend() != "torch":
        return None
    try:
        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile

        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU]
        if cuda:
            activities.append(ProfilerActivity.CUDA)
        synchronize()
        with profile(activities=activities) as profiler:
            start = time.perf_counter()
            function()
            synchronize()
            wall = (time.perf_counter() - start) * 1e3
        totals = {}
        for event in profiler.events():
            if cuda:
                if event.device_type != DeviceType.CUDA:
                    continue
                us = getattr(event, "device_time_total", None)
                if us is None:
                    us = event.cuda_time_total
            else:
                if not event.name.startswith("aten::"):
                    continue
                us = event.self_cpu_time_total
            calls, total = totals.get(event.name, (0, 0.0))
            totals[event.name] = (calls + 1, total + us / 1e3)
        ranked = sorted(totals.items(), key=lambda item: -item[1][1])
        return {
            "wall_ms": round(wall, 2),
            "device_ms": round(sum(t for _, t in totals.values()), 2),
            "launches": sum(c for c, _ in totals.values()),
            "top": [[n[:90], c, round(t, 3)] for n, (c, t) in ranked[:top]],
        }
    except Exception as error:  # noqa: BLE001 - a profile is optional
        return {"error": f"{type(error).__name__}: {error}"[:300]}


def keep_profile(section, name, function):
    """`profile_call(function)` kept in `PROFILES` and printed (torch)."""
    profile = profile_call(function)
    if profile is None:
        return
    PROFILES[f"{section} {name}"] = profile
    summary = {k: v for k, v in profile.items() if k != "top"}
    print(f"[{section}] profile of {name}: {summary}", flush=True)
    for entry in profile.get("top", []):
        print(f"    {entry}", flush=True)


def cuda_syncs(step):
    """The synchronizing CUDA calls of `step()` that PyTorch's sync debug
    mode reports (a blocking copy from the host included, which
    `count_host_syncs` does not see); None without CUDA."""
    import warnings

    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def each_variant(names, clock, smoke, build, measure):
    """For each of `names`: `model = build(name)`, then `measure(name,
    model)`, the model freed before the next is built (one at a time: the
    d=4096 models and their Adam state do not fit beside each other's
    activations). Stops before the first variant the section has no time
    left for; a variant that raises is noted, its traceback logged, and
    the others still run (`--smoke` re-raises). Returns the note."""
    note = ""
    for name in names:
        model = None
        try:
            clock.check("build")
            model = build(name)
            measure(name, model)
        except OutOfTime:
            note = _joined(note, f"out of time before {name}")
            break
        except Exception as error:
            if smoke:
                raise
            traceback.print_exc()
            failed = f"{name} failed: {type(error).__name__}: {error}"
            note = _joined(note, failed[:300])
        finally:
            model = None
            _release()
    return note


def _release():
    """Frees what the models dropped before it hold (Keras models sit in
    reference cycles: without a collection the previous variant's weights
    and optimizer state would still be counted in the next one's memory)."""
    gc.collect()
    if backend() == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def section_decoder(clock, smoke):
    import keras_mp

    sizes = SIZES["decoder"][smoke]
    batch = device_batch(sizes)
    recipes = {
        "bf16": None,
        "fp8_current": keras_mp.fp8.Recipe(),
        "fp8_delayed": keras_mp.fp8.Recipe(scaling="delayed"),
        "fp8_rowwise": keras_mp.fp8.Recipe(granularity="rowwise"),
    }
    if backend() == "torch":
        # Rowwise with its scales after the GEMM (`rowwise_scales_in_gemm`).
        recipes["fp8_rowwise_post"] = recipes["fp8_rowwise"]
    if smoke:
        # The variants differ only in their recipe: two keep the path alive.
        recipes = {n: recipes[n] for n in ("bf16", "fp8_delayed")}
    ms, peaks, resident, fp8_layers, syncs = {}, {}, {}, {}, {}
    launches = {}

    def measure(name, model):
        with rowwise_scales_in_gemm(not name.endswith("_post")):
            measure_variant(name, model)

    def measure_variant(name, model):
        ms[name], peaks[name], syncs[name] = time_steps(
            model, batch, clock, smoke, count_syncs=True
        )
        resident[name] = resident_gib()
        launches[name] = step_launches(model, batch)
        keep_profile("decoder", name, lambda: model.train_on_batch(*batch))
        fp8_layers[name] = sum(
            getattr(layer.dtype_policy, "fp8", None) is not None
            for layer in model._flatten_layers(include_self=False)
        )

    note = each_variant(
        recipes,
        clock,
        smoke,
        lambda name: build_decoder(sizes, "mixed_bfloat16", recipes[name]),
        measure,
    )
    ratios = {
        name: ms["bf16"] / t
        for name, t in ms.items()
        if name != "bf16" and "bf16" in ms
    }
    DECODER_MS.update(ms)
    d, heads, layers, seq, b, vocab = sizes
    return rows_of(
        "d",
        f"decoder d={d} L={layers} T={seq * b} V={vocab}",
        ms,
        ratios,
        note,
        peak_gib=_rounded(peaks),
        resident_gib=_rounded(resident),
        fp8_layers=fp8_layers,
        host_syncs_per_step=syncs if backend() == "torch" else None,
        launches_per_step=launches if backend() == "torch" else None,
    )


# The decoder section's step times ({variant: ms}), for the torchao
# section's keras_mp / torchao ratios (the same decoder, sizes and batch).
DECODER_MS = {}
# keras_mp's decoder variant -> torchao's recipe of the same scaling.
TORCHAO_RECIPES = {"fp8_current": "tensorwise", "fp8_rowwise": "rowwise"}


def torch_decoder(d, heads, layers, seq, vocab):
    """`decoder` as a plain PyTorch module: the same layers, shapes and
    order (pre-LN blocks without biases, causal attention, exact GELU)."""
    import torch
    from torch import nn

    functional = torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm_1 = nn.LayerNorm(d, eps=1e-5)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.out = nn.Linear(d, d, bias=False)
            self.norm_2 = nn.LayerNorm(d, eps=1e-5)
            self.up = nn.Linear(d, 4 * d, bias=False)
            self.down = nn.Linear(4 * d, d, bias=False)

        def forward(self, x):
            batch = x.shape[0]
            qkv = self.qkv(self.norm_1(x)).view(
                batch, seq, 3, heads, d // heads
            )
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            attended = functional.scaled_dot_product_attention(
                q, k, v, is_causal=True
            )
            attended = attended.transpose(1, 2).reshape(batch, seq, d)
            x = x + self.out(attended)
            return x + self.down(functional.gelu(self.up(self.norm_2(x))))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(d, eps=1e-5)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, tokens):
            x = self.embedding(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return Decoder()


def section_torchao(clock, smoke):
    """The decoder of section d as a plain PyTorch module, float32
    weights in a bfloat16 autocast (as mixed_bfloat16), Adam: bf16, and
    torchao's `convert_to_float8_training` with tensorwise and rowwise
    scaling (every block's Linear, the head left in bf16 as keras_mp's
    default rules leave it), eager and, where the section's time allows,
    `torch.compile`d. Ratios: keras_mp's step over torchao's of the same
    scaling (section d's times: below 1, keras_mp is faster), and torchao's
    compiled step over its eager one."""
    if backend() != "torch":
        return rows_of("i", "torchao peer", {}, {}, "PyTorch only: skipped")
    try:
        import torchao  # noqa: F401
        from torchao.float8 import Float8LinearConfig
        from torchao.float8 import convert_to_float8_training
    except ImportError as error:
        return rows_of(
            "i", "torchao peer", {}, {}, f"skipped: no torchao ({error})"
        )
    import torch

    sizes = SIZES["decoder"][smoke]
    d, heads, layers, seq, b, vocab = sizes
    x, y = device_batch(sizes)
    device = x.device
    x, y = x.to(torch.int64), y.to(torch.int64)
    variants = ["bf16", "tensorwise", "rowwise"]
    if not smoke:
        # A CPU's `torch.compile` (C++ codegen) would take the smoke's
        # minute; the GPU run compiles each recipe once.
        variants += ["tensorwise_compiled", "rowwise_compiled"]
    ms, fp8_layers = {}, {}

    def build(name):
        torch.manual_seed(0)
        model = torch_decoder(d, heads, layers, seq, vocab).to(device)
        recipe = name.split("_")[0]
        if recipe != "bf16":
            convert_to_float8_training(
                model,
                config=Float8LinearConfig.from_recipe_name(recipe),
                module_filter_fn=lambda module, fqn: fqn != "head",
            )
        fp8_layers[name] = sum(
            type(m).__name__ == "Float8Linear" for m in model.modules()
        )
        optimizer = torch.optim.Adam(model.parameters(), 1e-4, foreach=True)
        forward = torch.compile(model) if "compiled" in name else model

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = forward(x)
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, vocab), y.reshape(-1)
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # No value is read on the host: wait for the device.
            synchronize()

        return step

    def measure(name, step):
        ms[name] = median_step_ms(step, clock, smoke)

    note = each_variant(variants, clock, smoke, build, measure)
    ratios = {
        f"keras_mp_{name}/torchao": DECODER_MS[name] / ms[recipe]
        for name, recipe in TORCHAO_RECIPES.items()
        if name in DECODER_MS and recipe in ms
    }
    if "bf16" in DECODER_MS and "bf16" in ms:
        ratios["keras_mp_bf16/torch_bf16"] = DECODER_MS["bf16"] / ms["bf16"]
    for recipe in ("tensorwise", "rowwise"):
        compiled = f"{recipe}_compiled"
        if recipe in ms and compiled in ms:
            ratios[f"torchao_{compiled}/eager"] = ms[compiled] / ms[recipe]
    return rows_of(
        "i",
        f"torchao peer decoder d={d} L={layers} T={seq * b} V={vocab}",
        ms,
        ratios,
        _joined(note, "ratios: step time over step time (below 1: faster)"),
        fp8_layers=fp8_layers,
    )


def section_state(clock, smoke):
    """Adam's state in float32, bfloat16 and float8 (issue 34) on the
    policies' decoder under mixed_bfloat16: step time, bytes per parameter
    read from the variables, device memory held after a step, the
    allocator's peak (torch: per model; JAX: since the process started),
    and on JAX the compiled step's own peak (`compiled_step_mib`)."""
    from keras_mp.testing import bytes_per_parameter

    sizes = SIZES["policies"][smoke]
    batch = device_batch(sizes)
    ms, state_bytes, resident, peaks, step_peaks = {}, {}, {}, {}, {}
    launches = {}

    def measure(name, model):
        ms[name], peaks[name], _ = time_steps(model, batch, clock, smoke)
        resident[name] = resident_gib()
        launches[name] = step_launches(model, batch)
        # After the timing, and only in the section's time: one more
        # compilation of the step (the timings matter more).
        step_peaks[name] = None
        if time.monotonic() < clock.deadline:
            step_peaks[name] = compiled_step_mib(model, batch)
        counted = bytes_per_parameter(model.weights, model.optimizer)
        state_bytes[name] = round(counted["state"], 3)

    names = ("float32", "bfloat16", "float8")
    agree = None
    if backend() == "torch":
        names += ("bfloat16_batch", "float8_batch")
        agree = update_kernel_bits_agree()

    def build(name):
        # The batch variants run without the update kernels.
        update_kernels_on(not name.endswith("_batch"))
        return build_decoder(
            sizes,
            "mixed_bfloat16",
            state_dtype=None if name == "float32" else name.split("_")[0],
        )

    try:
        note = each_variant(names, clock, smoke, build, measure)
    finally:
        if backend() == "torch":
            update_kernels_on(True)
    ratios = {
        f"{name}_vs_bfloat16": t / ms["bfloat16"]
        for name, t in ms.items()
        if name != "bfloat16" and "bfloat16" in ms
    }
    for state in ("bfloat16", "float8"):
        if state in ms and f"{state}_batch" in ms:
            ratios[f"{state}_batch_vs_kernel"] = (
                ms[f"{state}_batch"] / ms[state]
            )
    d, _, layers, seq, b, _ = sizes
    note = _joined(note, "ratios: step time over bfloat16 state's")

    return rows_of(
        "g",
        f"Adam state d={d} L={layers} T={seq * b}",
        ms,
        ratios,
        note,
        state_bytes_per_param=state_bytes,
        resident_gib=_rounded(resident),
        peak_gib=_rounded(peaks),
        step_peak_mib=_rounded(step_peaks, 1),
        launches_per_step=launches if backend() == "torch" else None,
        update_kernel_bits_agree=agree,
    )


def update_kernels_on(on):
    """PyTorch: the Triton kernels of the optimizer update on or off."""
    from keras_mp.backend.torch import update_kernels

    update_kernels.UPDATE_KERNELS = on


def update_kernel_bits_agree():
    """PyTorch: per state setting, whether three Adam updates of a few
    variables (NaN and inf gradients in the second) give the same bits
    with the update kernels as with the batch path on the device, NaNs
    compared by place (a NaN's payload is the device's); None without
    CUDA (the kernels run on CUDA alone)."""
    import keras
    import torch

    import keras_mp

    if not torch.cuda.is_available():
        return None
    agree = {}
    settings = [
        ("bfloat16", True),
        ("bfloat16", False),
        ("float16", False),
        ("float8", True),
        ("float8", False),
    ]
    for state, stochastic in settings:
        results = []
        for on in (True, False):
            update_kernels_on(on)
            keras.utils.set_random_seed(0)
            optimizer = keras_mp.OptimizerWrapper(
                keras.optimizers.AdamW(1e-3, weight_decay=0.01),
                state_dtype=state,
                stochastic_rounding=stochastic,
            )
            generator = torch.Generator().manual_seed(0)
            shapes = [(4096, 1000), (3,), (129,)]
            variables = [
                keras.Variable(torch.randn(shape, generator=generator))
                for shape in shapes
            ]
            for step in range(3):
                grads = [
                    torch.randn(shape, generator=generator).cuda()
                    * 10.0 ** (step - 4)
                    for shape in shapes
                ]
                if step == 1:
                    grads[0][0, :3] = torch.tensor(
                        [float("nan"), float("inf"), -float("inf")]
                    )
                optimizer.apply(grads, variables)
            results.append(
                [v.value.detach().clone() for v in variables]
                + [v.value.detach().clone() for v in optimizer.variables]
            )
        update_kernels_on(True)
        same = True
        for a, b in zip(*results, strict=True):
            if a.is_floating_point():
                nan = torch.isnan(a.float())
                same = same and torch.equal(nan, torch.isnan(b.float()))
                a, b = a[~nan], b[~nan]
            same = same and torch.equal(a, b)
        agree[f"{state}{'_stochastic' if stochastic else ''}"] = bool(same)
    return agree


def compiled_step_mib(model, batch):
    """JAX: the peak of the model's compiled training step in MiB, XLA's
    `memory_analysis()` (`keras_mp.backend.memory.train_step_memory`:
    arguments, outputs and temporaries less the donated bytes), its own
    and not the process's; None on other backends."""
    if backend() != "jax":
        return None
    from keras_mp.backend import memory

    peak, _ = memory.train_step_memory(model, *batch)
    return peak / 2**20


# The one the targets name first: a budget that runs out keeps it.
POLICIES = ("mixed_bfloat16", "float32", "mixed_float16")


def policies_keras_alone(clock, smoke):
    """Keras alone: timed before keras_mp is imported."""
    assert "keras_mp" not in sys.modules, "keras_mp was imported already"
    sizes = SIZES["policies"][smoke]
    batch = device_batch(sizes)
    ms = {}
    for policy in POLICIES[:1] if smoke else POLICIES:
        try:
            clock.check("build")
        except OutOfTime:
            print(f"[policies] Keras alone: out of time before {policy}")
            break
        model = build_decoder(sizes, policy, keras_alone=True)
        ms[f"keras_{policy}"] = time_steps(model, batch, clock, smoke)[0]
        model = None
        _release()
    return ms


def section_policies(clock, smoke, keras_ms):
    sizes = SIZES["policies"][smoke]
    batch = device_batch(sizes)
    syncs = {}
    policies = POLICIES[:1] if smoke else POLICIES
    variants = [(p, p, False) for p in policies]
    variants.insert(1, ("mixed_bfloat16_lso", "mixed_bfloat16", True))
    if backend() == "torch":
        # The other way to skip: the select on the device (no host read).
        on_device = {"skip_on_device": True}
        variants.insert(
            2, ("mixed_bfloat16_lso_on_device", "mixed_bfloat16", on_device)
        )
    variants = {name: rest for name, *rest in variants}
    # Every variant built first (small models: they fit side by side), then
    # timed in alternating rounds (`paired`): a variant timed after another
    # on its own came out 10% apart from run to run on the H100.
    models, note = {}, ""
    for name, (policy, lso) in variants.items():
        try:
            clock.check("build")
        except OutOfTime:
            note = f"out of time before building {name}"
            break
        models[name] = build_decoder(sizes, policy, loss_scale_optimizer=lso)
    functions = {
        name: functools.partial(model.train_on_batch, *batch)
        for name, model in models.items()
    }
    # Out of time before the first build: Keras alone's times stay.
    timed = paired(functions, clock, smoke) if functions else ({}, {}, {})
    ms, paired_ratios, dropped = timed
    note = _joined(note, dropped_note(dropped))
    for name, model in models.items():
        if name in ms:
            syncs[name] = step_syncs(model, batch)
    models = functions = None
    _release()
    ratios = {}
    for policy in policies:
        if f"keras_{policy}" in keras_ms and policy in ms:
            # keras_mp's step time over Keras alone's (1.00: no overhead).
            ratios[f"{policy}_vs_keras"] = (
                ms[policy] / keras_ms[f"keras_{policy}"]
            )
    for name, ratio in paired_ratios.items():
        if name.startswith("mixed_bfloat16_lso"):
            # The paired rounds' median ratio, plain over this one: inverted.
            ratios[f"{name[len('mixed_bfloat16_') :]}_vs_plain"] = 1 / ratio
    d, _, layers, seq, b, _ = sizes
    note = _joined(
        note,
        "keras_mp / Keras alone: above 1 is slower; Keras alone ran first",
    )
    return rows_of(
        "e",
        f"policies d={d} L={layers} T={seq * b}",
        {**keras_ms, **ms},
        ratios,
        note,
        host_syncs_per_step=syncs if backend() == "torch" else None,
    )


# ---------------------------------------------------------------- (f) HLO

# A dot or GEMM custom call of the optimized HLO, its output type first.
_GEMM = re.compile(r"=\s*\(?(\w+)\[[^=]*?(custom-call|dot)\(([^)]*)\)(.*)$")


def audit(text):
    """Counts of the GEMMs in an optimized HLO module's text."""
    counts = {
        "fp8_gemm": 0,
        "f16_gemm": 0,
        "f32_output_gemm": 0,
        "bf16_output_gemm": 0,
        "other_gemm": 0,
        "f8_transpose": 0,
    }
    for line in text.splitlines():
        if "transpose(" in line and re.search(r"=\s*f8\w*\[", line):
            counts["f8_transpose"] += 1
        match = _GEMM.search(line)
        if match is None:
            continue
        out, kind, operands, rest = match.groups()
        if kind == "custom-call" and not re.search(
            r'custom_call_target="[^"]*(gemm|matmul)', rest
        ):
            continue
        if "f8" in operands or "$f8" in rest:
            counts["fp8_gemm"] += 1
        elif "f16[" in operands and "bf16[" not in operands:
            counts["f16_gemm"] += 1
        else:
            counts["other_gemm"] += 1
        if out == "f32":
            counts["f32_output_gemm"] += 1
        elif out == "bf16":
            counts["bf16_output_gemm"] += 1
    return counts


def section_hlo(clock, smoke):
    if backend() != "jax":
        return rows_of("f", "HLO audit", {}, {}, "JAX only: skipped")
    import jax
    import keras

    import keras_mp

    sizes = SIZES["decoder"][smoke]
    d, heads, _, seq, b, vocab = sizes
    # One layer is enough: every layer compiles alike.
    sizes = (d, heads, 1, seq, b, vocab)
    model = build_decoder(sizes, "mixed_bfloat16", keras_mp.fp8.Recipe())
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = device_batch(sizes)

    def step(trainable, non_trainable, optimizer_state, x, y):
        def loss_fn(trainable):
            logits, updated = model.stateless_call(
                trainable, non_trainable, x, training=True
            )
            return loss(y, logits), updated

        (value, updated), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable
        )
        trainable, optimizer_state = optimizer.stateless_apply(
            optimizer_state, grads, trainable
        )
        return value, trainable, updated, optimizer_state

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )
    lowered = jax.jit(step).lower(*state, x, y)
    clock.check("lowered")
    before = lowered.as_text()
    f8_dots = len(re.findall(r"dot_general.*f8E4M3FN", before))
    compiled = lowered.compile()
    counts = audit(compiled.as_text())
    gemm_layers = 4  # qkv, out, up, down
    counts["fp8_dots_before_optimization"] = f8_dots
    counts["expected_fp8_gemms"] = 3 * gemm_layers
    note = (
        "CPU: XLA upcasts FP8 dots, no GEMM custom calls"
        if not on_gpu()
        else ""
    )
    model = None
    _release()
    return rows_of(
        "f",
        "HLO audit, FP8 decoder step (1 layer)",
        {},
        {},
        note,
        counts=counts,
    )


# -------------------------------------------------------------- (h) GPT-2

# `benchmarks/convergence.py`'s variants that section (h) trains, the
# baseline of its ratios first.
GPT2_VARIANTS = ("mixed_bfloat16", "fp8_tensorwise", "mxfp8")
GPT2_LEARNING_RATE = 6e-4  # GPT-2 small's


@functools.cache
def convergence():
    """`benchmarks/convergence.py` as a module (it imports keras_mp: only
    after Keras alone's timings)."""
    import importlib.util

    path = pathlib.Path(__file__).resolve().parent.parent / "convergence.py"
    spec = importlib.util.spec_from_file_location("convergence", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def emulation_note(name):
    """Why convergence.py's variant `name` runs its GEMMs emulated here
    (`keras_mp.fp8.is_available`: MXFP8 on Hopper, every FP8 recipe on a
    CPU), or "" where it runs on FP8 tensor cores or has no recipe."""
    import keras_mp

    fields = convergence().VARIANTS[name].get("recipe")
    if fields is None:
        return ""
    available, reason = keras_mp.fp8.is_available(
        keras_mp.fp8.Recipe(**fields), return_reason=True
    )
    return "" if available else f"GEMMs emulated: {reason}"


def train_gpt2(model, batches, clock, smoke):
    """`model` trained on `batches`, one `train_on_batch` each: the first
    and last steps' losses, the median ms of the steps after the warm-up,
    the first step's seconds (tracing and compiling) and the steps run.
    Out of time after two timed steps, it stops early and says so."""
    losses, seconds = [], []
    for x, y in batches:
        start = time.perf_counter()
        logs = model.train_on_batch(x, y, return_dict=True)
        losses.append(float(logs["loss"]))
        seconds.append(time.perf_counter() - start)
        timed = len(seconds) - WARMUP[smoke]
        if timed >= 2 and time.monotonic() > clock.deadline:
            break
    note = ""
    if len(seconds) < len(batches):
        note = f"out of time after {len(seconds)} of {len(batches)} steps"
    return {
        "first_loss": losses[0],
        "loss": losses[-1],
        "ms": statistics.median(seconds[WARMUP[smoke] :]) * 1e3,
        "first_step_s": seconds[0],
        "steps": len(seconds),
        "note": note,
    }


def section_gpt2(clock, smoke):
    """GPT-2 small's shape on bytes (`SIZES["gpt2"]`), `GPT2_STEPS` steps
    per variant of `GPT2_VARIANTS` from the same float32 weights on the
    same batches: convergence.py's data, model, optimizer and variants.
    A variant starts only with as many seconds left as the one before it
    took (the first: `GPT2_FIRST_VARIANT_S`)."""
    import argparse

    import numpy as np

    layers, heads, d, seq, batch = SIZES["gpt2"][smoke]
    steps = GPT2_STEPS[smoke]
    first = GPT2_FIRST_VARIANT_S[smoke]
    clock.check(f"start: a variant needs about {first:.0f} s", first)
    module = convergence()
    args = argparse.Namespace(
        layers=layers,
        heads=heads,
        dim=d,
        seq_len=seq,
        steps=steps,
        learning_rate=GPT2_LEARNING_RATE,
    )
    data, summary = module.load_data()
    print(f"[gpt2] {summary}", flush=True)
    train = data["train"]
    starts = np.random.default_rng([49, 0]).integers(
        0, train.size - seq - 1, size=(steps, batch)
    )
    batches = []
    for row in starts:
        x, y = module.windows(train, row, seq)
        batches.append((module.as_inputs(x), y))
    weights = module.initial_weights(args, 0)
    results, started = {}, {}

    def build(name):
        took = [result["seconds"] for result in results.values()]
        need = took[-1] if took else first
        clock.check(f"{name} needs about {need:.0f} s", need)
        started[name] = time.monotonic()
        return module.build_variant(name, args, weights)

    def measure(name, model):
        result = train_gpt2(model, batches, clock, smoke)
        result["fp8_layers"] = module.count_quantized_gemms(model)
        result["seconds"] = time.monotonic() - started[name]
        results[name] = result

    note = each_variant(GPT2_VARIANTS, clock, smoke, build, measure)
    baseline = results.get(GPT2_VARIANTS[0])
    rows = []
    for name in GPT2_VARIANTS:
        item = (
            f"GPT-2 on bytes L={layers} H={heads} d={d} T={seq}x{batch}, "
            f"{steps} steps: {name}"
        )
        emulated = emulation_note(name)
        if name not in results:
            rows += rows_of(
                "h", item, {}, {}, _joined(f"not run: {note}", emulated)
            )
            continue
        result = results[name]
        ratios, gap = {}, {}
        if baseline is not None and result is not baseline:
            ratios[name] = baseline["ms"] / result["ms"]
            # The table shows 3 digits of a loss: the gap, paired (same
            # weights, same batches), is what the variants differ by.
            gap["loss_gap"] = round(result["loss"] - baseline["loss"], 4)
        rows += rows_of(
            "h",
            item,
            {name: result["ms"]},
            ratios,
            _joined(result["note"], emulated),
            loss=round(result["loss"], 4),
            **gap,
            first_loss=round(result["first_loss"], 4),
            tokens_per_s=round(seq * batch / result["ms"] * 1e3),
            steps=result["steps"],
            first_step_s=round(result["first_step_s"], 1),
            fp8_layers=result["fp8_layers"],
        )
    return rows


# ------------------------------------------------------------------ main

RUNNERS = {
    "gemm": section_gemm,
    "quantize": section_quantize,
    "dot": section_dot,
    "decoder": section_decoder,
    "hlo": section_hlo,
    "state": section_state,
    "gpt2": section_gpt2,
    "torchao": section_torchao,
}


def run(args):
    start = time.monotonic()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = os.environ.get("KERAS_BACKEND", "tensorflow")
    chosen = {LETTERS[letter] for letter in args.sections}
    wanted = [section for section in ORDER if section in chosen]
    result = {"backend": name, "smoke": args.smoke, "sections": {}}
    path = out_dir / f"{name}.json"

    def remaining():
        return args.budget - (time.monotonic() - start)

    def share(section, rest):
        weight = sum(WEIGHTS[s] for s in rest)
        return max(remaining(), 0.0) * WEIGHTS[section] / weight

    def record(section, rows, status, seconds):
        result["sections"][section] = {
            "status": status,
            "rows": rows,
            "seconds": round(seconds, 1),
        }
        if PROFILES:
            result["profiles"] = PROFILES
        path.write_text(json.dumps(result, indent=1, default=str))
        print(f"[{section}] {status} in {seconds:.1f} s", flush=True)
        for row in rows:
            print(f"  {json.dumps(row, default=str)}", flush=True)

    keras_ms = {}
    if "policies" in wanted:
        # Keras alone first, before keras_mp is imported.
        begun = time.monotonic()
        clock = Clock(share("policies", wanted) / 2)
        try:
            keras_ms = policies_keras_alone(clock, args.smoke)
        except OutOfTime:
            print("[policies] Keras alone: out of time", flush=True)
        except Exception:
            if args.smoke:
                raise
            traceback.print_exc()
        WEIGHTS["policies"] /= 2
        print(
            f"[policies] Keras alone {time.monotonic() - begun:.1f} s",
            flush=True,
        )
    import keras_mp  # noqa: F401 (the hooks, from here on)

    result["device"] = describe_device()
    print(f"# {result['device']}", flush=True)
    for index, section in enumerate(wanted):
        begun = time.monotonic()
        seconds = share(section, wanted[index:])
        if seconds < 1.0:
            record(section, [], "skipped: no time left", 0.0)
            continue
        clock = Clock(seconds)
        try:
            if section == "policies":
                rows = section_policies(clock, args.smoke, keras_ms)
            else:
                rows = RUNNERS[section](clock, args.smoke)
            status = "ok"
        except OutOfTime as error:
            rows, status = [], f"skipped: out of time ({seconds:.0f} s) at "
            status += str(error)
        except Exception as error:
            if args.smoke:
                raise
            traceback.print_exc()
            rows, status = [], f"failed: {type(error).__name__}: {error}"
        record(section, rows, status, time.monotonic() - begun)
    if name == "torch":
        # Which FP8 operand path served, and which failed to build.
        import torch

        from keras_mp.backend.torch import fp8_operands as torch_fp8_operands

        device = "cuda" if torch.cuda.is_available() else "cpu"
        probe = torch.zeros((16, 16), device=device)
        result["fp8_operands"] = {
            "path": torch_fp8_operands.implementation_for(probe),
            "failed": sorted(torch_fp8_operands._failed),
        }
        path.write_text(json.dumps(result, indent=1, default=str))
        print(f"# FP8 operands: {result['fp8_operands']}", flush=True)
    return result


def _format(value):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _pairs(mapping):
    return ", ".join(f"{k} {_format(v)}" for k, v in mapping.items())


def table(directory):
    """One markdown table of every `<backend>.json` in `directory`."""
    directory = pathlib.Path(directory)
    lines = [
        "| backend | device | section | item | ms | bf16/x (or "
        "keras_mp/Keras) | more | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(directory.glob("*.json")):
        result = json.loads(path.read_text())
        device = result.get("device", "?")
        for section, entry in result["sections"].items():
            rows = entry["rows"] or [{"item": "", "ms": {}, "ratios": {}}]
            for row in rows:
                extra = {
                    k: v
                    for k, v in row.items()
                    if k not in ("section", "item", "ms", "ratios", "note")
                }
                more = "; ".join(
                    f"{k}: {_pairs(v) if isinstance(v, dict) else _format(v)}"
                    for k, v in extra.items()
                    if v is not None
                )
                if row.get("note"):
                    more = f"{more}; {row['note']}" if more else row["note"]
                lines.append(
                    f"| {result['backend']} | {device} | {section} | "
                    f"{row['item']} | {_pairs(row['ms'])} | "
                    f"{_pairs(row['ratios'])} | {more} | {entry['status']} |"
                )
    text = "\n".join(lines) + "\n"
    for path in sorted(directory.glob("*.json")):
        result = json.loads(path.read_text())
        if "fp8_operands" in result:
            operands = result["fp8_operands"]
            failed = ", ".join(operands["failed"]) or "none"
            text += (
                f"\n{result['backend']}: FP8 operands made by the "
                f"{operands['path']!r} path (failed to build: {failed}).\n"
            )
        for name, profile in result.get("profiles", {}).items():
            text += f"\n{result['backend']} profile of one {name} call: "
            if "error" in profile:
                text += f"failed ({profile['error']}).\n"
                continue
            top = ", ".join(
                f"{n} {c}x {t} ms" for n, c, t in profile["top"][:6]
            )
            text += (
                f"wall {profile['wall_ms']} ms, kernels {profile['device_ms']} "
                f"ms in {profile['launches']} launches; top: {top}.\n"
            )
    (directory / "table.md").write_text(text)
    return text


def main(argv=None):
    args = parse_args(argv)
    if args.table is not None:
        print(table(args.table))
        return
    result = run(args)
    print(table(args.out))
    return result


if __name__ == "__main__":
    main()

"""FP8 codes of a PyTorch GEMM operand, cast and laid out in one pass.

cuBLASLt's FP8 GEMM (`torch._scaled_mm`) takes a row-major A and a
column-major B. A tensorwise operand of `fp8.dot` enters two GEMMs, once
in each layout (a Keras `[K, N]` kernel is B of the forward product,
column-major, and `B^T` of the input gradient, row-major), so both layouts
are written from one read of the values, as torchao's eager kernels do,
instead of a cast followed by eager transposes. A bfloat16 or float16
tensor is read as it is (each value made float32 inside the pass: exact),
not cast to float32 first, which would write and read twice its bytes
once more:

- `"triton"`: a Triton kernel, for CUDA tensors where Triton imports
  (torch's CUDA wheels depend on it; its CPU wheels do not, so it is
  imported at first use). It clips with `tl.where` (Inductor's `clamp`
  next to a transposed FP8 store mis-lowers in triton 3.8) and writes
  E5M2's inf itself (PTX's `cvt.rn.satfinite` makes inf the largest
  finite value).
- `"compiled"`: where the kernel fails to build (another Triton),
  `torch.compile` of the pure-torch function below, whose Inductor kernel
  reads once and writes both layouts. Where a caller's `torch.compile` is
  tracing, the function itself (it fuses into their graph).
- `"copy"`: the same function run op by op (without Triton, or where the
  compile failed too): each layout one cast-and-transpose copy
  (`torch.empty_strided(...).copy_`), no separate transpose.

An implementation that raises warns once and hands over to the next.

Where the Triton kernel serves, the scales too: `scales` makes an
operand's power-of-two scale and its reciprocal from its reduction in one
kernel launch, `amaxes` its float32 amax (NaN made inf), bit for bit
`torch/ops.py`'s `scale_from_amax` and `amax`, which a dozen and a half
eager operations made (each a launch, about 20 us of host time on an
H200). Where the scale is known before the cast (delayed scaling's stored
scales), `encode_with_amax` is the cast that also writes each program's
largest `|x|`, as Transformer Engine's cast writes its amax: the amax
without a reduction and a kernel of its own.

All three give the codes of `keras_mp._fp8.formats.e4m3_e5m2.encode(x / scale)`
bit for bit: dividing by a power of two, or multiplying by its exact
reciprocal, is one correctly rounded operation on the same real number;
finite values beyond `±fmax` are clipped; inf stays inf in E5M2 and
becomes NaN in E4M3; NaN stays NaN.

Imports nothing from keras_mp.
"""

import functools
import sys
import warnings

# Layout name -> whether the operand is stored column-major.
LAYOUTS = {"row": False, "column": True}
IMPLEMENTATIONS = ("triton", "compiled", "copy")

# The implementation to use instead of the device's best (tests set it),
# or None.
FORCED = None

# Format name -> (torch dtype name, largest finite value, keeps inf).
_FORMATS = {
    "e4m3": ("float8_e4m3fn", 448.0, False),
    "e5m2": ("float8_e5m2", 57344.0, True),
}

# The dtypes `encode` reads (each value made float32 first: exact).
SOURCE_DTYPES = ("float32", "bfloat16", "float16")

# The Triton kernel's tile (BLOCK x BLOCK values per program) and warps
# per program (`benchmarks/gpu/fp8_speed.py` section b times others). An
# 8192^2 bfloat16 tensor made codes in both layouts, in GB/s of input: on
# an H100 923 with these, 1073 with 8 warps; on an H200 1272 with these,
# 997 with 8 warps (paired rounds, 2026-11-27): no other tile wins on both.
TRITON_BLOCK = 64
TRITON_WARPS = 4

# Whether the kernels beyond the cast (`scales`, delayed scaling's, the
# optimizer update's) run where `encode` runs Triton's (tests compare them
# with torch's operations).
FUSED_KERNELS = True

_compiled = None
_kernel = None
_scales_kernel = None
# The implementations that failed in this process: the next one serves.
_failed = set()


def encode(x, scale, fmt, layouts, inverse=None):
    """FP8 codes of 2-D `x / scale` (in float32), one tensor per layout.

    Args:
        x: A 2-D float32, bfloat16 or float16 torch tensor.
        scale: Positive float32 power-of-two scales (or inf), a tensor
            broadcastable to `x` (tensorwise, per row, per column).
        fmt: `"e4m3"` or `"e5m2"`.
        layouts: A tuple of `"row"` (row-major) and `"column"`
            (column-major: strides `(1, rows)`), each at most once.
        inverse: `1 / scale`, where `scales` gave it, or None.

    Returns:
        A tuple of FP8 tensors of `x`'s shape, in the order of `layouts`.
    """
    import torch

    fmax, dtype, keeps_inf = _checked(x, fmt, layouts)
    implementation = implementation_for(x)
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    arguments = (x, scale, fmax, dtype, keeps_inf, layouts)
    if implementation == "triton":
        arguments = (*arguments, inverse)
        written = _falling_back("triton", _triton_encode, arguments, fmt)
    elif implementation == "compiled":
        written = _falling_back("compiled", _compiled_encode, arguments, fmt)
    else:
        written = encode_layouts(*arguments)
    return tuple(written)


def _checked(x, fmt, layouts):
    """`encode`'s arguments checked: `(fmax, dtype, keeps_inf)` of `fmt`."""
    import torch

    sources = tuple(getattr(torch, name) for name in SOURCE_DTYPES)
    if x.ndim != 2 or x.dtype not in sources:
        raise ValueError(
            "The fused FP8 quantization takes a 2-D float32, bfloat16 or "
            "float16 tensor. "
            f"Received: x of shape {tuple(x.shape)} and dtype {x.dtype}. "
            "Reshape and cast it first, or quantize it with "
            "`keras_mp.fp8.quantize`."
        )
    if fmt not in _FORMATS:
        raise ValueError(
            f"`fmt` is one of {tuple(_FORMATS)}. Received: fmt={fmt!r}. "
            "Pass 'e4m3' or 'e5m2'."
        )
    unknown = [layout for layout in layouts if layout not in LAYOUTS]
    if unknown or not layouts or len(set(layouts)) != len(layouts):
        raise ValueError(
            f"`layouts` names each of {tuple(LAYOUTS)} at most once. "
            f"Received: layouts={layouts!r}. Pass e.g. ('row', 'column')."
        )
    dtype_name, fmax, keeps_inf = _FORMATS[fmt]
    return fmax, getattr(torch, dtype_name), keeps_inf


def implementation_for(x):
    """Which of `IMPLEMENTATIONS` prepares the operands of tensor `x`:
    on CUDA with Triton, the kernel, else (where it failed) `torch.compile`
    (Inductor's CUDA kernels need Triton too), else copies."""
    import torch

    if FORCED is not None:
        return FORCED
    if torch.compiler.is_compiling():
        # Traced into the caller's graph: Inductor fuses it there.
        return "copy"
    if x.device.type != "cuda" or not triton_usable():
        # A CPU makes FP8 operands only where tests ask for `_scaled_mm`
        # (`keras_mp.backend.fp8.SCALED_MM_ON_CPU`): not worth a compile.
        return "copy"
    for implementation in ("triton", "compiled"):
        if implementation not in _failed:
            return implementation
    return "copy"


def triton_usable():
    """Whether Triton may be imported here: installed, and TensorFlow not
    loaded in this process. Both link LLVM statically and register the same
    command-line options: importing Triton after TensorFlow aborts the
    process ("LLVM ERROR: inconsistency in registered CommandLine
    options", triton 3.9 with TensorFlow 2.21). Inductor's CUDA kernels
    import Triton too, so without it the operands are plain copies."""
    return "tensorflow" not in sys.modules and triton_available()


@functools.cache
def triton_available():
    """Whether Triton imports (never on torch's CPU wheels)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _falling_back(implementation, function, arguments, fmt):
    """`function(*arguments)`; where it raises (a Triton or a compiler
    that cannot build it), a warning, and the next implementation from
    then on (`encode` again). A forced implementation raises."""
    try:
        return function(*arguments)
    except Exception as error:  # noqa: BLE001 - any kernel build failure
        if FORCED is not None:
            raise
        _failed.add(implementation)
        warnings.warn(
            f"keras_mp FP8 on PyTorch: the {implementation!r} FP8 "
            f"quantization failed ({type(error).__name__}: {error}); "
            "the next one takes over from now on (the same codes, "
            "possibly slower). Report it with your torch and triton "
            "versions.",
            stacklevel=3,
        )
        x, scale, *_ = arguments
        return encode(x, scale, fmt, arguments[5])


def encode_layouts(x, scale, fmax, dtype, keeps_inf, layouts):
    """The pure-torch quantization: eager (`"copy"`) or under
    `torch.compile` (`"compiled"`). Clips with `where`, never `clamp`
    (see the module docstring)."""
    import torch

    y = x.to(torch.float32) / scale
    clipped = torch.where(y > fmax, fmax, torch.where(y < -fmax, -fmax, y))
    clipped = torch.where(
        torch.isinf(y), y if keeps_inf else float("nan"), clipped
    )
    written = []
    for layout in layouts:
        if LAYOUTS[layout]:
            rows, columns = x.shape
            out = torch.empty_strided(
                (rows, columns), (1, rows), dtype=dtype, device=x.device
            )
            written.append(out.copy_(clipped))
        else:
            written.append(clipped.to(dtype))
    return written


def _compiled_encode(x, scale, fmax, dtype, keeps_inf, layouts):
    import torch

    global _compiled
    if _compiled is None:
        _compiled = torch.compile(encode_layouts, fullgraph=True)
    return _compiled(x, scale, fmax, dtype, keeps_inf, layouts)


def encode_with_amax(x, scale, fmt, layouts):
    """`encode(x, scale, fmt, layouts)` and the amax of `x` read in the same
    pass, where Triton's kernel serves `x` (`kernel_serves`); else None.

    Returns:
        `(codes, amax)`: the codes as `encode` gives them, and a float32
        vector holding each program's largest `|x|` (NaN made inf), whose
        max is `torch/ops.amax(x, None)` bit for bit: delayed scaling's
        statistics, where the scale is known before the cast (Transformer
        Engine's cast writes its amax so), without the reduction and the
        kernel after it (two launches an operand).
    """
    fmax, dtype, keeps_inf = _checked(x, fmt, layouts)
    return run_kernel(
        "triton_quantize_amax",
        "the FP8 cast with its amax",
        x,
        _triton_encode_with_amax,
        x,
        scale,
        fmax,
        dtype,
        keeps_inf,
        layouts,
    )


def rowwise_operands(x, fmt, exponent, carry, low, high):
    """Rowwise FP8 operands of 2-D `x` in two launches, where Triton's
    kernel serves `x` (`kernel_serves`); else None.

    Returns:
        `(row_codes, row_scales, column_codes, column_scales)`: the codes of
        `x` divided by each row's power-of-two scale, row-major, and those
        scales, float32 `(rows, 1)`; the codes of `x` divided by each
        column's scale, column-major, and those scales, `(1, columns)`.
        Each scale is `torch/ops.scale_from_amax` of the row's or column's
        `torch/ops.amax` with `exponent`, `carry`, `low` and `high` (Python
        ints), and the codes `encode`'s with it, bit for bit: a rowwise
        GEMM's operand and the transposed one of the other GEMM it enters.
        One pass writes the programs' row and column maxima, a second the
        scales and both layouts' codes (where the reductions, the scales'
        kernels and the casts of each layout took six launches, and the
        column-major reduction a transposed read).
    """
    fmax, dtype, keeps_inf = _checked(x, fmt, ("row", "column"))
    return run_kernel(
        "triton_rowwise",
        "rowwise FP8 operands",
        x,
        _triton_rowwise,
        x,
        fmax,
        dtype,
        keeps_inf,
        (exponent, carry, low, high),
    )


def _triton_rowwise(x, fmax, dtype, keeps_inf, thresholds):
    import torch
    import triton

    kernel = _triton_kernel()
    rows, columns = x.shape
    device = x.device
    block = TRITON_BLOCK
    grid = (triton.cdiv(rows, block), triton.cdiv(columns, block))
    row_maxima = torch.empty(
        (grid[1], rows), dtype=torch.float32, device=device
    )
    column_maxima = torch.empty(
        (grid[0], columns), dtype=torch.float32, device=device
    )
    row_codes = torch.empty((rows, columns), dtype=dtype, device=device)
    column_codes = torch.empty_strided(
        (rows, columns), (1, rows), dtype=dtype, device=device
    )
    row_scales = torch.empty((rows, 1), dtype=torch.float32, device=device)
    column_scales = torch.empty(
        (1, columns), dtype=torch.float32, device=device
    )
    bfloat16 = x.dtype == torch.bfloat16
    source = x.view(torch.int16) if bfloat16 else x
    row_bytes = row_codes.view(torch.uint8)
    column_bytes = column_codes.view(torch.uint8)
    for rowwise in (False, True):
        # The maxima, then the scales and the codes.
        kernel[grid](
            source,
            row_scales,
            row_bytes,
            column_bytes,
            row_maxima,
            column_maxima,
            row_scales,
            column_scales,
            rows,
            columns,
            x.stride(0),
            x.stride(1),
            0,
            0,
            *thresholds,
            BFLOAT16=bfloat16,
            AMAX=0 if rowwise else 2,
            ROWWISE=rowwise,
            INVERT=False,
            FMAX=fmax,
            E5M2=keeps_inf,
            ROW=rowwise,
            COLUMN=rowwise,
            BLOCK=block,
            num_warps=TRITON_WARPS,
        )
    return row_codes, row_scales, column_codes, column_scales


def _triton_encode_with_amax(x, scale, fmax, dtype, keeps_inf, layouts):
    import torch

    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return _triton_encode(
        x, scale, fmax, dtype, keeps_inf, layouts, None, amax=True
    )


def _triton_encode(
    x, scale, fmax, dtype, keeps_inf, layouts, inverse=None, amax=False
):
    import torch
    import triton

    kernel = _triton_kernel()
    rows, columns = x.shape
    # The kernel multiplies by `inverse`, or where none is given, by the
    # reciprocal of `scale` it computes itself (one launch less than
    # `torch.reciprocal`): a power of two's reciprocal is exact (inf's is
    # 0: x * 0 is x / inf, 0 or NaN), and a multiply is cheaper than a
    # division.
    invert = inverse is None
    inverse = (scale if invert else inverse).expand(rows, columns)
    outputs = {
        layout: torch.empty_strided(
            (rows, columns),
            (1, rows) if LAYOUTS[layout] else (columns, 1),
            dtype=dtype,
            device=x.device,
        )
        for layout in layouts
    }
    # The kernel writes bytes; an output it does not write is a stand-in.
    row = outputs.get("row", outputs.get("column")).view(torch.uint8)
    column = outputs.get("column", outputs.get("row")).view(torch.uint8)
    block = TRITON_BLOCK
    grid = (triton.cdiv(rows, block), triton.cdiv(columns, block))
    # Each program's largest `|x|`, where asked (else a stand-in).
    maxima = torch.empty(
        grid[0] * grid[1] if amax else 1, dtype=torch.float32, device=x.device
    )
    bfloat16 = x.dtype == torch.bfloat16
    kernel[grid](
        # bfloat16 read as its bits and made float32 by a shift (exact;
        # Triton's interpreter mis-casts bfloat16's subnormals).
        x.view(torch.int16) if bfloat16 else x,
        inverse,
        row,
        column,
        maxima,
        maxima,
        maxima,
        maxima,
        rows,
        columns,
        x.stride(0),
        x.stride(1),
        inverse.stride(0),
        inverse.stride(1),
        0,
        0,
        0,
        0,
        BFLOAT16=bfloat16,
        AMAX=1 if amax else 0,
        ROWWISE=False,
        INVERT=invert,
        FMAX=fmax,
        E5M2=keeps_inf,
        ROW="row" in outputs,
        COLUMN="column" in outputs,
        BLOCK=block,
        num_warps=TRITON_WARPS,
    )
    written = [outputs[layout] for layout in layouts]
    return (written, maxima) if amax else written


def _triton_kernel():
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    @triton.jit
    def quantize(
        x_ptr,
        inverse_ptr,
        row_ptr,
        column_ptr,
        maxima_ptr,
        column_maxima_ptr,
        row_scale_ptr,
        column_scale_ptr,
        rows,
        columns,
        x_stride_row,
        x_stride_column,
        inverse_stride_row,
        inverse_stride_column,
        exponent,
        carry,
        low,
        high,
        BFLOAT16: tl.constexpr,
        AMAX: tl.constexpr,
        ROWWISE: tl.constexpr,
        INVERT: tl.constexpr,
        FMAX: tl.constexpr,
        E5M2: tl.constexpr,
        ROW: tl.constexpr,
        COLUMN: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row_program = tl.program_id(0)
        column_program = tl.program_id(1)
        r = row_program * BLOCK + tl.arange(0, BLOCK)
        c = column_program * BLOCK + tl.arange(0, BLOCK)
        mask = (r[:, None] < rows) & (c[None, :] < columns)
        x = tl.load(
            x_ptr + r[:, None] * x_stride_row + c[None, :] * x_stride_column,
            mask=mask,
            other=0,
        )
        if BFLOAT16:
            x = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            x = x.to(tl.float32)
        if AMAX != 0:
            # `torch/ops.amax`: the largest `|x|`, a NaN counted as inf.
            magnitude = tl.where(x != x, float("inf"), tl.abs(x))
            if AMAX == 1:
                # The program's, for the whole tensor's.
                largest = tl.max(tl.max(magnitude, axis=1), axis=0)
                program = row_program * tl.num_programs(1) + column_program
                tl.store(maxima_ptr + program, largest)
            else:
                # Its rows' and its columns', for each row's and column's.
                tl.store(
                    maxima_ptr + column_program * rows + r,
                    tl.max(magnitude, axis=1),
                    mask=r < rows,
                )
                tl.store(
                    column_maxima_ptr + row_program * columns + c,
                    tl.max(magnitude, axis=0),
                    mask=c < columns,
                )
        if ROW or COLUMN:
            if ROWWISE:
                # Each row's and column's amax from the programs' maxima
                # (`AMAX == 2` before), and its scale as
                # `torch/ops.scale_from_amax` makes it, step for step.
                row_amax = tl.zeros([BLOCK], dtype=tl.float32)
                for t in range(0, tl.num_programs(1)):
                    row_amax = tl.maximum(
                        row_amax,
                        tl.load(
                            maxima_ptr + t * rows + r, mask=r < rows, other=0.0
                        ),
                    )
                column_amax = tl.zeros([BLOCK], dtype=tl.float32)
                for t in range(0, tl.num_programs(0)):
                    column_amax = tl.maximum(
                        column_amax,
                        tl.load(
                            column_maxima_ptr + t * columns + c,
                            mask=c < columns,
                            other=0.0,
                        ),
                    )
                for side in tl.static_range(2):
                    if side == 0:
                        amax = row_amax
                    else:
                        amax = column_amax
                    bits = tl.minimum(
                        amax.to(tl.int32, bitcast=True), 0x7F800000
                    )
                    biased = (bits + carry) >> 23
                    biased = tl.minimum(
                        tl.maximum(biased - exponent, low), high
                    )
                    scale = (biased << 23).to(tl.float32, bitcast=True)
                    scale = tl.where(amax == 0.0, 1.0, scale)
                    finite = (amax == amax) & (amax != float("inf"))
                    scale = tl.where(finite, scale, amax)
                    if side == 0:
                        # The first column of programs writes the rows'.
                        if column_program == 0:
                            tl.store(row_scale_ptr + r, scale, mask=r < rows)
                        row_inverse = tl.div_rn(1.0, scale)[:, None]
                    else:
                        if row_program == 0:
                            tl.store(
                                column_scale_ptr + c, scale, mask=c < columns
                            )
                        column_inverse = tl.div_rn(1.0, scale)[None, :]
            else:
                inverse = tl.load(
                    inverse_ptr
                    + r[:, None] * inverse_stride_row
                    + c[None, :] * inverse_stride_column,
                    mask=mask,
                    other=1.0,
                )
                if INVERT:
                    # `inverse` holds the scales: their correctly rounded
                    # reciprocals, as `torch.reciprocal`'s.
                    inverse = tl.div_rn(1.0, inverse)
                row_inverse = inverse
            # Each layout's codes: one set for both, or (rowwise) the
            # rows' scales for the row-major codes and the columns' for
            # the column-major ones.
            for side in tl.static_range(2):
                if side == 0 or ROWWISE:
                    if side == 0:
                        y = x * row_inverse
                    else:
                        y = x * column_inverse
                    clipped = tl.where(
                        y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y)
                    )
                    infinite = (y == float("inf")) | (y == float("-inf"))
                    # Non-finite codes are written as bits, not cast: the
                    # cast is only asked to round finite values in range.
                    if E5M2:
                        codes = clipped.to(
                            tl.float8e5, fp_downcast_rounding="rtne"
                        )
                        codes = codes.to(tl.uint8, bitcast=True)
                        # E5M2's +inf, -inf and NaN.
                        special = tl.where(y > 0, 0x7C, 0xFC)
                        special = tl.where(y != y, 0x7F, special).to(tl.uint8)
                        codes = tl.where(infinite | (y != y), special, codes)
                    else:
                        codes = clipped.to(
                            tl.float8e4nv, fp_downcast_rounding="rtne"
                        )
                        codes = codes.to(tl.uint8, bitcast=True)
                        # E4M3 has no inf: inf and NaN are its NaN.
                        codes = tl.where(infinite | (y != y), 0x7F, codes)
                if side == 0 and ROW:
                    tl.store(
                        row_ptr + r[:, None] * columns + c[None, :],
                        codes,
                        mask=mask,
                    )
                if side == 1 and COLUMN:
                    tl.store(
                        column_ptr + c[:, None] * rows + r[None, :],
                        tl.trans(codes),
                        mask=tl.trans(mask),
                    )

    _kernel = quantize
    return _kernel


def scales(magnitudes, exponent, carry, low, high, inverse=True, amax=False):
    """`(scale, inverse)` of the largest magnitudes `magnitudes` (a torch
    tensor of any float dtype and shape, NaN where a NaN was among them:
    `torch/ops.largest_magnitudes`) in one kernel launch, where `encode`
    runs Triton's kernel; else None.

    `scale` is `torch/ops.scale_from_amax(amax(...), exponent, carry, low,
    high)` bit for bit, of the magnitudes made float32 and NaN made inf
    (`torch/ops.amax`), and `inverse` its reciprocal (exact: a power of
    two, 0 for inf, NaN for NaN), both float32 of `magnitudes`' shape:
    the dozen and a half small eager operations between an operand's
    reduction and its cast, each a kernel launch (about 20 us of host time
    on an H200), made one. `exponent` and `carry` are Python ints, or
    int32 tensors of one value per position of the last axis (several
    formats' scales at once). With `inverse=False`, the scale alone; with
    `amax=True`, `magnitudes` are float32 amaxes already
    (`torch/ops.scale_from_amax`'s argument), a NaN among them giving a
    NaN scale.
    """
    outputs = ("scale", "inverse") if inverse else ("scale",)
    fused = _fused(magnitudes, outputs, exponent, carry, low, high, not amax)
    if fused is None:
        return None
    return fused if inverse else fused[0]


def amaxes(magnitudes):
    """`torch/ops.amax`'s result of the largest magnitudes `magnitudes`
    (`torch/ops.largest_magnitudes`): made float32 and NaN made inf, in one
    kernel launch (where its eager operations take four) where `encode`
    runs Triton's kernel; else None."""
    fused = _fused(magnitudes, ("amax",), 0, 0, 0, 0, True)
    return None if fused is None else fused[0]


def _fused(magnitudes, outputs, exponent, carry, low, high, nan_as_inf):
    """The float32 `outputs` of `_scales_kernel`, or None where it does
    not serve (`run_kernel`)."""
    return run_kernel(
        "triton_scales",
        "FP8 scales",
        magnitudes,
        _triton_scales,
        magnitudes,
        outputs,
        exponent,
        carry,
        low,
        high,
        nan_as_inf,
    )


def kernel_serves(name, tensor):
    """Whether the Triton kernel `name` runs for `tensor`: where Triton's
    kernels serve it (`implementation_for`), `FUSED_KERNELS` is on, and
    that kernel has not failed in this process."""
    return (
        FUSED_KERNELS
        and implementation_for(tensor) == "triton"
        and name not in _failed
    )


def run_kernel(name, what, tensor, function, *arguments):
    """`function(*arguments)`, the launch of the Triton kernel `name` (of
    `what`, for the warning), where it serves `tensor` (`kernel_serves`);
    else None, and the caller's torch operations compute the same values.
    A kernel that raises (a Triton that cannot build it) warns once and is
    not launched again; a forced implementation raises. The kernels of
    scales here, of delayed scaling (`torch/delayed.py`) and of the
    optimizer update (`torch/update_kernels.py`) all run through it."""
    if not kernel_serves(name, tensor):
        return None
    try:
        return function(*arguments)
    except Exception as error:  # noqa: BLE001 - any kernel build failure
        if FORCED is not None:
            raise
        _failed.add(name)
        warnings.warn(
            f"keras_mp on PyTorch: the Triton kernel of {what} failed "
            f"({type(error).__name__}: {error}); torch's operations take "
            "over from now on (the same values, more kernel launches). "
            "Report it with your torch and triton versions.",
            stacklevel=4,
        )
        return None


def _triton_scales(magnitudes, outputs, exponent, carry, low, high, nan_as_inf):
    import torch
    import triton

    kernel = _triton_scales_kernel()
    flat = magnitudes.reshape(-1)
    bfloat16 = flat.dtype == torch.bfloat16
    if bfloat16:
        # Made float32 from the bits (Triton's interpreter flushes
        # bfloat16's subnormals in a cast).
        flat = flat.view(torch.int16)
    written = {
        name: torch.empty(
            magnitudes.shape, dtype=torch.float32, device=magnitudes.device
        )
        for name in outputs
    }
    # A stand-in for the outputs not asked for (never written).
    first = written[outputs[0]]
    vector = isinstance(exponent, torch.Tensor)
    if vector and exponent.device != magnitudes.device:
        # Keras's device holds the thresholds; the kernel reads them on
        # the amaxes' own.
        exponent = exponent.to(magnitudes.device)
        carry = carry.to(magnitudes.device)
    size = flat.numel()
    block = min(1024, triton.next_power_of_2(max(size, 1)))
    kernel[(triton.cdiv(size, block),)](
        flat,
        written.get("amax", first),
        written.get("scale", first),
        written.get("inverse", first),
        exponent if vector else first,
        carry if vector else first,
        size,
        magnitudes.shape[-1] if magnitudes.ndim else 1,
        0 if vector else exponent,
        0 if vector else carry,
        low,
        high,
        BFLOAT16=bfloat16,
        NAN_AS_INF=nan_as_inf,
        VECTOR=vector,
        AMAX="amax" in written,
        SCALE="scale" in written,
        INVERSE="inverse" in written,
        BLOCK=block,
    )
    return tuple(written[name] for name in outputs)


def _triton_scales_kernel():
    global _scales_kernel
    if _scales_kernel is not None:
        return _scales_kernel
    import triton
    import triton.language as tl

    @triton.jit
    def scales(
        magnitudes_ptr,
        amax_ptr,
        scale_ptr,
        inverse_ptr,
        exponent_ptr,
        carry_ptr,
        size,
        last,
        exponent,
        carry,
        low,
        high,
        BFLOAT16: tl.constexpr,
        NAN_AS_INF: tl.constexpr,
        VECTOR: tl.constexpr,
        AMAX: tl.constexpr,
        SCALE: tl.constexpr,
        INVERSE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < size
        if BFLOAT16:
            # A bfloat16's bits are a float32's upper half.
            half = tl.load(magnitudes_ptr + i, mask=mask, other=0)
            amax = ((half.to(tl.int32) & 0xFFFF) << 16).to(
                tl.float32, bitcast=True
            )
        else:
            amax = tl.load(magnitudes_ptr + i, mask=mask, other=0.0)
            amax = amax.to(tl.float32)
        if NAN_AS_INF:
            # `torch/ops.amax`: a NaN counts as inf.
            amax = tl.where(amax != amax, float("inf"), amax)
        if AMAX:
            tl.store(amax_ptr + i, amax, mask=mask)
        if SCALE:
            if VECTOR:
                # One format's thresholds per position of the last axis.
                column = i % last
                exponent = tl.load(exponent_ptr + column, mask=mask, other=0)
                carry = tl.load(carry_ptr + column, mask=mask, other=0)
            # `torch/ops.scale_from_amax`, step for step.
            bits = tl.minimum(amax.to(tl.int32, bitcast=True), 0x7F800000)
            biased = (bits + carry) >> 23
            biased = tl.minimum(tl.maximum(biased - exponent, low), high)
            scale = (biased << 23).to(tl.float32, bitcast=True)
            scale = tl.where(amax == 0.0, 1.0, scale)
            # A non-finite amax is its own scale.
            finite = (amax == amax) & (amax != float("inf"))
            scale = tl.where(finite, scale, amax)
            tl.store(scale_ptr + i, scale, mask=mask)
            if INVERSE:
                inverse = tl.math.div_rn(1.0, scale)
                tl.store(inverse_ptr + i, inverse, mask=mask)

    _scales_kernel = scales
    return _scales_kernel

"""`Quantizer`: one FP8 format at one scale granularity, as `dot` asks it.

A quantizer says what it quantizes (`quantize`: codes and scales of a
tensor along an axis), how it dequantizes (`dequantize`), and the GEMMs of
one `dot` call, by role: the forward product (`forward`), the input
gradient (`input_gradient`) and the kernel gradient (`kernel_gradient`),
each quantizing its two operands along that GEMM's contracted axis in the
layouts the GEMM takes them in. `dot` holds no granularity of its own:
it asks `keras_mp._fp8.quantizers.get(recipe)` for the quantizer and calls
the three roles. What one call's roles share (formats, statistics rows,
result dtypes, delayed scales, saved operands) is a `Call`. A quantizer
also owns what a frozen layer stores in place of its float kernel
(`frozen_variables`, `freeze_kernel`, `kernel_from_frozen`), so that
`keras_mp.fp8.freeze` and the layers know no format.

A new format plugs in as one file beside `tensorwise.py`, `rowwise.py` and
`block.py`: a `Quantizer` subclass, mapped from its recipes in
`__init__.py`'s `get`; or, defined outside keras_mp, registered with
`keras_mp._fp8.quantizers.register`, its `name` the granularity a `Recipe`
names it by.
"""

import abc
import collections

from keras import ops

from keras_mp._fp8 import stats as stats_module
from keras_mp._fp8.formats.e4m3_e5m2 import quantize_reduced
from keras_mp.backend.torch import versions as torch_versions

# The layouts of a 2-D operand (`e4m3_e5m2.gemm_operands`): row-major, for the
# GEMM that takes it as its A (or its transpose as B), and column-major,
# for the one that takes it as B (or its transpose as A).
ROW = ("row",)
COLUMN = ("column",)
BOTH = ("row", "column")


class Rows(dict):
    """The statistics rows of one call, by tensor; `counts`: whether they
    count flushed and saturated values (statistics asked for), or hold
    the amax alone (delayed scaling's); `amaxes`: amaxes already known;
    `from_amaxes`: whether the rows are left unmade, the caller making
    all of them at once from `amaxes` (PyTorch's delayed scaling)."""

    def __init__(self, counts=True, from_amaxes=False):
        super().__init__()
        self.counts = counts
        self.amaxes = {}
        self.from_amaxes = from_amaxes


class Dtypes(collections.namedtuple("Dtypes", "out dx dw")):
    """The dtypes the forward product and the two gradients are cast to:
    a GEMM whose result is cast to bfloat16 may round to it itself."""


class Call:
    """What the three GEMMs of one `dot` call share.

    Attributes:
        forward_format: The format of the input and the kernel.
        backward_format: The format of the output gradient.
        margin: The recipe's headroom, in powers of two.
        rows: A `Rows` to fill with statistics, or None.
        dtypes: The `Dtypes` of the three results.
        scaling: Delayed scaling's state for this call
            (`keras_mp._fp8.delayed.Scaling`), or None.
        saved: What `forward` keeps for the gradients, by name.
        quantized_kernel_gradient: Whether the kernel gradient's GEMM
            multiplies FP8 codes (False under a high-precision backward:
            a forward then makes no operand for it).
        source_x: The layer's input as `[M, K]` in its own dtype (e.g.
            bfloat16), which `dot` keeps for gradients that quantize from
            the high-precision source (`input`): half the bytes of its
            float32 cast, and the same values.
    """

    def __init__(self, recipe, rows, dtypes, scaling=None, source_x=None):
        self.forward_format = recipe.forward_format
        self.backward_format = recipe.backward_format
        self.margin = recipe.margin
        self.rows = rows
        self.dtypes = dtypes
        self.scaling = scaling
        self.saved = {}
        self.source_x = source_x
        self.save_codes = recipe.save_activations == "fp8"
        # Whether the kernel gradient's GEMM multiplies FP8 codes: False
        # where it runs in high precision (`high_precision.py`), so that a
        # forward makes no operand for it.
        self.quantized_kernel_gradient = True
        # K, kept apart from the input, which may go after the forward.
        self.input_columns = None if source_x is None else source_x.shape[1]
        self._input_codes = None
        self._forward_keys = frozenset()

    def input(self):
        """The layer's input `[M, K]` in float32, for a gradient's GEMM
        (cast from `source_x`: exact); with `save_activations="fp8"`, the
        values of the forward's codes (`keep_input_codes`)."""
        if self._input_codes is not None:
            return self._input_codes()
        return ops.cast(self.source_x, "float32")

    def keep_input_codes(self, values):
        """With `save_activations="fp8"`: `values()` (a function of the
        forward's codes and scales, which it holds) is what `input()`
        gives the gradients from now on, and the input itself goes after
        the forward. Without it, nothing."""
        if self.save_codes:
            self._input_codes = values

    def observe(self, name, x, scale, fmt):
        """Records the statistics row of one quantization, when `rows`
        asks for them; nothing at all when it is None or makes them from
        the amaxes itself."""
        if self.rows is not None and not self.rows.from_amaxes:
            index = stats_module.TENSORS.index(name)
            self.rows[name] = stats_module.tensor_row(
                x, scale, fmt, self.rows.counts, self.rows.amaxes.get(index)
            )

    def observe_counted(self, name, x, flushed, saturated):
        """Records the statistics row of a quantization that counted its
        flushed and saturated values itself (boolean masks of `x`'s
        shape, as NVFP4's two-level scales need), when `rows` asks."""
        if self.rows is not None:
            index = stats_module.TENSORS.index(name)
            self.rows[name] = stats_module.counted_row(
                x, flushed, saturated, self.rows.amaxes.get(index)
            )

    def once(self, key, compute):
        """`compute()`, once per call: an operand two roles share."""
        if key not in self.saved:
            self.saved[key] = compute()
        return self.saved[key]

    def end_forward(self, keep_input=True):
        """Marks what `saved` holds now as the forward's: what the
        gradients add later goes with `end_backward`. Without
        `keep_input`, lets the layer's input go (`input()` no longer
        serves)."""
        self._forward_keys = frozenset(self.saved)
        if not keep_input or self._input_codes is not None:
            self.source_x = None

    def end_backward(self):
        """Drops what the gradients added to `saved` (the output
        gradient's codes, shared by the two gradient GEMMs). PyTorch keeps
        a custom gradient's closure, and so this call, until the whole
        graph is freed after the step's backward: without this, every
        layer's gradient codes would stay in memory until the backward
        ends (an H100's FP8 decoder step peaked 9.4 GiB above bfloat16's
        before this). A second backward computes them again."""
        for key in set(self.saved) - self._forward_keys:
            del self.saved[key]


def operand(x, fmt, axes, margin, scale=None, layouts=ROW):
    """`x` quantized as GEMM operands, one per layout, and its scales
    (kept as size-1 dimensions over `axes`)."""
    return quantize_reduced(x, fmt, axes, margin, scale, layouts)


def kernel_operand(w, fmt, axes, margin, layouts, shape=None):
    """`operand` of the kernel (reshaped to `shape`, where given),
    computed once while the kernel is unchanged
    (`keras_mp.backend.torch.versions.reuse`: on PyTorch, once per
    optimizer step however many calls and micro-steps share it). Current
    scaling only: the codes then depend on the kernel alone."""

    def compute():
        tensor = w if shape is None else ops.reshape(w, shape)
        return operand(tensor, fmt, axes, margin, None, layouts)

    key = ("kernel", fmt, axes, margin, layouts, shape)
    return torch_versions.reuse(w, key, compute)


def pad_rows(t, multiple):
    """2-D `t` with zero rows appended up to a multiple of `multiple` (a
    token count for the kernel gradient's blocks): a zero changes no
    block's amax and no sum."""
    rows = ops.shape(t)[0]
    pad = -rows % multiple
    if isinstance(rows, int):
        return ops.pad(t, ((0, pad), (0, 0))) if pad else t
    # A TensorFlow graph of unknown batch size: `pad` is a tensor.
    return ops.concatenate([t, ops.zeros((pad, t.shape[1]), t.dtype)], 0)


def scaled(product, factor):
    """A GEMM's product (float32, or bfloat16 where its result is cast to
    bfloat16: `einsum_float32`) times float32 power-of-two scales, in
    float32: exact wherever the result is a normal number, so a bfloat16
    product gives the bits of the float32 one, rounded."""
    return ops.cast(product, "float32") * factor


class Quantizer(abc.ABC):
    """One FP8 format at one scale granularity.

    Subclasses give `name`, the public `quantize` / `dequantize` pair, and
    the three GEMM roles of `dot`. Each role takes float32 2-D operands
    (`x`: `[M, K]`, the kernel `w`: `[K, N]`, the output gradient `g`:
    `[M, N]`) and returns a float32 (or the role's result dtype) product
    with every scale applied.
    """

    name = None
    # Whether the gradients' GEMMs quantize from the high-precision `x`
    # (`call.input()`) and kernel the forward keeps (`call.saved["w"]`)
    # rather than reuse the forward's codes: then the forward may run in
    # high precision (`high_precision.py`).
    quantizes_from_source = False
    # Whether the gradients read the layer's input (`call.input()`): where
    # they do not, `dot` lets it go after the forward (the backward keeps
    # only what the gradients use, as JAX's and TensorFlow's graphs do).
    backward_reads_input = True
    # Whether the roles also take bfloat16 and float16 `x` and `g` as they
    # are, where the backend reads them (`keras_mp.backend.fp8.reads_16bit`),
    # giving the codes of their float32 casts.
    reads_16bit = False

    # The shape a frozen layer stores its kernel in (`frozen_variables`):
    # `"kernel"`, the layer's own kernel's, or `"matrix"`, its GEMM's
    # `[K, N]` (where the blocks run along K).
    frozen_layout = "kernel"
    # Whether a frozen layer fixes its input's scale (`freeze_kernel`'s
    # `input_scale`); where not, each call scales its input itself.
    frozen_input_scale = False

    def keeps_input(self, call):
        """Whether `dot` keeps the layer's input after this call's forward
        for its gradients (`call.input()`): `backward_reads_input`, unless
        a quantizer's forward made what they read of it already."""
        return self.backward_reads_input

    @abc.abstractmethod
    def quantize(self, x, fmt, axis, margin, scale, block_shape):
        """`(codes, scale)` of float32 `x`, as `keras_mp.fp8.quantize`
        returns them; `axis` is already non-negative."""

    @abc.abstractmethod
    def dequantize(self, codes, scale, axis, block_shape):
        """The float32 values of `codes` and their `scale`."""

    def check(self, kernel_shape, recipe):
        """Raises ValueError where a `[K, N]` kernel cannot run this way;
        every shape can, unless a quantizer says otherwise."""
        return None

    @abc.abstractmethod
    def forward(self, call, x, w):
        """`x @ w`, saving in `call` what the gradients reuse."""

    @abc.abstractmethod
    def input_gradient(self, call, g):
        """`g @ w^T`."""

    @abc.abstractmethod
    def kernel_gradient(self, call, g):
        """`x^T @ g`."""

    @property
    def freezes(self):
        """Whether this quantizer stores a frozen kernel itself
        (`frozen_variables`, `freeze_kernel`, `kernel_from_frozen`);
        `keras_mp.fp8.freeze` stores the kernels of the others as
        tensorwise E4M3 codes and one scale."""
        return type(self).freeze_kernel is not Quantizer.freeze_kernel

    def _no_frozen_form(self):
        return ValueError(
            f"The {self.name!r} quantizer has no frozen form: it does not "
            "say what a frozen layer stores in place of its float kernel. "
            f"Received: a frozen ({self.name!r}) layer. Freeze with "
            "`keras_mp.fp8.freeze`, which stores such kernels as tensorwise "
            "E4M3 codes, or give the quantizer `frozen_variables`, "
            "`freeze_kernel` and `kernel_from_frozen`."
        )

    def frozen_variables(self, shape):
        """What a frozen layer (`Recipe(scaling="static")`,
        `keras_mp.fp8.freeze`) stores in place of its float kernel of
        `shape` (in `frozen_layout`): `{name: (shape, dtype,
        initializer)}` of non-trainable variables, saved and loaded by
        these names."""
        raise self._no_frozen_form()

    def freeze_kernel(self, kernel, recipe, input_scale=None):
        """`{name: value}` of `frozen_variables` for the float32 `kernel`
        (in `frozen_layout`) of a layer trained with `recipe`: what its
        forward GEMM multiplied, stored. `input_scale` is the input's
        fixed scale (a float) where `frozen_input_scale`, else None."""
        raise self._no_frozen_form()

    def kernel_from_frozen(self, state, recipe):
        """`(kernel, arguments)`: from a frozen layer's `{name: tensor}`
        (`frozen_variables`) and its static `recipe`, the float32 kernel
        (in `frozen_layout`) its GEMM multiplies and the keyword arguments
        of `keras_mp.fp8.dot` / `einsum` that run that GEMM (`recipe`,
        and any fixed scales)."""
        raise self._no_frozen_form()

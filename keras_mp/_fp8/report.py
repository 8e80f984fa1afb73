"""`report`: what the FP8 layers of a model saw in their last training step.

Reads each layer's statistics carrier (`stats.py`; one host read, at report
time) and turns it into rows: per layer and tensor (input, kernel, output
gradient), the format, the amax as its histogram bin's range, the exact
scale that amax gets (for MXFP8: the E8M0 scale of the block holding it;
for NVFP4: the block's E4M3 scale over the tensor scale, `448 / S_enc`,
about `amax / 6`, as exact as the bin's amax), and the fractions of values
saturated and flushed to zero.
"""

import collections

import keras
import numpy as np

from keras_mp import _keras_internals
from keras_mp._fp8 import stats as stats_module
from keras_mp._fp8.formats import mxfp8
from keras_mp._fp8.formats import nvfp4
from keras_mp._fp8.formats.e4m3_e5m2 import scale_from_amax
from keras_mp._fp8.recipe_fields import NV_FORMATS

_HOW_TO_COUNT = (
    "e.g. `keras_mp.set_global_policy('mixed_bfloat16', "
    "fp8=keras_mp.fp8.Recipe(stats=True))` before building the model, or "
    "`keras_mp.Policy('mixed_bfloat16', fp8=keras_mp.fp8.Recipe("
    "stats=True))` in its precision rules"
)

ReportRow = collections.namedtuple(
    "ReportRow",
    [
        "layer",
        "tensor",
        "format",
        "amax_low",
        "amax_high",
        "scale",
        "saturated",
        "flushed",
        "count",
    ],
)
ReportRow.__doc__ = """One tensor of one FP8 layer in its last step.

`amax_low` and `amax_high` bound the tensor's largest magnitude (the range
of its histogram bin; over several calls in a step, from the lowest to the
highest bin; inf where it overflowed); `scale` is the power-of-two scale of
the highest amax (MXFP8: its block's E8M0 scale; NVFP4: its block's
dequantization scale `448 / S_enc`, from a representative amax of its
bin, about `amax / 6`); `saturated` and `flushed` are fractions of `count`
values.
"""


class Report:
    """The FP8 statistics of a model's last training step, by layer.

    Returned by `keras_mp.fp8.report`. Iterating gives `ReportRow`s;
    `notes` says which FP8 layers have no statistics, and why; `str()` is
    a fixed-width table.

    Args:
        rows: A list of `ReportRow`.
        notes: A list of `(layer path, why it has no rows)`. Defaults to
            `()`.
    """

    def __init__(self, rows, notes=()):
        self.rows = list(rows)
        self.notes = list(notes)

    def __iter__(self):
        return iter(self.rows)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]

    def flagged(self, saturated=None, flushed=None):
        """The rows whose saturated or flushed fraction is above a threshold.

        Args:
            saturated: The largest acceptable saturated fraction, or None
                (not checked). Defaults to `None`.
            flushed: The largest acceptable flushed fraction, or None.
                Defaults to `None`.

        Returns:
            A list of `ReportRow`.
        """
        return [
            row
            for row in self.rows
            if (saturated is not None and row.saturated > saturated)
            or (flushed is not None and row.flushed > flushed)
        ]

    def __str__(self):
        # As wide as the longest layer path: each row names its layer.
        paths = [row.layer for row in self.rows] + [n[0] for n in self.notes]
        width = max([len("layer"), *map(len, paths)])
        header = (
            f"{'layer':<{width}} {'tensor':<15} {'format':<6} "
            f"{'amax':>21} {'scale':>9} {'saturated':>9} {'flushed':>9} "
            f"{'count':>9}"
        )
        lines = [header, "-" * len(header)]
        for row in self.rows:
            amax = f"{row.amax_low:.3g}..{row.amax_high:.3g}"
            lines.append(
                f"{row.layer:<{width}} {row.tensor:<15} {row.format:<6} "
                f"{amax:>21} {row.scale:>9.3g} {row.saturated:>9.2%} "
                f"{row.flushed:>9.2%} {row.count:>9d}"
            )
        for layer, why in self.notes:
            lines.append(f"{layer:<{width}} {why}")
        return "\n".join(lines)

    def __repr__(self):
        return f"<Report: {len(self.rows)} rows>\n{self}"


def _recipe(layer):
    """The FP8 recipe of `layer`'s policy (its entry in a policy map)."""
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        policy = policy[layer.path] if layer.path else policy.default_policy
    return getattr(policy, "fp8", None)


def _scale(amax, fmt, recipe):
    """The scale `amax` gets: a tensor's, its MX block's E8M0 scale, or
    its NVFP4 block's `dec_block / S_enc`."""
    if recipe.formats in NV_FORMATS:
        # The block holding the tensor's amax takes the E4M3 scale 448 (its
        # amax times `S_enc / 6`, `S_enc = 2688 / amax`): its values are
        # E2M1 codes times `448 / S_enc`, about `amax / 6`.
        s_enc = nvfp4.tensor_scale(np.float32(amax))
        return float(keras.ops.convert_to_numpy(nvfp4.E4M3_MAX / s_enc))
    if recipe.scale_rounding is not None:
        code = mxfp8.e8m0_from_amax(
            np.float32(amax), recipe.scale_rounding, fmt
        )
        scale = mxfp8.scale_values(code)
    else:
        scale = scale_from_amax(amax, fmt, recipe.margin)
    return float(keras.ops.convert_to_numpy(scale))


def _layer_rows(path, recipe, values):
    rows = []
    formats = (recipe.forward_format,) * 2 + (recipe.backward_format,)
    for tensor, fmt, row in zip(stats_module.TENSORS, formats, values):
        count = int(row[stats_module.COUNT])
        bins = np.flatnonzero(row[: stats_module.HISTOGRAM_BINS])
        low = stats_module.bin_range(bins[0])[0]
        high = stats_module.bin_range(bins[-1])[1]
        amax = stats_module.bin_amax(bins[-1])
        rows.append(
            ReportRow(
                layer=path,
                tensor=tensor,
                # MX and NVFP4: the format and its elements' ("mxfp8
                # e5m2", "nvfp4 e2m1").
                format=fmt
                if recipe.granularity not in ("microblock", "nvfp4")
                else f"{recipe.formats.split('_')[0]} {fmt}",
                amax_low=low,
                amax_high=high,
                scale=_scale(amax, fmt, recipe),
                saturated=float(row[stats_module.SATURATED]) / max(count, 1),
                flushed=float(row[stats_module.FLUSHED]) / max(count, 1),
                count=count,
            )
        )
    return rows


def report(model):
    """The FP8 statistics of each FP8 layer of `model` in its last step.

    Statistics are opt-in: layers count them when their recipe has
    `stats=True` (`keras_mp.fp8.Recipe(stats=True)`), inside the training
    step with no host read; this function reads them once. For each layer
    and tensor (the input and the kernel as the forward GEMM quantized
    them, the output gradient as the input-gradient GEMM did): the format,
    the amax (as the range of its histogram bin), its scale, and the
    fractions saturated (|x / scale| above the format's largest value
    before the clip) and flushed to zero (a non-zero value whose code is
    zero), each value with its own scale (per row or tile with
    `"rowwise"` and `"block"`, per block with MXFP8; with NVFP4, E2M1's 6
    and the block's `dec_block / S_enc`, the output gradient counted as
    its stochastic rounding rounded it). A layer called several times in a step
    shows its amax as the range from the lowest to the highest bin and
    the summed counts; under tf.distribute replicas and over an
    accumulation window, the bins of all and the
    worst one's counts (see `keras_mp/_fp8/stats.py`). Under
    `keras_mp.LossScaleOptimizer` the output gradient's amax is free of
    the loss scale; under Keras's own `LossScaleOptimizer` it is
    multiplied by it. A frozen layer (`trainable=False`) and a layer that
    has not trained yet have notes instead of rows.

    Args:
        model: A built Keras model (or layer).

    Returns:
        An `Report`.

    Raises:
        ValueError: `model` has no FP8 layer, or none counts statistics.
    """
    layers = _keras_internals.all_layers(model)
    fp8_layers = [(layer, _recipe(layer)) for layer in layers]
    fp8_layers = [(layer, r) for layer, r in fp8_layers if r is not None]
    if not fp8_layers:
        raise ValueError(
            "`keras_mp.fp8.report` reads the statistics of FP8 layers, and "
            f"this model has none. Received: model={model.name!r}. Give "
            "its Dense and EinsumDense layers an FP8 recipe that counts "
            f"statistics, {_HOW_TO_COUNT}."
        )
    if not any(r.stats for _, r in fp8_layers):
        raise ValueError(
            "`keras_mp.fp8.report` reads statistics that FP8 layers count "
            "only when their recipe asks for them, and no FP8 layer of "
            f"this model does. Received: model={model.name!r} with recipes "
            f"{sorted({repr(r) for _, r in fp8_layers})}. Use "
            f"`keras_mp.fp8.Recipe(stats=True)`, {_HOW_TO_COUNT}."
        )
    rows, notes = [], []
    for layer, recipe in fp8_layers:
        if not recipe.stats:
            continue
        path = layer.path or layer.name
        carrier = stats_module.layer_carrier(layer)
        if carrier is None:
            notes.append((path, "not built yet: no statistics"))
            continue
        if not (layer.trainable and carrier.trainable):
            notes.append(
                (path, "frozen (trainable=False): no statistics are counted")
            )
            continue
        values = keras.ops.convert_to_numpy(carrier)
        if not values[:, stats_module.COUNT].any():
            notes.append((path, "no training step yet"))
            continue
        rows.extend(_layer_rows(path, recipe, values))
    return Report(rows, notes)

"""Overflow tracking: which variables' gradients were non-finite, and when.

`OverflowTrackingMixin`, a base of `LossScaleOptimizer`
(`track_overflow=True`): two integer variables counted inside the step,
`overflow_report()` read on the host, and the `check_min_scale` policy;
the `OverflowRecord(s)` they report in. Imports `keras_mp.backend` and
`optimizers/overwrite_with_gradient.py`; never `loss_scale_optimizer.py`
or `wrapper.py`.
"""

import collections
import warnings

import keras
import numpy as np
from keras import ops

from keras_mp.backend import gradients as backend_gradients
from keras_mp.optimizers.overwrite_with_gradient import overwrites_with_gradient


class OverflowTrackingMixin:
    """Overflow counters and reports of a `LossScaleOptimizer`.

    Relies on the optimizer's `track_overflow`, `_trainable_variables`,
    `iterations`, `_skipped_steps` and `_loss_scale`.
    """

    def _build_overflow_tracking(self):
        """The two counters, when `track_overflow` is set."""
        if self.track_overflow:
            # One entry per trainable variable, in `var_list` order: two
            # variables in all, however large the model.
            count = len(self._trainable_variables)
            self._overflow_counts = self.add_variable(
                shape=(count,),
                dtype="int32",
                initializer="zeros",
                aggregation="only_first_replica",
                name="overflow_counts",
            )
            self._overflow_first_steps = self.add_variable(
                shape=(count,),
                dtype="int32",
                initializer=keras.initializers.Constant(-1),
                aggregation="only_first_replica",
                name="overflow_first_steps",
            )

    def _track_overflow(self, grads_and_vars, finite_per_gradient):
        flags = [False] * len(self._trainable_variables)
        checks = iter(finite_per_gradient)
        for grad, variable in grads_and_vars:
            if grad is None:
                continue
            finite = next(checks)
            # A non-finite amax history still skips the step, but is not
            # the overflow to report: the gradient it came from is.
            if not overwrites_with_gradient(variable):
                flags[self._get_variable_index(variable)] = ops.logical_not(
                    finite
                )
        overflowed = ops.stack(
            [ops.convert_to_tensor(flag, "bool") for flag in flags]
        )
        step = ops.add(
            ops.cast(self.iterations, "int32"),
            ops.convert_to_tensor(self._skipped_steps.value, "int32"),
        )
        counts = ops.convert_to_tensor(self._overflow_counts.value, "int32")
        first = ops.convert_to_tensor(self._overflow_first_steps.value, "int32")
        self._overflow_counts.assign(counts + ops.cast(overflowed, "int32"))
        self._overflow_first_steps.assign(
            ops.where(
                ops.logical_and(overflowed, ops.less(first, 0)), step, first
            )
        )

    def overflow_report(self, top=10):
        """Which variables' gradients overflowed, worst first.

        Needs `track_overflow=True`. Reads two small integer variables
        (one host copy); call it between steps, not inside one.

        Args:
            top: How many records to return at most, or None for all.
                Defaults to `10`.

        Returns:
            An `OverflowRecords` list of `OverflowRecord(path, layer, count,
            first_step)`, most overflows first (then earliest); only
            variables whose gradient was non-finite at least once. `str()`
            of it is a table. `first_step` counts every step, applied or
            skipped, from 0.
        """
        if not self.track_overflow:
            raise ValueError(
                "overflow_report() needs an optimizer created with "
                "track_overflow=True. Received an optimizer with "
                "track_overflow=False. Create it as "
                "keras_mp.LossScaleOptimizer(..., track_overflow=True)."
            )
        if not self.built:
            return OverflowRecords([])
        counts, first_steps = (
            np.asarray(ops.convert_to_numpy(v.value))
            for v in (self._overflow_counts, self._overflow_first_steps)
        )
        return overflow_records(
            self._trainable_variables, counts, first_steps, top
        )

    def check_min_scale(self, skipped_steps=None, loss_scale=None):
        """Applies the loss scale's `on_min_scale` policy, on the host.

        Steps that overflow while the dynamic scale sits at its
        `min_loss_scale` cannot be rescued by lowering it. When more steps
        were skipped since the last check and the scale is at its floor,
        this warns once (`"warn"`), raises `FloatingPointError`
        (`"raise"`) or does nothing (`"ignore"`). `fit` calls it through
        `LossScaleLogger` each time that reads the state (once per epoch by
        default); call it yourself every few steps in your own loop.

        Args:
            skipped_steps: The current `skipped_steps` value, if already read
                (saves a host copy). Defaults to reading it.
            loss_scale: The current scale value, if already read. Defaults
                to reading it.
        """
        scale = self._loss_scale
        if not scale.is_dynamic or not self.built:
            return
        if skipped_steps is None:
            skipped_steps = int(ops.convert_to_numpy(self._skipped_steps.value))
        if loss_scale is None:
            loss_scale = float(ops.convert_to_numpy(scale()))
        previous = self._min_scale_checked_skips
        self._min_scale_checked_skips = skipped_steps
        if (
            scale.on_min_scale == "ignore"
            or loss_scale > scale.min_loss_scale
            or previous is None
            or skipped_steps <= previous
        ):
            return
        message = (
            f"LossScaleOptimizer {self.name!r}: {skipped_steps - previous} "
            "more step(s) were skipped for non-finite gradients and the loss "
            f"scale sits at its min_loss_scale={scale.min_loss_scale:g}, "
            "where lowering it cannot help: the loss or the model overflows "
            "in 16 bits by itself."
        )
        if self.track_overflow:
            worst = self.overflow_report(top=3)
            if worst:
                names = ", ".join(f"{r.path} ({r.count}x)" for r in worst)
                message += f" Worst variables: {names}."
        message += (
            " Compute the overflowing layers in float32 (dtype='float32' on "
            "the layer, or a float32 loss), lower min_loss_scale, or use "
            "mixed_bfloat16. Set on_min_scale='ignore' on the "
            "DynamicLossScale to silence this."
        )
        if scale.on_min_scale == "raise":
            raise FloatingPointError(message)
        if not self._warned_min_scale:
            self._warned_min_scale = True
            warnings.warn(message, stacklevel=2)


def finite_per_gradient(grads):
    """One bool scalar per gradient that is not None: all its values finite."""
    return [
        ops.isfinite(backend_gradients.gradient_sum(g))
        for g in grads
        if g is not None
    ]


def exactly_finite_per_gradient(grads):
    """As `finite_per_gradient`, by `isfinite` of every value: exact where
    a sum of finite values could overflow (PyTorch's host-decided steps,
    which check only on the steps that overflowed)."""
    return [
        ops.all(ops.isfinite(backend_gradients.gradient_values(g)))
        for g in grads
        if g is not None
    ]


def all_of(checks):
    if not checks:
        return ops.convert_to_tensor(True)
    return ops.all(ops.stack(checks))


class OverflowRecord(
    collections.namedtuple(
        "OverflowRecord", ["path", "layer", "count", "first_step"]
    )
):
    """One variable of `LossScaleOptimizer.overflow_report()`.

    Attributes:
        path: The variable's path, e.g. `"dense_1/kernel"`.
        layer: The name of the layer that owns it (the path's parent).
        count: Steps whose gradient for it was non-finite.
        first_step: The first such step, counting every step from 0.
    """

    __slots__ = ()


class OverflowRecords(list):
    """A list of `OverflowRecord`s whose `str()` is a readable table."""

    def __str__(self):
        if not self:
            return "No gradient overflowed."
        header = ("variable", "layer", "overflows", "first step")
        rows = [header] + [
            (r.path, r.layer, str(r.count), str(r.first_step)) for r in self
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [
            "  ".join(
                cell.ljust(width) if i < 2 else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(row, widths))
            ).rstrip()
            for row in rows
        ]
        lines.insert(1, "  ".join("-" * width for width in widths))
        return "\n".join(lines)


def overflow_records(variables, counts, first_steps, top=None):
    """The `OverflowRecords` of counters read from a tracking optimizer."""
    records = [
        OverflowRecord(
            path=variable.path,
            layer=variable.path.rsplit("/", 2)[-2]
            if "/" in variable.path
            else "",
            count=int(count),
            first_step=int(first),
        )
        for variable, count, first in zip(variables, counts, first_steps)
        if count > 0
    ]
    records.sort(key=lambda r: (-r.count, r.first_step, r.path))
    return OverflowRecords(records if top is None else records[:top])

"""Gradient accumulation windows under loss scaling.

`AccumulationMixin`, a base of `LossScaleOptimizer`: an inner optimizer
with `gradient_accumulation_steps` accumulates unscaled micro-gradients; a
window with a non-finite micro-step is discarded whole, and the loss scale
is updated once per window. Imports `keras_mp.backend` and
`keras_mp._keras_internals`; never `loss_scale_optimizer.py` or
`wrapper.py`.
"""

import keras
from keras import ops

from keras_mp import _keras_internals
from keras_mp.backend import collectives
from keras_mp.backend import gradients as backend_gradients


class AccumulationMixin:
    """Accumulation windows of a `LossScaleOptimizer`.

    Relies on the optimizer's `_base_optimizer()`, `apply_if`,
    `_loss_scale` and `_skipped_steps`.
    """

    def _build_accumulation(self):
        """The window's finite flag, when the inner optimizer accumulates."""
        if self._accumulation_steps():
            # Whether every micro-step of the current accumulation window
            # had finite gradients (1) or not (0).
            self._window_finite = self.add_variable(
                shape=(),
                dtype="int32",
                initializer="ones",
                aggregation="only_first_replica",
                name="window_finite",
            )

    def _accumulation_steps(self):
        return getattr(self._base_optimizer(), "gradient_accumulation_steps", 0)

    def _accumulation_flags(self, is_finite):
        """`(window_finite, last, apply)` of this micro-step, bool tensors.

        `is_finite` is the micro-step's flag, already the same in every
        process. `window_finite`: every micro-step of the window so far was
        finite; `last`: this micro-step ends the window; `apply`: the inner
        optimizer runs (it accumulates, or applies a finite window).
        """
        base = self._base_optimizer()
        window_finite = ops.logical_and(
            ops.cast(self._window_finite.value, "bool"), is_finite
        )
        # Keras counts micro-steps in `_iterations` (`iterations` is that
        # floor-divided by `steps`).
        last = ops.equal(
            ops.mod(
                ops.cast(base._iterations.value, "int32") + 1,
                base.gradient_accumulation_steps,
            ),
            0,
        )
        apply = ops.logical_or(ops.logical_not(last), window_finite)
        return window_finite, last, apply

    def _run_accumulation_step(
        self, grads_and_vars, is_finite, flags, on_host=None
    ):
        """One micro-step of an inner optimizer that accumulates gradients.

        As in torch AMP's recipe: each micro-step's gradients are unscaled
        before the inner optimizer accumulates them; a window with any
        non-finite micro-step is discarded whole at its last micro-step
        (weights and slots unchanged, accumulators emptied, one skipped
        step); the loss scale is updated once per window, from all of it.

        Args:
            grads_and_vars: The micro-step's gradients and variables.
            is_finite: Its flag, the same in every process (under DDP's
                `no_sync` each process's micro-gradients are its own, so
                the caller reduces the flag across processes).
            flags: `_accumulation_flags(is_finite)`.
            on_host: `(finite, apply, last)` as Python bools, read on the
                host (PyTorch's default), or None to decide on the device.
        """
        base = self._base_optimizer()
        steps = base.gradient_accumulation_steps
        window_finite, last, apply = flags
        micro_steps = base._iterations
        accumulators = _keras_internals.accumulated_gradients(base)
        # Under `no_sync` each process's accumulators hold only its own
        # micro-gradients: averaged across processes before the last
        # micro-step's update, every process applies the global window. A
        # discarded window (its last micro-step, not applied) empties the
        # accumulators and starts again: `iterations` counts applied
        # updates only.
        if on_host is None:
            # Non-finite micro-gradients are accumulated as zeros (the
            # window is discarded anyway), so the accumulators stay finite.
            safe = [
                (
                    None
                    if g is None
                    else backend_gradients.map_gradient(
                        lambda x: ops.where(is_finite, x, ops.zeros_like(x)),
                        g,
                    ),
                    v,
                )
                for g, v in grads_and_vars
            ]
            collectives.average_across_processes_where(last, accumulators)
            self.apply_if(apply, safe)
            discard = ops.logical_and(last, ops.logical_not(window_finite))
            for accumulator in accumulators:
                value = accumulator.value
                accumulator.assign(
                    ops.where(discard, ops.zeros_like(value), value)
                )
            micro_steps.assign(
                ops.where(
                    discard, micro_steps.value - (steps - 1), micro_steps.value
                )
            )
            self._skipped_steps.assign_add(ops.cast(discard, "int32"))
        else:
            finite, apply_now, last_now = on_host
            if not finite:
                grads_and_vars = [
                    (None if g is None else ops.zeros_like(g), v)
                    for g, v in grads_and_vars
                ]
            collectives.average_across_processes_where(last_now, accumulators)
            self.apply_if(apply_now, grads_and_vars)
            if not apply_now:
                for accumulator in accumulators:
                    accumulator.assign(ops.zeros_like(accumulator.value))
                micro_steps.assign(micro_steps.value - (steps - 1))
                self._skipped_steps.assign_add(1)
        self._update_loss_scale_where(last, window_finite)
        self._window_finite.assign(
            ops.cast(ops.logical_or(last, window_finite), "int32")
        )

    def _update_loss_scale_where(self, condition, is_finite):
        """`loss_scale.update(is_finite)` where `condition` holds, else none."""
        variables = self._loss_scale.variables
        current = [v.value for v in variables]
        with keras.StatelessScope(
            state_mapping=list(zip(variables, current))
        ) as scope:
            self._loss_scale.update(is_finite)
        for variable, old in zip(variables, current):
            variable.assign(
                ops.where(condition, scope.get_current_value(variable), old)
            )

"""PyTorch's skips: decided on the host (the default), or fused Adam's.

`HostSkipMixin`, a base of `LossScaleOptimizer`. Keras's PyTorch `fit`
runs each step eagerly and its optimizers update in place, so a skip that
never reads its flag on the host must save and restore all the state
(`skip.py`, kept for `skip_on_device=True`). By default on PyTorch a step
is instead one fused check-and-unscale pass over the gradients, the flag
reduced across processes and read once on the host, then the inner
optimizer's own update or nothing: no copy of the state (DESIGN.md, "The
skip decision and the host"). With `skip_on_device=True` and Keras's own
Adam or AdamW, the update is instead torch's fused AdamW kernel, which
leaves the state untouched where a device flag says so (within the
tolerance stated in `backend/torch/fused_adam.py`). Imports
`keras_mp.backend`, `keras_mp._keras_internals`, `optimizers/overflow.py` and
`optimizers/overwrite_with_gradient.py`; never `loss_scale_optimizer.py` or
`wrapper.py`.
"""

import keras
from keras import ops

from keras_mp import _keras_internals
from keras_mp.backend import collectives
from keras_mp.backend import gradients as backend_gradients
from keras_mp.backend.torch import fused_adam
from keras_mp.optimizers import overflow
from keras_mp.optimizers.overwrite_with_gradient import overwrites_with_gradient


class HostSkipMixin:
    """The PyTorch steps of a `LossScaleOptimizer` with a dynamic scale
    that need no saved copy of the state: decided on the host (default), or
    torch's fused Adam skipping on the device flag (opt-in).

    Relies on the optimizer's `skip_on_device`, `_unscale_in_step`,
    `_reciprocal_scale()`, `track_overflow`, `_track_overflow`, the
    accumulation methods, `apply_if`, `transform_gradients`,
    `_transforms`, `_state_dtype`, `_master_weights`, `_inner_optimizer`,
    `_loss_scale` and `_skipped_steps`.
    """

    def _skips_on_host(self):
        """Whether this step's skip is decided by a Python branch."""
        return keras.backend.backend() == "torch" and not self.skip_on_device

    def _unscale_and_check(self, grads_and_vars):
        """The step's gradients unscaled in one fused pass, and whether all
        are finite in every process: `(grads_and_vars, is_finite)`."""
        import torch

        # Gradients may come as NumPy arrays; torch tensors pass as they are.
        grads = [
            g
            if g is None or isinstance(g, torch.Tensor)
            else ops.convert_to_tensor(g)
            for g, _ in grads_and_vars
        ]
        variables = [v for _, v in grads_and_vars]
        # Gradients that overwrite their variable are checked, never
        # unscaled (see `split_overwritten`).
        unscale = [
            self._unscale_in_step and not overwrites_with_gradient(v)
            for v in variables
        ]
        # The reciprocal only where a gradient is multiplied by it (a scale
        # of 1, `skip_nonfinite` alone, multiplies none).
        factor = self._reciprocal_scale() if any(unscale) else None
        grads, is_finite = backend_gradients.unscale_and_check_finite(
            grads, variables, factor, unscale
        )
        # Unscaled now: `transform_gradients`, and every override of it,
        # receives them so.
        self._unscale_in_step = False
        is_finite = collectives.all_processes_finite(is_finite)
        return list(zip(grads, variables)), is_finite

    def _run_step_on_host(self, grads_and_vars):
        grads_and_vars, is_finite = self._unscale_and_check(grads_and_vars)
        accumulating = bool(self._accumulation_steps())
        flags = [is_finite]
        if accumulating:
            window_flags = self._accumulation_flags(is_finite)
            flags += [window_flags[2], window_flags[1]]
        else:
            # The scale's update takes the flag on the device: queued
            # before the host read, its kernels are launched while the
            # device still runs the backward, not after the read, when the
            # device waits for each launch (on an H200 the step took 1.03x
            # the plain step's with the update after the read).
            self._loss_scale.update(is_finite)
        # The one host read of the step: free on CPU tensors, one small
        # copy on an accelerator, as torch.amp's GradScaler makes.
        on_host = _read_on_host(flags)
        finite = on_host[0]
        if self.track_overflow and not finite:
            # Which variables overflowed, counted only on the steps that
            # did (exactly, with `isfinite`; finite steps add nothing).
            self._track_overflow(
                grads_and_vars,
                overflow.exactly_finite_per_gradient(
                    [g for g, _ in grads_and_vars]
                ),
            )
        if accumulating:
            self._run_accumulation_step(
                grads_and_vars, is_finite, window_flags, on_host=on_host
            )
            return
        self.apply_if(finite, grads_and_vars)
        if not finite:
            self._skipped_steps.assign_add(1)
        self._count_on_host(skipped=not finite)

    def _runs_fused_adam(self, grads_and_vars):
        """Whether the opt-in skip can be torch's fused Adam: Keras's own
        Adam or AdamW as the inner optimizer, the pipeline's update stages
        not overridden, and no state the fused kernel would not guard
        (stateful transforms, 16-bit slots, masters)."""
        if not self.skip_on_device or _keras_internals.in_stateless_scope():
            return False
        if (
            self._transforms.variables
            or self._state_dtype is not None
            or self._master_weights
        ):
            return False
        for name in ("apply_if", "_transform_and_apply", "apply_updates"):
            if not getattr(type(self), name).__module__.startswith("keras_mp."):
                return False
        variables = [v for _, v in grads_and_vars]
        if any(overwrites_with_gradient(v) for v in variables):
            return False
        return fused_adam.supports(
            self._inner_optimizer, [g for g, _ in grads_and_vars], variables
        )

    def _run_fused_adam_step(self, grads_and_vars):
        """The opt-in step with torch's fused Adam: no host read, no copy."""
        grads_and_vars, is_finite = self._unscale_and_check(grads_and_vars)
        if self.track_overflow:
            self._track_overflow(
                grads_and_vars,
                overflow.exactly_finite_per_gradient(
                    [g for g, _ in grads_and_vars]
                ),
            )
        # Stage 5 (stateless transforms only, see `_runs_fused_adam`): on
        # a skipped step what it computes is discarded by the kernel.
        grads_and_vars = self.transform_gradients(grads_and_vars)
        fused_adam.update(
            self._inner_optimizer,
            [g for g, _ in grads_and_vars],
            [v for _, v in grads_and_vars],
            is_finite,
        )
        self._loss_scale.update(is_finite)
        self._skipped_steps.assign_add(
            ops.cast(ops.logical_not(is_finite), "int32")
        )


def _read_on_host(flags):
    """Python bools of bool scalar tensors, in one host read."""
    if len(flags) == 1:
        return (bool(flags[0]),)
    stacked = ops.convert_to_numpy(ops.stack(flags))
    return tuple(bool(flag) for flag in stacked)

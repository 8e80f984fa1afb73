"""FP8 carriers under loss scaling: free of the loss scale, and told it.

`FP8CarriersMixin`, a base of `LossScaleOptimizer`. An FP8 layer with
statistics or delayed scaling passes a carrier variable to its GEMM, whose
gradient holds the amaxes of the step as one-hot histogram bins
(`keras_mp/_fp8/stats.py`); the output gradient's arrive multiplied by the
loss scale, and the optimizer assigns the carrier that gradient as it is.
Before the step, the carriers' gradients are made free of the loss scale
(Keras's own LossScaleOptimizer leaves them loss-scaled); after it, the
loss scale of the next step is written into each delayed layer's carrier
(`keras_mp/_fp8/delayed.py`), whose backward multiplies its output
gradient's scale by it. Imports `keras_mp.fp8`; never
`loss_scale_optimizer.py` or `wrapper.py`.
"""

from keras_mp._fp8 import delayed as fp8_delayed
from keras_mp._fp8 import stats as fp8_stats


class FP8CarriersMixin:
    """The FP8 carriers' bookkeeping of a `LossScaleOptimizer`.

    Relies on the optimizer's `_step_record`, `_scales_by_one()`,
    `_unscale_in_step` and `_loss_scale`.
    """

    def _record_carriers_divided(self):
        """Notes, before the step record is read and cleared, whether
        `get_unscaled_gradients` divided every gradient, the FP8
        statistics carriers' too (it is given no variables)."""
        self._stats_divided = (
            self._step_record.gradients_unscaled and not self._scales_by_one()
        )

    def _carriers_free_of_loss_scale(self, grads_and_vars):
        """The pairs, each FP8 statistics carrier's gradient holding the
        output gradient's amax free of the loss scale."""
        if self._unscale_in_step or self._stats_divided:
            return fp8_stats.loss_scale_free(
                grads_and_vars, self._loss_scale(), self._stats_divided
            )
        return grads_and_vars

    def _write_loss_scale_into_carriers(self, grads_and_vars):
        # The backward of a delayed FP8 layer multiplies its history's
        # output-gradient scale by the loss scale of its step, which it
        # reads from its carrier (on JAX the backward is traced with the
        # forward, before `scale_loss`): the scale after this step's
        # update, written whether the step was applied or skipped.
        carriers = [v for _, v in grads_and_vars if fp8_delayed.is_carrier(v)]
        if not carriers:
            return
        loss_scale = self._loss_scale()
        for carrier in carriers:
            fp8_delayed.write_loss_scale(carrier, loss_scale)

"""A run that keeps failing stops: skipped steps in a row, and the check.

`ConsecutiveSkipsMixin`, a base of `LossScaleOptimizer`
(`max_consecutive_skips`): an integer variable counting the steps skipped
in a row, updated inside the step from what the step did (no host read),
and `check_consecutive_skips`, which `fit` calls on the host at the end of
each batch (`keras_mp.callbacks`) and which raises once the count reaches
the limit; on PyTorch's host-decided step, the step itself calls it after
a skipped step instead (no read on an applied one). Imports
`keras_mp.backend` and `optimizers/overflow.py`; never
`loss_scale_optimizer.py` or `wrapper.py`.

The default limit, 2, is where Megatron-LM and DeepSpeed meet for a step
that no loss scale can rescue. Megatron-LM stops on the first NaN or inf
gradient (`--check-for-nan-in-loss-and-grad` is on by default; the check
in `megatron/core/distributed/param_and_grad_buffer.py` is fatal).
DeepSpeed skips such a step (`bf16.check_grad_overflow`, on by default)
and, under fp16, raises "Current loss scale already at minimum - cannot
decrease scale anymore. Exiting run." at the overflow that finds the
scale at its floor with its hysteresis used up (`hysteresis` 2 and
`raise_error_at_min_scale=True` by default, `deepspeed/runtime/fp16/
loss_scaler.py`): the second overflow at the floor. A scale fixed at 1 is
always at its floor, so one isolated bad batch is skipped, as DeepSpeed
skips it, and a second in a row stops the run, one step after Megatron
would.
"""

import numbers
import weakref

from keras import ops

from keras_mp.backend import training_state
from keras_mp.optimizers import overflow

DEFAULT_MAX_CONSECUTIVE_SKIPS = 2


def check_max_consecutive_skips(value, skip_nonfinite, loss_scale):
    """`value` resolved (`"auto"`) and checked: None or a positive int."""
    if isinstance(value, str) and value == "auto":
        # A dynamic scale's `on_min_scale` already stops such a run.
        if skip_nonfinite and not loss_scale.is_dynamic:
            return DEFAULT_MAX_CONSECUTIVE_SKIPS
        return None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            "`max_consecutive_skips` must be a positive int, None (never "
            "stop) or 'auto'. Received: "
            f"max_consecutive_skips={value!r} (of type "
            f"{type(value).__name__}). Pass e.g. max_consecutive_skips=10."
        )
    if value < 1:
        raise ValueError(
            "`max_consecutive_skips` must be at least 1 (1: stop at the "
            f"first skipped step). Received: max_consecutive_skips={value!r}. "
            "Pass None to never stop."
        )
    return int(value)


class ConsecutiveSkipsMixin:
    """Skipped steps in a row, and the host-side stop, of a
    `LossScaleOptimizer`.

    Relies on the optimizer's `iterations`, `_skipped_steps`,
    `track_overflow`, the overflow counters, `_trainable_variables`,
    `skip_nonfinite`, `_loss_scale`, `add_variable`, `built`,
    `_skips_on_host` and `_accumulation_steps`.
    """

    # Set by `fit` (`keras_mp.models`) where the step itself checks the
    # count: PyTorch's step decided on the host, which knows without a
    # read whether it skipped, and reads the count only then. A per-batch
    # callback would make Keras read every batch's logs on the host.
    _checks_skips_in_step = False
    # Whether the last step decided on the host was skipped.
    _skipped_on_host = False
    # A weak reference to the count's tensor, and its version, after the
    # last applied step's update on the host (`_count_on_host`).
    _settled_count_stamp = None

    def checks_skips_in_step(self):
        """Whether a step can check `max_consecutive_skips` itself, for
        free: on PyTorch, where the skip is a Python branch (no
        `skip_on_device`) on a step that is not an accumulation
        micro-step."""
        return (
            self._max_consecutive_skips is not None
            and self._skips_on_host()
            and not self._accumulation_steps()
        )

    @property
    def max_consecutive_skips(self):
        """Skipped steps in a row that stop `fit`, or None (never)."""
        return self._max_consecutive_skips

    @max_consecutive_skips.setter
    def max_consecutive_skips(self, value):
        value = check_max_consecutive_skips(
            value, self.skip_nonfinite, self._loss_scale
        )
        if self.built and value != self._max_consecutive_skips:
            raise ValueError(
                f"LossScaleOptimizer {self.name!r} is built: its steps hold "
                f"max_consecutive_skips={self._max_consecutive_skips!r} "
                "already. Received: "
                f"max_consecutive_skips={value!r}. Pass it to the "
                "constructor, or set it before the first step."
            )
        self._max_consecutive_skips = value

    @property
    def consecutive_skips(self):
        """Keras variable counting the steps skipped since the last applied
        one, held once it reaches `max_consecutive_skips` (so a check made
        after several steps, `steps_per_execution`, still sees it); None
        without `max_consecutive_skips`. Assign 0 to it to go on."""
        return self._consecutive_skips

    def _build_consecutive_skips(self):
        self._consecutive_skips = None
        if self._max_consecutive_skips is not None:
            self._consecutive_skips = self.add_variable(
                shape=(),
                dtype="int32",
                initializer="zeros",
                aggregation="only_first_replica",
                name="consecutive_skips",
            )

    def _counts_on_host(self):
        """Whether the step counts its skips in a row from the host's flag
        (`_count_on_host`): PyTorch's host-decided step outside
        accumulation, which knows whether it skipped without a read."""
        return (
            self._consecutive_skips is not None
            and self._skips_on_host()
            and not self._accumulation_steps()
        )

    def _count_on_host(self, skipped):
        """The count after a step decided on the host: one more (held at
        the limit) after a skipped step, 0 after an applied one unless
        held. One small update, no read; none after an applied step where
        nothing wrote the count since the last one."""
        if not self._counts_on_host():
            return
        count = self._consecutive_skips.value
        limit = self._max_consecutive_skips
        if skipped:
            self._consecutive_skips.assign(ops.minimum(count + 1, limit))
            self._skipped_on_host = True
            return
        # An applied step's update (0, or the count held at the limit) is
        # idempotent: where the tensor is the one it last wrote, unchanged
        # since (torch's version counter counts every in-place write:
        # `assign`, a checkpoint's load), it would write the same value.
        settled = self._settled_count_stamp
        if (
            settled is not None
            and settled[0]() is count
            and count._version == settled[1]
        ):
            return
        self._consecutive_skips.assign(
            ops.where(count >= limit, count, ops.zeros_like(count))
        )
        count = self._consecutive_skips.value
        self._settled_count_stamp = (weakref.ref(count), count._version)

    def _step_counters(self):
        """`(skipped, applied)` so far, as int32 tensors, or None (no
        count, or one the host-decided step keeps: `_count_on_host`)."""
        if self._consecutive_skips is None or self._counts_on_host():
            return None
        # Copies: on TensorFlow a variable converts to itself, whose value
        # the step is about to change.
        return (
            ops.cast(ops.copy(self._skipped_steps.value), "int32"),
            ops.cast(ops.copy(self.iterations), "int32"),
        )

    def _count_consecutive_skips(self, before):
        """After a step: one more in a row if it was skipped, none if an
        update was applied, unchanged otherwise (an accumulation
        micro-step that neither applies nor discards its window), and
        unchanged once at the limit."""
        if before is None:
            return
        skipped, applied = self._step_counters()
        count = ops.convert_to_tensor(self._consecutive_skips.value, "int32")
        counted = ops.where(
            ops.greater(skipped, before[0]),
            count + 1,
            ops.where(
                ops.greater(applied, before[1]), ops.zeros_like(count), count
            ),
        )
        self._consecutive_skips.assign(
            ops.where(
                ops.greater_equal(count, self._max_consecutive_skips),
                count,
                counted,
            )
        )

    def _check_skips_after_step(self):
        """Inside `fit` on PyTorch's host-decided step: the check, made
        only after a skipped step (one integer read then, none else)."""
        if self._checks_skips_in_step and self._skipped_on_host:
            self._skipped_on_host = False
            self.check_consecutive_skips()

    def check_consecutive_skips(self, consecutive_skips=None, model=None):
        """Raises `FloatingPointError` once `max_consecutive_skips` steps in
        a row were skipped, on the host.

        A run whose every step is non-finite would otherwise go on skipping
        and report success. `fit` calls this at the end of each batch (one
        integer read, after Keras has read the batch's logs); call it
        yourself in your own loop.

        Args:
            consecutive_skips: The count, if already read. Defaults to
                reading it.
            model: The model being trained, whose latest optimizer state
                is read (inside JAX's `fit`). Defaults to None.
        """
        limit = self._max_consecutive_skips
        if limit is None or not self.built:
            return
        if consecutive_skips is None:
            consecutive_skips = self._read([self._consecutive_skips], model)[0]
        consecutive_skips = int(consecutive_skips)
        if consecutive_skips < limit:
            return
        message = (
            f"LossScaleOptimizer {self.name!r}: {consecutive_skips} steps in "
            "a row were skipped for non-finite gradients "
            f"(max_consecutive_skips={limit}); the run is not recovering, "
            "so it stops rather than go on skipping every step."
        )
        if self.track_overflow:
            counts, first_steps = self._read(
                [self._overflow_counts, self._overflow_first_steps], model
            )
            records = overflow.overflow_records(
                self._trainable_variables, counts, first_steps
            )
            layers = worst_layers(records, top=3)
            if layers:
                message += f" Layers whose gradients overflowed most: {layers}."
        else:
            message += (
                " Create the optimizer with track_overflow=True to see which "
                "layers overflow."
            )
        message += (
            " Check the data for inf/NaN, lower the learning rate, or compute "
            "the overflowing layers in float32 (`keras_mp.precision_rules`). "
            "Raise max_consecutive_skips (or set it to None) on the "
            "optimizer to allow longer runs of skipped steps."
        )
        raise FloatingPointError(message)

    def _read(self, variables, model):
        # Inside JAX's `fit` the live values are in the trainer's state.
        if model is not None:
            return training_state.latest_values(model, variables)
        return [ops.convert_to_numpy(v.value) for v in variables]


def worst_layers(records, top=3):
    """`"dense_1 (2 steps), ..."`: the layers of `records` whose variables
    overflowed most, each with its largest count."""
    counts = {}
    for record in records:
        layer = record.layer or record.path
        counts[layer] = max(counts.get(layer, 0), record.count)
    ranked = sorted(counts.items(), key=lambda item: -item[1])[:top]
    return ", ".join(
        f"{layer} ({count} step{'s' if count != 1 else ''})"
        for layer, count in ranked
    )

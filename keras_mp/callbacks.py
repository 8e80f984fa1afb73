"""Callbacks that make loss scaling and FP8 visible in `fit` logs."""

import contextlib
import inspect
import numbers

import keras
from keras import ops

from keras_mp._fp8.report import report as fp8_report
from keras_mp.backend import training_state
from keras_mp.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras_mp.optimizers.overflow import overflow_records
from keras_mp.optimizers.wrapper import OptimizerWrapper

__all__ = ["FP8Report", "LossScaleLogger", "OverflowReport"]


def add_loss_scale_logger(callbacks, optimizer):
    """The `callbacks` of a `fit` call, with a `LossScaleLogger` put first.

    Used by `Model.fit` (see `keras_mp.models`). The list is returned as
    given when `optimizer` has no keras_mp `LossScaleOptimizer`, when it
    holds a `LossScaleLogger` already, or when it is a
    `keras.callbacks.CallbackList` (which `fit` uses as it is).
    """
    if find_loss_scale_optimizer(optimizer) is None or isinstance(
        callbacks, keras.callbacks.CallbackList
    ):
        return callbacks
    # Keras takes a callback, a list or nested lists, and flattens them.
    callbacks = [] if callbacks is None else keras.tree.flatten(callbacks)
    if any(isinstance(c, LossScaleLogger) for c in callbacks):
        return callbacks
    if not any(isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks):
        # Keras adds its own ProgbarLogger only when the list has none.
        callbacks = [*callbacks, _CountingProgbarLogger()]
    return [LossScaleLogger(), *callbacks]


def add_consecutive_skips_check(callbacks, optimizer):
    """The `callbacks` of a `fit` call, with a check at the end of each
    batch that stops `fit` after `max_consecutive_skips` skipped steps in a
    row (`LossScaleOptimizer.check_consecutive_skips`).

    Used by `Model.fit` (see `keras_mp.models`). The list is returned as
    given when `optimizer` has no keras_mp `LossScaleOptimizer` with a
    `max_consecutive_skips`, when its step checks the count itself
    (`checks_skips_in_step`: `fit` turns that on instead, see
    `in_step_skips_check`), or when it is a `keras.callbacks.CallbackList`
    (which `fit` uses as it is).
    """
    found = find_loss_scale_optimizer(optimizer)
    if (
        found is None
        or found.max_consecutive_skips is None
        or found.checks_skips_in_step()
        or isinstance(callbacks, keras.callbacks.CallbackList)
    ):
        return callbacks
    callbacks = [] if callbacks is None else keras.tree.flatten(callbacks)
    return [*callbacks, _ConsecutiveSkipsCheck(found)]


@contextlib.contextmanager
def in_step_skips_check(optimizer):
    """Within a `fit` call, the step of `optimizer` checks
    `max_consecutive_skips` itself where it can (`checks_skips_in_step`:
    PyTorch's host-decided skip, which reads the count only after a
    skipped step), in place of a per-batch callback."""
    found = find_loss_scale_optimizer(optimizer)
    if found is None or not found.checks_skips_in_step():
        yield
        return
    found._checks_skips_in_step = True
    try:
        yield
    finally:
        found._checks_skips_in_step = False
        found._skipped_on_host = False


class _ConsecutiveSkipsCheck(keras.callbacks.Callback):
    """Raises from `fit` once `max_consecutive_skips` steps in a row were
    skipped, read at the end of each batch.

    Runs in the training thread (not `async_safe`), after Keras has read
    the batch's logs, so the step is finished and the one integer read
    waits for nothing.
    """

    def __init__(self, optimizer):
        super().__init__()
        self._optimizer = optimizer

    def on_train_batch_end(self, batch, logs=None):
        self._optimizer.check_consecutive_skips(model=self._model)


# Logs that count steps: the progress bar shows them as integers.
_COUNTS = ("skipped_steps",)


class _Count(float):
    """A count that Keras's Progbar prints as `1`, not `1.0000`.

    The Progbar (keras 3.0 - 3.15) divides each logged value by a count of 1
    and formats the result with `.4f`; both keep the integer here.
    """

    def __truediv__(self, other):
        return _Count(float(self) / other)

    def __format__(self, format_spec):
        return str(int(self))


class _CountingProgbar(keras.utils.Progbar):
    """A Progbar that prints step counts (`skipped_steps`) as integers."""

    def update(self, current, values=None, finalize=None):
        values = [
            (key, _Count(value) if key in _COUNTS else value)
            for key, value in values or []
        ]
        super().update(current, values, finalize=finalize)


class _CountingProgbarLogger(keras.callbacks.ProgbarLogger):
    """Keras's progress bar logger, with step counts printed as integers."""

    def _maybe_init_progbar(self):
        # Keras's own `_maybe_init_progbar` (keras 3.0 - 3.15), with the
        # Progbar above. `stateless_metrics` is Keras 3.15's (3.14 and older
        # refuse it): passed where the Progbar takes it, as Keras does.
        if self.progbar is None:
            self.progbar = _CountingProgbar(
                target=self.target,
                verbose=self.verbose,
                unit_name="step",
                **_STATELESS_METRICS,
            )


_STATELESS_METRICS = (
    {"stateless_metrics": set()}
    if "stateless_metrics"
    in inspect.signature(keras.utils.Progbar.__init__).parameters
    else {}
)


def find_loss_scale_optimizer(optimizer):
    """The keras_mp `LossScaleOptimizer` that is or is wrapped by `optimizer`.

    Returns:
        The `LossScaleOptimizer`, or None if there is none in the chain of
        `inner_optimizer`s.
    """
    while isinstance(optimizer, OptimizerWrapper):
        if isinstance(optimizer, LossScaleOptimizer):
            return optimizer
        optimizer = optimizer.inner_optimizer
    return None


def _batch_period(name, value, allow_batch=False):
    """None for `"epoch"`, else the number of batches between two reports:
    a positive int (or, with `allow_batch`, `"batch"` for 1)."""
    if value == "epoch":
        return None
    if allow_batch and value == "batch":
        return 1
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    choices = "'epoch', 'batch'" if allow_batch else "'epoch'"
    raise ValueError(
        f"`{name}` must be {choices} or a positive int (every that many "
        f"training batches). Received: {name}={value!r}. Pass {name}='epoch' "
        f"or e.g. {name}=100."
    )


class LossScaleLogger(keras.callbacks.Callback):
    """Adds `loss_scale` and `skipped_steps` to the logs of `fit`.

    With a keras_mp `LossScaleOptimizer` (also one wrapped in another
    `OptimizerWrapper`), `Model.fit` adds this callback by itself, first in
    the list, so the two values reach every callback after it: `History`,
    `CSVLogger`, `TensorBoard`, `EarlyStopping(monitor="loss_scale")` and
    the progress bar. Pass `log_loss_scale=False` to `fit` to leave it out,
    or pass your own `LossScaleLogger` (then `fit` adds none) to choose
    `update_freq`. A `LossScaleLogger` you add yourself must come before the
    callbacks that should see the values.

    `loss_scale` is the current scale (a float); `skipped_steps` counts the
    steps skipped for non-finite gradients since the optimizer was created
    (an int, like `optimizer.iterations` never reset between epochs).

    Reading them costs a device-to-host copy of two scalars. With the
    default `update_freq="epoch"` this happens once per epoch, where Keras
    synchronizes anyway to compute the epoch's logs, and the callback is
    `async_safe`: Keras keeps dispatching batch callbacks in a worker
    thread. With a per-batch `update_freq` the values are read at the batch
    end, right after Keras has converted that step's logs to Python floats
    (so the step is already finished and the read adds no wait on the
    device), but batch callbacks then run in the training thread, as
    Keras must for any callback that reads state per batch; on JAX the
    values come from the step's output state, without writing every
    variable back to the model.

    Args:
        update_freq: `"epoch"` to add the values to epoch logs only,
            `"batch"` to add them to every batch's logs too (the progress
            bar then shows them live, `TensorBoard(update_freq=...)` can
            plot them per batch), or an int `N` for every `N` batches.
            Epoch logs always get them. Defaults to `"epoch"`.

    Example:

    >>> keras_mp.set_global_policy(
    ...     keras_mp.Policy("mixed_bfloat16", loss_scale="dynamic")
    ... )
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(keras.optimizers.SGD(0.1), loss="mse")
    >>> history = model.fit(np.ones((8, 2)), np.ones((8, 1)), verbose=0)
    >>> history.history["loss_scale"], history.history["skipped_steps"]
    ([32768.0], [0])
    >>> keras_mp.set_global_policy(None)
    """

    def __init__(self, update_freq="epoch"):
        super().__init__()
        self._batch_period = _batch_period(
            "update_freq", update_freq, allow_batch=True
        )
        self.update_freq = update_freq
        self._optimizer = None

    @property
    def async_safe(self):
        # Keras dispatches batch-end callbacks in a worker thread only when
        # every callback says it is safe there. Reading the optimizer state
        # from that thread would race the next step (on JAX, whose step
        # donates the very buffers being read), so per-batch reading is not.
        return self._batch_period is None

    def on_train_begin(self, logs=None):
        self._optimizer = _required_optimizer(self, self._model)
        # The baseline of the loss scale's `on_min_scale` check.
        self._read()

    def on_train_batch_end(self, batch, logs=None):
        if (
            logs is not None
            and self._batch_period is not None
            and (batch + 1) % self._batch_period == 0
        ):
            logs.update(self._read())

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(self._read())

    def _read(self):
        optimizer = self._optimizer
        if not optimizer.built:
            return {}
        scale = optimizer.loss_scale
        variables = scale.variables + [optimizer.skipped_steps]
        values = training_state.latest_values(self._model, variables)
        # Any LossScale computes its value from its variables; mapping them to
        # the values just read gives it without touching the live ones.
        mapping = list(zip(variables, values))
        with keras.StatelessScope(state_mapping=mapping):
            loss_scale = float(ops.convert_to_numpy(scale()))
        skipped_steps = int(values[-1])
        # The dynamic scale's `on_min_scale` policy, on values read anyway.
        optimizer.check_min_scale(skipped_steps, loss_scale)
        return {"loss_scale": loss_scale, "skipped_steps": skipped_steps}


def _required_optimizer(callback, model):
    optimizer = getattr(model, "optimizer", None)
    found = find_loss_scale_optimizer(optimizer)
    if found is None:
        raise ValueError(
            f"{type(callback).__name__} needs a model whose optimizer is, or "
            "wraps, a keras_mp.LossScaleOptimizer. Received: "
            f"optimizer={optimizer!r}. Compile under a policy with a loss "
            "scale (e.g. keras_mp.set_global_policy('mixed_float16')), or "
            "wrap the optimizer in keras_mp.LossScaleOptimizer."
        )
    return found


class OverflowReport(keras.callbacks.Callback):
    """Prints which variables' gradients overflowed, after epochs that skipped.

    At the end of each epoch in which at least one step was skipped for
    non-finite gradients (and only then), prints the table of
    `LossScaleOptimizer.overflow_report(top)`: the variables whose gradient
    was non-finite most often, with their layer, count and first step. The
    optimizer must be created with `track_overflow=True` (the counters are
    updated inside the step; this callback reads them once per epoch).
    `fit` logs are left as they are.

    Args:
        top: How many variables to list. Defaults to `5`.
        print_fn: Function that prints a line. Defaults to `print`.

    Example:

    >>> optimizer = keras_mp.LossScaleOptimizer(
    ...     keras.optimizers.SGD(0.1), track_overflow=True
    ... )
    >>> report = keras_mp.callbacks.OverflowReport(top=3)
    """

    def __init__(self, top=5, print_fn=None):
        super().__init__()
        if isinstance(top, bool) or not isinstance(top, int) or top < 1:
            raise ValueError(
                f"`top` must be a positive int. Received: top={top!r}"
            )
        self.top = top
        self.print_fn = print_fn or print
        self._optimizer = None
        self._skipped_before = 0

    def on_train_begin(self, logs=None):
        optimizer = _required_optimizer(self, self._model)
        if not optimizer.track_overflow:
            raise ValueError(
                "OverflowReport needs a LossScaleOptimizer created with "
                "track_overflow=True. Received: optimizer "
                f"{optimizer.name!r} with track_overflow=False. Compile with "
                "keras_mp.LossScaleOptimizer(..., track_overflow=True)."
            )
        self._optimizer = optimizer
        self._skipped_before = self._read_skipped()

    def _read_skipped(self):
        if not self._optimizer.built:
            return 0
        (value,) = training_state.latest_values(
            self._model, [self._optimizer.skipped_steps]
        )
        return int(value)

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self._optimizer
        if optimizer is None or not optimizer.built:
            return
        variables = [
            optimizer.skipped_steps,
            optimizer._overflow_counts,
            optimizer._overflow_first_steps,
        ]
        skipped, counts, first_steps = training_state.latest_values(
            self._model, variables
        )
        skipped = int(skipped)
        newly_skipped = skipped - self._skipped_before
        self._skipped_before = skipped
        if newly_skipped <= 0:
            return
        records = overflow_records(
            optimizer._trainable_variables, counts, first_steps, self.top
        )
        self.print_fn(
            f"Epoch {epoch + 1}: {newly_skipped} step(s) skipped for "
            "non-finite gradients. Variables whose gradients overflowed "
            "most (since training began):\n" + str(records)
        )


def _check_fraction(name, value):
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0 <= value <= 1
    ):
        raise ValueError(
            f"`{name}` is a fraction of values, a number in [0, 1]. "
            f"Received: {name}={value!r}. Pass e.g. {name}=0.01 (1%)."
        )
    return float(value)


class FP8Report(keras.callbacks.Callback):
    """Prints `keras_mp.fp8.report(model)` when an FP8 tensor is in trouble.

    At the end of each epoch (or every `every` training batches), reads the
    FP8 statistics of the last step (`keras_mp.fp8.report`; the one host
    read, only then) and prints the table when a layer's input, kernel or
    output gradient has more than `saturated` of its values saturated or
    more than `flushed` of them flushed to zero; otherwise prints nothing.
    The model's FP8 layers must count statistics:
    `keras_mp.fp8.Recipe(stats=True)` (checked when training begins).

    Args:
        saturated: The largest saturated fraction that passes silently.
            Defaults to `0.001`.
        flushed: The largest flushed fraction that passes silently.
            Defaults to `0.01`.
        every: `"epoch"`, or a positive int: every that many training
            batches (counted within each epoch, as Keras numbers them).
            Defaults to `"epoch"`.
        print_fn: Function that prints a line. Defaults to `print`.

    Example:

    >>> callback = keras_mp.callbacks.FP8Report(flushed=0.05)
    >>> callback.flushed
    0.05
    """

    def __init__(
        self, saturated=0.001, flushed=0.01, every="epoch", print_fn=None
    ):
        super().__init__()
        self.saturated = _check_fraction("saturated", saturated)
        self.flushed = _check_fraction("flushed", flushed)
        self._period = _batch_period("every", every)
        if print_fn is not None and not callable(print_fn):
            raise ValueError(
                "`print_fn` is a function that prints a line, or None for "
                f"`print`. Received: print_fn={print_fn!r}."
            )
        self.every = every
        self.print_fn = print_fn or print

    def on_train_begin(self, logs=None):
        # Raises ValueError, with the fix, for a model without statistics.
        fp8_report(self.model)

    def _check(self, when):
        found = fp8_report(self.model)
        if found.flagged(saturated=self.saturated, flushed=self.flushed):
            self.print_fn(
                f"{when}: FP8 values over threshold (saturated > "
                f"{self.saturated:g} or flushed > {self.flushed:g}):\n"
                + str(found)
            )

    def on_train_batch_end(self, batch, logs=None):
        if self._period is not None and (batch + 1) % self._period == 0:
            self._check(f"Batch {batch + 1}")

    def on_epoch_end(self, epoch, logs=None):
        if self._period is None:
            self._check(f"Epoch {epoch + 1}")

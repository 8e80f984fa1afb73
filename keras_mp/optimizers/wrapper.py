"""OptimizerWrapper: the RFC 234 pipeline around an inner optimizer.

The six stages, the entry points (`minimize`, `apply`, `apply_gradients`,
`stateless_apply`), the skip (`apply_if`), the `build_wrapper` hook and
serialization. The concerns it composes live beside it: `building.py`
(`build`, `variables`), `delegation.py` (hyperparameters),
`checkpointing.py` (restore), `state_precision.py` (state dtype, masters),
`overwrite_with_gradient.py` (variables left alone), `inputs.py` (checks of
what it is given). Imports those,
`keras_mp.transforms` and `keras_mp.backend`; never `loss_scale_optimizer.py`
or a module above it (`models.py`, `callbacks.py`, `recommend`).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import keras

from keras_mp import _config
from keras_mp import transforms as transforms_module
from keras_mp.backend import gradients as backend_gradients
from keras_mp.optimizers import checkpointing
from keras_mp.optimizers import delegation
from keras_mp.optimizers import inputs
from keras_mp.optimizers import skip
from keras_mp.optimizers import state_precision
from keras_mp.optimizers.building import BuildMixin
from keras_mp.optimizers.checkpointing import CheckpointMixin
from keras_mp.optimizers.delegation import DelegationMixin
from keras_mp.optimizers.overwrite_with_gradient import split_overwritten
from keras_mp.optimizers.state_precision import StatePrecisionMixin

# (gradient, variable) pairs, as every stage takes and returns them; the
# gradients are backend tensors (or None for a variable without one).
GradsAndVars = list[tuple[Any, Any]]


@keras.saving.register_keras_serializable(package="keras_mp")
class OptimizerWrapper(
    BuildMixin,
    DelegationMixin,
    CheckpointMixin,
    StatePrecisionMixin,
    keras.optimizers.Optimizer,
):
    """An optimizer that wraps another and runs the RFC 234 pipeline.

    Training loops call `minimize`, or `scale_loss` then `apply`/
    `apply_gradients`/`stateless_apply` as `Model.fit` does, and never need
    to know how the optimizer scales, aggregates, clips or transforms.
    Every step runs six stages, each a public method to override:

    1. `transform_loss(loss)`: e.g. scale the loss.
    2. `get_gradients(loss, variables, tape)`: differentiate.
    3. `transform_unaggregated_gradients(grads_and_vars)`: per replica.
    4. `aggregate_gradients(grads_and_vars)`: sum across replicas.
    5. `transform_gradients(grads_and_vars)`: e.g. clip; runs the
       `transform_gradients` plug-ins.
    6. `apply_updates(grads_and_vars)`: the inner optimizer's update.

    The wrapper delegates to `inner_optimizer`: `learning_rate` (get and
    set), `iterations`, `variables` (the inner optimizer's, followed by the
    wrapper's own), and every hyperparameter of the inner optimizer (every
    `get_config()` key but `name`) through attribute get, set and `dir()`.
    Other attributes of the inner optimizer raise AttributeError, so a custom
    method can never silently bypass the wrapper.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap, as in
            `keras_mp.LossScaleOptimizer` and Keras. (`optimizer=` works
            too, the name of earlier releases.)
        transform_gradients: Gradient transforms run in stage 5, in order:
            `keras_mp.transforms` instances, registered names, `(name,
            config)` pairs or plain callables taking and returning
            `grads_and_vars`. Defaults to `None`.
        aggregate_gradients: Callable taking and returning `grads_and_vars`
            that replaces the default cross-replica sum of stage 4.
            Defaults to `None`.
        name: Name of the wrapper. Defaults to the class name.
        state_dtype: Dtype of the inner optimizer's slot variables (Adam's
            moments, SGD's momentum, RMSprop's accumulators: every variable
            it creates from a trainable variable), `"bfloat16"`,
            `"float16"` or `"float32"`; `None` keeps the trainable
            variable's dtype, as Keras does. For float32 (or masters')
            variables each update still computes in float32: the slot is
            read upcast and the result stored rounded. For bfloat16 or
            float16 variables without `master_weights`, Keras's update
            math runs in the variable's dtype (Adam's `beta_2=0.999`
            rounds to 1.0 in bfloat16 and the weights never move): use
            `master_weights=True` there.
            `"bfloat16"` halves float32 Adam's 8 bytes of state per
            parameter. `"float8"` (Keras's Adam and AdamW only) keeps
            each moment as uint8 E4M3 codes of the slot's shape plus a
            float32 power-of-two scale per block of 128 elements (an
            optimizer variable named `..._scale` after the codes), about
            2.06 bytes per parameter; the second moment is stored as its
            square root, and the update computes in float32.
            Defaults to `None`.
        stochastic_rounding: Whether bfloat16 state is stored with
            stochastic rounding (unbiased: increments smaller than the
            rounding step survive on average, where rounding to nearest
            would drop them every step). The random bits come from a
            `keras.random.SeedGenerator` whose state is an optimizer
            variable and whose seed is drawn when the wrapper is created,
            so runs repeat after `keras.utils.set_random_seed`.
            `None` means True for bfloat16 and float8 state, False
            otherwise; only those support it (float8 state rounds only
            the second moment stochastically, the first to nearest).
            Defaults to `None`.
        master_weights: Whether to keep a float32 master copy of every
            bfloat16 or float16 trainable variable ("pure 16-bit" training,
            e.g. under `keras_mp.Policy("bfloat16")`): the inner optimizer
            updates the masters (so its slots follow the masters' dtype)
            and each variable receives its master rounded to nearest, so
            updates smaller than the variable's precision still add up.
            The masters are optimizer variables, checkpointed after the
            inner optimizer's. A variable assigned from outside (e.g.
            `load_weights`) is picked up at the next step. Warns at build
            when no trainable variable is 16-bit. Defaults to `False`.

    Example:

    >>> opt = keras_mp.OptimizerWrapper(
    ...     keras.optimizers.SGD(0.1, momentum=0.9),
    ...     transform_gradients=["clip_by_global_norm"],
    ... )
    >>> float(opt.momentum)
    0.9
    >>> opt.momentum = 0.5
    >>> float(opt.inner_optimizer.momentum)
    0.5

    Adam's moments in bfloat16 (half the memory), updated in float32:

    >>> opt = keras_mp.OptimizerWrapper(
    ...     keras.optimizers.Adam(), state_dtype="bfloat16"
    ... )
    >>> opt.build([keras.Variable([1.0, 2.0])])
    >>> [str(v.dtype) for v in opt.inner_optimizer.variables[2:]]
    ['bfloat16', 'bfloat16']
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer | None = None,
        transform_gradients: Any = None,
        aggregate_gradients: Callable[[GradsAndVars], Iterable[tuple[Any, Any]]]
        | None = None,
        name: str | None = None,
        state_dtype: str | None = None,
        stochastic_rounding: bool | None = None,
        master_weights: bool = False,
        **kwargs: Any,
    ) -> None:
        state_dtype, stochastic_rounding = (
            state_precision.check_state_arguments(
                state_dtype, stochastic_rounding, master_weights
            )
        )
        optimizer = inputs.checked_inner_optimizer(
            type(self).__name__, inner_optimizer, kwargs
        )
        state_precision.check_state_precision_target(
            optimizer, state_dtype, master_weights, name
        )
        if aggregate_gradients is not None and not callable(
            aggregate_gradients
        ):
            raise TypeError(
                "`aggregate_gradients` must be a callable taking and returning "
                f"grads_and_vars. Received: {aggregate_gradients!r}"
            )
        # The base class is initialized directly: with LossScaleOptimizer,
        # the next class in the MRO is Keras's LossScaleOptimizer, whose
        # constructor must not run.
        keras.optimizers.Optimizer.__init__(
            self, learning_rate=0.0, name=name, **kwargs
        )
        # The base constructor made a learning rate and an iteration counter;
        # a wrapper uses the inner optimizer's, and stores the hyperparameters
        # there too. The two stay in `_variables`, left out of `variables`:
        # on TensorFlow that list is tracked, and `model.export` refuses a
        # tracked list any element of which was removed.
        self.__dict__["_unused_base_variables"] = len(self._variables)
        for key in delegation.BASE_HYPERPARAMETERS:
            self.__dict__.pop(key, None)
        self._inner_optimizer = optimizer
        optimizer._keras_mp_wrapped_by = self.name
        self._delegated = delegation.hyperparameter_names(optimizer)
        self._transforms = transforms_module.Chain(transform_gradients or [])
        self._aggregate_gradients_fn = aggregate_gradients
        self._keras_mp_state = checkpointing.WrapperState(self)
        self._unscaled_gradients = []
        self._init_state_precision(
            state_dtype, stochastic_rounding, master_weights
        )

    @property
    def transforms(self) -> transforms_module.Chain:
        """The `keras_mp.transforms.Chain` run by `transform_gradients`."""
        return self._transforms

    def _wrapper_variables(self):
        inner = self._inner_optimizer
        below = inner._wrapper_variables() if _is_wrapper(inner) else []
        return below + self._own_variables()

    def _base_optimizer(self):
        inner = self._inner_optimizer
        return inner._base_optimizer() if _is_wrapper(inner) else inner

    def finalize_variable_values(self, var_list: list[keras.Variable]) -> None:
        self._inner_optimizer.finalize_variable_values(var_list)

    # ---------------------------------------------------------------- build
    def build_wrapper(self, var_list: list[keras.Variable]) -> None:
        """Creates the wrapper's own variables with `self.add_variable`.

        Called once by `build`, after the inner optimizer is built. Override
        in subclasses that keep state; the default creates nothing.
        """

    # ------------------------------------------------------------- pipeline
    def transform_loss(self, loss: Any) -> Any:
        """Stage 1: transforms the loss before differentiation.

        The default defers to the inner optimizer (`scale_loss`).
        """
        inner = self._inner_optimizer
        if _is_wrapper(inner):
            return inner.transform_loss(loss)
        return inner.scale_loss(loss)

    def get_gradients(
        self, loss: Any, variables: list[keras.Variable], tape: Any = None
    ) -> GradsAndVars:
        """Stage 2: gradients of the (transformed) loss.

        Args:
            loss: A scalar tensor recorded by `tape` (TensorFlow), or a
                zero-argument callable (any backend).
            variables: The variables to differentiate against.
            tape: A `tf.GradientTape` (TensorFlow only).

        Returns:
            A list of `(gradient, variable)` pairs.
        """
        variables = list(variables)
        grads = backend_gradients.compute_gradients(loss, variables, tape)
        return list(zip(grads, variables))

    def transform_unaggregated_gradients(
        self, grads_and_vars: GradsAndVars
    ) -> GradsAndVars:
        """Stage 3: transforms each replica's gradients before aggregation.

        The default defers to an inner wrapper, and is the identity otherwise.
        """
        inner = self._inner_optimizer
        if _is_wrapper(inner):
            return inner.transform_unaggregated_gradients(grads_and_vars)
        return grads_and_vars

    def aggregate_gradients(self, grads_and_vars: GradsAndVars) -> GradsAndVars:
        """Stage 4: sums gradients across replicas (identity on one device).

        Uses the `aggregate_gradients` constructor argument if given, else
        defers to an inner wrapper (whose own stages 3-4 are then skipped),
        else sums across tf.distribute replicas.
        """
        if self._aggregate_gradients_fn is not None:
            return list(self._aggregate_gradients_fn(grads_and_vars))
        inner = self._inner_optimizer
        if _is_wrapper(inner):
            return inner.aggregate_gradients(grads_and_vars)
        grads = backend_gradients.all_reduce_sum([g for g, _ in grads_and_vars])
        return list(zip(grads, [v for _, v in grads_and_vars]))

    def transform_gradients(self, grads_and_vars: GradsAndVars) -> GradsAndVars:
        """Stage 5: transforms aggregated gradients with the plug-in chain."""
        return self._transforms(grads_and_vars)

    def apply_updates(self, grads_and_vars: GradsAndVars) -> None:
        """Stage 6: the inner optimizer updates the variables.

        `grads_and_vars` ends with the pairs of variables that overwrite
        themselves with their gradient (`overwrite_with_gradient`, Keras's
        float8 scales and amax histories), untransformed; an override must
        pass them on to the inner optimizer as they are.
        """
        model_variables = None
        if self._master_weights:
            model_variables = [v for _, v in grads_and_vars]
            grads_and_vars = self._to_master_weights(grads_and_vars)
        inner = self._inner_optimizer
        if _is_wrapper(inner):
            inner.apply_gradients(
                grads_and_vars, skip_gradients_aggregation=True
            )
        else:
            grads = [g for g, _ in grads_and_vars]
            variables = [v for _, v in grads_and_vars]
            backend_gradients.apply_aggregated(inner, grads, variables)
        if model_variables is not None:
            self._write_back_master_weights(model_variables)

    # --------------------------------------------------------- entry points
    def compute_gradients(
        self, loss: Any, var_list: Iterable[keras.Variable], tape: Any = None
    ) -> GradsAndVars:
        """Stages 1-2: transformed loss, then its gradients.

        Returns:
            A list of `(gradient, variable)` pairs, ready for
            `apply_gradients`.
        """
        loss = transformed_loss(self.transform_loss, loss, tape)
        return self.get_gradients(loss, list(var_list), tape)

    def minimize(
        self, loss: Any, var_list: Iterable[keras.Variable], tape: Any = None
    ) -> Any:
        """Runs the whole pipeline: the loss's gradients update `var_list`.

        Args:
            loss: A scalar tensor recorded by `tape` (TensorFlow), or a
                zero-argument callable returning the loss (any backend).
            var_list: The variables to train.
            tape: The `tf.GradientTape` that recorded `loss` (TensorFlow).

        Returns:
            The `iterations` variable.
        """
        grads_and_vars = self.compute_gradients(loss, var_list, tape=tape)
        return self.apply_gradients(grads_and_vars)

    def scale_loss(self, loss: Any) -> Any:
        """Keras 3's name for stage 1, called by `Model.fit`."""
        return self.transform_loss(loss)

    def apply(
        self,
        grads: Sequence[Any],
        trainable_variables: Sequence[keras.Variable] | None = None,
    ) -> None:
        """Stages 3-6 for gradients of `trainable_variables` (Keras 3 API)."""
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `trainable_variables`, the "
                    "optimizer must already be built. Call "
                    "`optimizer.build(trainable_variables)` first."
                )
            trainable_variables = self._trainable_variables
        self.apply_gradients(zip(grads, trainable_variables))

    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[Any, Any]],
        skip_gradients_aggregation: bool = False,
    ) -> Any:
        """Stages 3-6.

        Args:
            grads_and_vars: Iterable of `(gradient, variable)` pairs.
            skip_gradients_aggregation: If True, stages 3-4 are skipped, for
                gradients that are already aggregated. Defaults to `False`.

        Returns:
            The `iterations` variable.
        """
        grads_and_vars = [(g, v) for g, v in grads_and_vars]
        if not grads_and_vars:
            return self.iterations
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build([v for _, v in grads_and_vars])
        inputs.check_gradient_dtypes(grads_and_vars)
        grads_and_vars, overwritten = split_overwritten(grads_and_vars)
        if not skip_gradients_aggregation:
            grads_and_vars = self.transform_unaggregated_gradients(
                grads_and_vars
            )
            grads_and_vars = self.aggregate_gradients(grads_and_vars)
            # A new amax history or scale per replica: the largest covers
            # every replica's batch (their sum would overstate it).
            overwritten = list(
                zip(
                    backend_gradients.all_reduce_max(
                        [g for g, _ in overwritten]
                    ),
                    [v for _, v in overwritten],
                )
            )
        self.run_step(grads_and_vars + overwritten)
        return self.iterations

    def run_step(self, grads_and_vars: GradsAndVars) -> Any:
        """Stages 5-6 on aggregated gradients.

        Subclasses that may skip a step (as `LossScaleOptimizer` does on
        overflow) override this and call `apply_if(condition, ...)`.
        """
        self._transform_and_apply(grads_and_vars)

    def _transform_and_apply(self, grads_and_vars):
        grads_and_vars, overwritten = split_overwritten(grads_and_vars)
        # The overwriting pairs skip stage 5 and reach the innermost Keras
        # optimizer as they are, which assigns them (keeping the max over
        # an accumulation window); inside `apply_if`, so a skipped step
        # leaves them too.
        self.apply_updates(
            self.transform_gradients(grads_and_vars) + overwritten
        )

    def apply_if(self, condition: Any, grads_and_vars: GradsAndVars) -> None:
        """Runs stages 5-6 only where the scalar bool `condition` holds.

        On a skipped step every model and optimizer variable keeps its exact
        value. A tensor `condition` never becomes a Python bool (no host
        sync): inside TensorFlow graphs the update runs in a `tf.cond`
        branch; on JAX in a stateless scope inside `ops.cond` (`lax.cond`);
        on PyTorch in place, each variable then selected between its new
        and its saved value on the device (in a PyTorch stateless scope on
        copies, each variable assigned `where(condition, new, old)`). A
        Python bool `condition`, decided on the host (PyTorch's default
        skip in `LossScaleOptimizer`), runs the update or nothing. This
        also works in `stateless_apply`.
        """
        skip.update_unless_skipped(
            self, condition, self._transform_and_apply, grads_and_vars
        )

    def stateless_apply(
        self,
        optimizer_variables: Sequence[Any],
        grads: Sequence[Any],
        trainable_variables: Sequence[Any],
    ) -> tuple[list[Any], list[Any]]:
        if not self.built and not list(trainable_variables):
            # Nothing trainable: `build([])` leaves a wrapper unbuilt (see
            # `build`), and a step has nothing to update, as for Keras's
            # own optimizers (`apply` of no gradients returns).
            return list(trainable_variables), list(optimizer_variables)
        return keras.optimizers.Optimizer.stateless_apply(
            self, optimizer_variables, grads, trainable_variables
        )

    # -------------------------------------------------------- serialization
    def get_config(self) -> dict[str, Any]:
        """Every constructor argument, as `from_config` takes it."""
        config = {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(
                self._inner_optimizer
            ),
            "transform_gradients": self._transforms.get_config()["transforms"]
            or None,
            "aggregate_gradients": None,
            "state_dtype": self._state_dtype,
            "stochastic_rounding": self._stochastic_rounding,
            "master_weights": self._master_weights,
        }
        if self._aggregate_gradients_fn is not None:
            config["aggregate_gradients"] = keras.saving.serialize_keras_object(
                self._aggregate_gradients_fn
            )
        return config

    @classmethod
    def from_config(
        cls,
        config: dict[str, Any],
        custom_objects: dict[str, Any] | None = None,
    ) -> OptimizerWrapper:
        _config.check_config(cls, config, required=("optimizer",))
        config = dict(config)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        if config.get("aggregate_gradients") is not None:
            config["aggregate_gradients"] = (
                keras.saving.deserialize_keras_object(
                    config["aggregate_gradients"], custom_objects=custom_objects
                )
            )
        return cls(optimizer, **config)

    def get_state(self) -> list[Any]:
        """The plug-in state of this wrapper: `{name: numpy array}`."""
        return self._transforms.get_state()

    def set_state(self, state: list[Any]) -> None:
        """Restores `get_state()`'s output; all or nothing on a mismatch."""
        self._transforms.set_state(state)


def transformed_loss(transform, loss, tape=None):
    """`transform(loss)`, for a loss given as a tensor or as a callable.

    A callable loss gives a callable (gradients are taken by calling it);
    a tensor recorded by `tape` is transformed inside the tape, re-entered
    (tf.keras did the same), so that the gradient flows through the
    transformation.
    """
    if callable(loss):
        return lambda: transform(loss())
    if tape is not None:
        with tape:
            return transform(loss)
    return transform(loss)


def _is_wrapper(optimizer):
    return isinstance(optimizer, OptimizerWrapper)

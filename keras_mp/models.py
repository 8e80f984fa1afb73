"""Compile-time loss scaling: the one place that touches Keras's Trainer.

Imports from keras_mp only `_keras_internals`, `backend.gradients`,
`callbacks`, `optimizers.checkpointing`, `optimizers.loss_scale_optimizer`,
`optimizers.wrapper`, `policy`; nothing above its floor (see ARCHITECTURE.md).

With a keras_mp policy that has a loss scale, `Model.compile` wraps the
optimizer in a `keras_mp.LossScaleOptimizer` holding a copy of that scale, on
Sequential, functional and subclassed models alike. With such an optimizer,
`Model.fit` puts a `keras_mp.callbacks.LossScaleLogger` first among the
callbacks, so `loss_scale` and `skipped_steps` reach the logs;
`fit(..., log_loss_scale=False)` leaves it out.
"""

import functools
import inspect
import warnings
import weakref

import keras

from keras_mp import _keras_internals
from keras_mp import callbacks as callbacks_module
from keras_mp import policy as policy_module
from keras_mp.backend import gradients as backend_gradients
from keras_mp.optimizers import checkpointing
from keras_mp.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras_mp.optimizers.loss_scale_optimizer import (
    _contains_loss_scale_optimizer,
)
from keras_mp.optimizers.wrapper import transformed_loss
from keras_mp.policy import Policy


def wrap_for_policy(optimizer, policy):
    """The optimizer `compile` uses under `policy`.

    Args:
        optimizer: An optimizer, or anything `keras.optimizers.get` takes.
        policy: The model's dtype policy.

    Returns:
        `optimizer`, wrapped in a `LossScaleOptimizer` with its own copy of
        the policy's loss scale when the policy is a keras_mp `Policy` with
        a loss scale and the optimizer does not scale the loss already.
    """
    policy = _default_of(policy)
    if not isinstance(policy, Policy) or policy.loss_scale is None:
        return optimizer
    optimizer = keras.optimizers.get(optimizer)
    if optimizer is None or _contains_loss_scale_optimizer(optimizer):
        return optimizer
    template = policy.loss_scale
    loss_scale = type(template).from_config(template.get_config())
    return LossScaleOptimizer(optimizer, loss_scale=loss_scale)


def _default_of(policy):
    # A DTypePolicyMap's entries are per layer; the model as a whole (its
    # loss scale) follows the map's default policy.
    return getattr(policy, "default_policy", policy)


def _uses(layer, policy):
    return (
        keras.backend.standardize_dtype(layer.compute_dtype)
        == policy.compute_dtype
        and keras.backend.standardize_dtype(layer.variable_dtype)
        == policy.variable_dtype
    )


_warned_late_policy = weakref.WeakSet()


def _warn_if_built_under_another_policy(model):
    """Warns once per model built before a global policy with a loss scale."""
    policy = _default_of(policy_module.global_policy())
    if not isinstance(policy, Policy) or policy.loss_scale is None:
        return
    if isinstance(_default_of(model.dtype_policy), Policy):
        return
    layers = _keras_internals.all_layers(model)
    if any(_uses(layer, policy) for layer in layers if layer.weights):
        return
    if model in _warned_late_policy:
        return
    _warned_late_policy.add(model)
    warnings.warn(
        f"The global policy is {policy.name!r}, but the model "
        f"{model.name!r} was built under {model.dtype_policy.name!r}: its "
        "layers compute in "
        f"{keras.backend.standardize_dtype(model.compute_dtype)} and "
        "`compile` leaves the optimizer without loss scaling. Call "
        "`keras_mp.set_global_policy(...)` before building the model.",
        UserWarning,
        stacklevel=3,
    )


def _wraps_loss_scale_optimizer(optimizer):
    return (
        isinstance(optimizer, keras.optimizers.Optimizer)
        and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        and _contains_loss_scale_optimizer(optimizer)
    )


def _install_compile_hook():
    trainer = _keras_internals.Trainer
    original = trainer.compile
    if getattr(original, "_keras_mp_hook", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        policy = _default_of(self.dtype_policy)
        _warn_if_built_under_another_policy(self)
        if arguments["auto_scale_loss"]:
            if isinstance(policy, Policy) and policy.loss_scale is None:
                # An explicit `loss_scale=None` means no scaling, also where
                # Keras would wrap "mixed_float16" in its own optimizer.
                arguments["auto_scale_loss"] = False
            else:
                optimizer = wrap_for_policy(arguments["optimizer"], policy)
                arguments["optimizer"] = optimizer
                if _wraps_loss_scale_optimizer(optimizer):
                    # Keras checks only the outermost optimizer; one that
                    # wraps a LossScaleOptimizer must not be wrapped again.
                    arguments["auto_scale_loss"] = False
        result = original(*bound.args, **bound.kwargs)
        if getattr(self, "optimizer", None) is not None:
            # Whatever the policy: a checkpoint loaded before the first step
            # must not be dropped (keras_mp's wrappers keep theirs too).
            checkpointing.restore_at_build(self.optimizer)
        compile_config = getattr(self, "_compile_config", None)
        if not arguments["auto_scale_loss"] and compile_config is not None:
            # Keras does not save this flag; without it `load_model` would
            # wrap the optimizer the user chose not to wrap.
            compile_config.config["auto_scale_loss"] = False
        return result

    compile._keras_mp_hook = True
    trainer.compile = compile


_install_compile_hook()


# `fit`: the loss scale in the logs (keras_mp.callbacks.LossScaleLogger).


def _install_fit_hook():
    # The backend trainers each define `fit`; `keras.Model` inherits it from
    # the active one, and Sequential and functional models from `Model`.
    original = keras.Model.fit
    if getattr(original, "_keras_mp_hook", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(self, *args, log_loss_scale=True, **kwargs):
        # `log_loss_scale=False` leaves out the LossScaleLogger that is
        # otherwise put first among the callbacks when the optimizer is a
        # keras_mp LossScaleOptimizer.
        if log_loss_scale:
            bound = signature.bind(self, *args, **kwargs)
            add_logger = callbacks_module.add_loss_scale_logger
            bound.arguments["callbacks"] = add_logger(
                bound.arguments.get("callbacks"), self.optimizer
            )
            args, kwargs = bound.args[1:], bound.kwargs
        return original(self, *args, **kwargs)

    fit._keras_mp_hook = True
    keras.Model.fit = fit


_install_fit_hook()


# Custom train steps: one `train_step` for every policy.


def _get_scaled_loss(self, loss):
    """RFC 293's name for `scale_loss`, on every Keras optimizer.

    A plain optimizer (no loss scale policy) returns `loss` as is, or times
    its `loss_scale_factor`; `apply` divides that back out of the gradients.
    Present once keras_mp is imported, so that a custom `train_step` written
    for a `keras_mp.LossScaleOptimizer` runs unchanged under every policy.
    """
    return self.scale_loss(loss)


def _get_unscaled_gradients(self, grads):
    """Returns `grads` as a list: a plain optimizer's `apply` unscales."""
    return list(grads)


def _compute_gradients(self, loss, var_list, tape=None):
    """The gradients of `scale_loss(loss)` as `(gradient, variable)` pairs.

    Args:
        loss: A scalar tensor recorded by `tape` (TensorFlow), or a
            zero-argument callable returning the loss (any backend).
        var_list: The variables to differentiate with respect to.
        tape: The `tf.GradientTape` that recorded `loss` (TensorFlow).
    """
    var_list = list(var_list)
    loss = transformed_loss(self.scale_loss, loss, tape)
    grads = backend_gradients.compute_gradients(loss, var_list, tape)
    return list(zip(grads, var_list))


def _minimize(self, loss, var_list, tape=None):
    """Updates `var_list` with the gradients of `loss` (RFC 234's `minimize`).

    Args:
        loss: A scalar tensor recorded by `tape` (TensorFlow), or a
            zero-argument callable returning the loss (any backend).
        var_list: The variables to train.
        tape: The `tf.GradientTape` that recorded `loss` (TensorFlow).

    Returns:
        The `iterations` variable.
    """
    self.apply_gradients(self.compute_gradients(loss, var_list, tape=tape))
    return self.iterations


_PORTABLE_STEP_METHODS = {
    "get_scaled_loss": _get_scaled_loss,
    "get_unscaled_gradients": _get_unscaled_gradients,
    "compute_gradients": _compute_gradients,
    "minimize": _minimize,
}


def _install_portable_step_methods():
    # Under mixed_bfloat16 or float32 `compile` keeps the user's optimizer,
    # so the RFC 293 / RFC 234 methods a custom train_step calls must exist
    # on every Keras optimizer, as the identity where nothing is scaled.
    # keras_mp's wrappers define their own and are left alone.
    base = keras.optimizers.Optimizer
    for name, method in _PORTABLE_STEP_METHODS.items():
        if not hasattr(base, name):
            setattr(base, name, method)


_install_portable_step_methods()

"""Compile-time loss scaling: the one place that touches Keras's Trainer.

With a keras_mp policy that has a loss scale, `Model.compile` wraps the
optimizer in a `keras_mp.LossScaleOptimizer` holding a copy of that scale, on
Sequential, functional and subclassed models alike. With such an optimizer,
`Model.fit` puts a `keras_mp.callbacks.LossScaleLogger` first among the
callbacks, so `loss_scale` and `skipped_steps` reach the logs;
`fit(..., log_loss_scale=False)` leaves it out.
"""

import functools
import inspect

import keras

from keras_mp import _keras_internals
from keras_mp import callbacks as callbacks_module
from keras_mp.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras_mp.optimizers.loss_scale_optimizer import (
    _contains_loss_scale_optimizer,
)
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
    if not isinstance(policy, Policy) or policy.loss_scale is None:
        return optimizer
    optimizer = keras.optimizers.get(optimizer)
    if optimizer is None or _contains_loss_scale_optimizer(optimizer):
        return optimizer
    template = policy.loss_scale
    loss_scale = type(template).from_config(template.get_config())
    return LossScaleOptimizer(optimizer, loss_scale=loss_scale)


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
        policy = self.dtype_policy
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

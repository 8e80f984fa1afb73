"""Compile-time loss scaling: the one place that touches Keras's Trainer.

With a keras_mp policy that has a loss scale, `Model.compile` wraps the
optimizer in a `keras_mp.LossScaleOptimizer` holding a copy of that scale, on
Sequential, functional and subclassed models alike.
"""

import functools
import inspect

import keras

from keras_mp import _keras_internals
from keras_mp.optimizers.loss_scale_optimizer import LossScaleOptimizer
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
    if optimizer is None or isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    ):
        return optimizer
    template = policy.loss_scale
    loss_scale = type(template).from_config(template.get_config())
    return LossScaleOptimizer(optimizer, loss_scale=loss_scale)


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
                arguments["optimizer"] = wrap_for_policy(
                    arguments["optimizer"], policy
                )
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

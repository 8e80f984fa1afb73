"""Compile-time loss scaling: the one place that touches Keras's Trainer.

With a keras_mp policy that has a loss scale, `Model.compile` wraps the
optimizer in a `keras_mp.LossScaleOptimizer` holding a copy of that scale, on
Sequential, functional and subclassed models alike; without one, where
non-finite steps are to be skipped (`set_global_policy(...,
skip_nonfinite=...)`, on by default for models that use an FP8 recipe), in
a `LossScaleOptimizer` with a scale of 1 that skips. With such an optimizer,
`Model.fit` puts a `keras_mp.callbacks.LossScaleLogger` first among the
callbacks, so `loss_scale` and `skipped_steps` reach the logs;
`fit(..., log_loss_scale=False)` leaves it out; with a
`max_consecutive_skips`, `fit` also checks it at the end of each batch.
`keras.callbacks.ModelCheckpoint` never writes a model whose weights or
optimizer state hold an inf or NaN: it warns and skips that save.
`keras.saving.load_model` calls a custom `compile()` (keras-hub's tasks)
with the saved optimizer and arguments, which Keras does not.
"""

import functools
import inspect
import warnings
import weakref

import keras
from keras import ops

from keras_mp import _keras_internals
from keras_mp import callbacks as callbacks_module
from keras_mp import policy as policy_module
from keras_mp.backend import gradients as backend_gradients
from keras_mp.optimizers import checkpointing
from keras_mp.optimizers.loss_scale_inputs import contains_loss_scale_optimizer
from keras_mp.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras_mp.optimizers.wrapper import transformed_loss
from keras_mp.policy import Policy
from keras_mp.precision import global_policy as global_policy_module


def wrap_for_policy(optimizer, policy, skip_nonfinite=False):
    """The optimizer `compile` uses under `policy`.

    Args:
        optimizer: An optimizer, or anything `keras.optimizers.get` takes.
        policy: The model's dtype policy.
        skip_nonfinite: Whether a non-finite step must be skipped even
            without a loss scale. Defaults to `False`.

    Returns:
        `optimizer` as it is when it is or wraps a `LossScaleOptimizer`;
        else wrapped in a `LossScaleOptimizer` with its own copy of the
        policy's loss scale when the policy is a keras_mp `Policy` with a
        loss scale (skipping non-finite steps with a fixed scale too when
        `skip_nonfinite`), or with a scale of 1 that skips
        (`skip_nonfinite=True`, `track_overflow=True`) when only
        `skip_nonfinite` asks for it.
    """
    policy = _default_of(policy)
    template = policy.loss_scale if isinstance(policy, Policy) else None
    if template is None and (
        not skip_nonfinite
        # Keras wraps this one in its own LossScaleOptimizer, which skips.
        or (not isinstance(policy, Policy) and policy.name == "mixed_float16")
    ):
        return optimizer
    optimizer = keras.optimizers.get(optimizer)
    if optimizer is None or contains_loss_scale_optimizer(optimizer):
        return optimizer
    if template is None:
        return LossScaleOptimizer(
            optimizer, loss_scale=1, skip_nonfinite=True, track_overflow=True
        )
    loss_scale = type(template).from_config(template.get_config())
    fixed_and_skipping = skip_nonfinite and not loss_scale.is_dynamic
    return LossScaleOptimizer(
        optimizer,
        loss_scale=loss_scale,
        skip_nonfinite=skip_nonfinite,
        track_overflow=fixed_and_skipping,
    )


def skips_nonfinite(model):
    """Whether `compile` makes `model`'s non-finite steps skipped ones.

    `set_global_policy(..., skip_nonfinite=True/False)` decides for every
    model; with None (the default) it is on where an FP8 recipe is in use:
    the global one, or any layer's policy (a model loaded or adopted with
    FP8 layers, recipes given by `precision_rules`).
    """
    setting = global_policy_module.global_skip_nonfinite()
    if setting is not None:
        return setting
    if global_policy_module.global_fp8() is not None:
        return True
    return any(
        getattr(policy_module.layer_policy(layer), "fp8", None) is not None
        for layer in _keras_internals.all_layers(model)
    )


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
    policy = _default_of(global_policy_module.global_policy())
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
        and contains_loss_scale_optimizer(optimizer)
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
            optimizer = wrap_for_policy(
                arguments["optimizer"], policy, skips_nonfinite(self)
            )
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


# `load_model`: a model with a custom `compile()` (keras-hub's tasks) gets
# back the optimizer it was saved with.


def compile_custom_on_load(model, config):
    """Compiles `model`, whose `compile()` is custom, from its saved config.

    Keras's `load_model` does not call a custom `compile()`: a keras-hub
    task keeps the default optimizer its constructor compiled, and the
    saved optimizer's variables load into it only where their layout
    happens to match (a plain Adam's does; a `state_dtype`, master weights,
    a transform's state or accumulation do not, and are dropped without a
    word). Here the model's own `compile` is called with the saved
    optimizer, loss, metrics and other arguments (keras-hub's `compile`
    takes them all), and the optimizer is built, as Keras does for a model
    whose `compile` is not custom, so that the variables `load_model` loads
    next land in it. Where that fails (a `compile` that refuses the
    arguments or raises), it warns with what was lost and the fix, and
    the model is left as Keras left it.

    Args:
        model: The model `load_model` is rebuilding.
        config: Its serialized compile config.

    Returns:
        Whether the config was handled (False where it holds no
        optimizer: Keras's own warning then stands).
    """
    if not isinstance(config, dict) or config.get("optimizer") is None:
        return False
    try:
        arguments = keras.saving.deserialize_keras_object(config)
    except Exception as error:
        _warn_optimizer_lost(model, config["optimizer"], error)
        return True
    optimizer = arguments.get("optimizer")
    try:
        inspect.signature(model.compile).bind(**arguments)
    except TypeError as error:
        _warn_optimizer_lost(model, optimizer, error)
        return True
    # A `compile` that raises halfway may have set some attributes: they
    # are put back, so the model is as Keras left it, not half compiled.
    before = dict(model.__dict__)
    try:
        model.compile(**arguments)
        if model.built and getattr(model, "optimizer", None) is not None:
            # Built now, as Keras's `compile_from_config` builds it: the
            # saved variables then load into it by order.
            model.optimizer.build(model.trainable_variables)
    except Exception as error:
        for name in set(model.__dict__) - set(before):
            del model.__dict__[name]
        model.__dict__.update(before)
        _warn_optimizer_lost(model, optimizer, error)
    return True


def _describe_optimizer(optimizer):
    """`LossScaleOptimizer(OptimizerWrapper(Adam))`, or a config's class."""
    if isinstance(optimizer, dict):
        return str(optimizer.get("class_name", optimizer))
    names = []
    while optimizer is not None:
        names.append(type(optimizer).__name__)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return "(".join(names) + ")" * (len(names) - 1)


def _warn_optimizer_lost(model, optimizer, error):
    warnings.warn(
        f"The model {model.name!r} was loaded without the optimizer it was "
        f"saved with: its `compile()` is custom, so Keras does not call it "
        f"on load, and keras_mp's call with the saved arguments failed "
        f"({type(error).__name__}: {error}). Lost: the optimizer "
        f"{_describe_optimizer(optimizer)} and its saved variables "
        "(iterations, slots, and any wrapper's loss scale, low-precision "
        "state, master weights, transform state or accumulators), which "
        "load into the optimizer the model's constructor compiled only "
        "where their layout matches. To resume training, call "
        "`model.compile(optimizer=...)` yourself with the same optimizer "
        "and arguments, then `model.load_weights(path)` with the saved "
        "file, which loads the optimizer's variables too.",
        UserWarning,
        stacklevel=2,
    )


_keras_internals.install_custom_compile_restore(compile_custom_on_load)


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
        bound = signature.bind(self, *args, **kwargs)
        callbacks = bound.arguments.get("callbacks")
        if log_loss_scale:
            callbacks = callbacks_module.add_loss_scale_logger(
                callbacks, self.optimizer
            )
        # Not a logger: a run that keeps failing stops whatever is logged.
        callbacks = callbacks_module.add_consecutive_skips_check(
            callbacks, self.optimizer
        )
        bound.arguments["callbacks"] = callbacks
        with callbacks_module.in_step_skips_check(self.optimizer):
            return original(*bound.args, **bound.kwargs)

    fit._keras_mp_hook = True
    keras.Model.fit = fit


_install_fit_hook()


# `ModelCheckpoint`: never a file of non-finite weights or optimizer state.


def nonfinite_variables(model):
    """The paths of `model`'s float weights and optimizer variables that
    hold an inf or NaN (one host read of a flag per variable)."""
    variables = list(model.weights)
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        variables += optimizer.variables
    seen, checked = set(), []
    for variable in variables:
        dtype = keras.backend.standardize_dtype(variable.dtype)
        if id(variable) in seen or not keras.backend.is_float_dtype(dtype):
            continue
        seen.add(id(variable))
        checked.append(variable)
    if not checked:
        return []
    flags = ops.convert_to_numpy(
        ops.stack(
            [
                # float8 values upcast exactly; isfinite may not take them.
                ops.all(ops.isfinite(ops.cast(v, "float32")))
                if "float8" in v.dtype
                else ops.all(ops.isfinite(v))
                for v in checked
            ]
        )
    )
    return [v.path for v, finite in zip(checked, flags) if not finite]


def _checkpoint_may_save(callback):
    # `callback.model`, not `_model`: on JAX it writes the state that `fit`
    # carries back into the variables first, as the save itself does.
    nonfinite = nonfinite_variables(callback.model)
    if not nonfinite:
        return True
    shown = ", ".join(nonfinite[:3])
    more = f" and {len(nonfinite) - 3} more" if len(nonfinite) > 3 else ""
    warnings.warn(
        f"ModelCheckpoint skipped this save to {callback.filepath!r}: the "
        "model's weights or optimizer state hold an inf or NaN (in "
        f"{shown}{more}), and a checkpoint of them would poison every run "
        "resumed from it. The last checkpoint written is kept. Skip "
        "non-finite steps with `keras_mp.set_global_policy(..., "
        "skip_nonfinite=True)` (on by default under FP8 recipes), or find "
        "the layer with `keras_mp.LossScaleOptimizer(..., "
        "track_overflow=True)`.",
        UserWarning,
        stacklevel=2,
    )
    return False


_keras_internals.install_checkpoint_save_guard(_checkpoint_may_save)


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

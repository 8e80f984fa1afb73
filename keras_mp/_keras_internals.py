"""The one module of keras_mp that imports `keras.src`.

Keras 3 keeps a few pieces that mixed precision needs outside its public API.
Each symbol below names the Keras versions it was checked against; the test
`tests/keras_internals_test.py` imports every one of them, so a Keras release
that moves one fails loudly in CI instead of in a user's training run.
"""

import contextlib
import functools

import numpy as np
from keras import ops

# Checked against keras 3.10 - 3.15.
from keras.src import dtype_policies as dtype_policies_module
from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.common.variables import AutocastScope
from keras.src.backend.common.variables import get_autocast_scope
from keras.src.dtype_policies import dtype_policy as dtype_policy_module
from keras.src.dtype_policies.dtype_policy import QUANTIZATION_MODES
from keras.src.models.functional import Functional
from keras.src.ops.operation import Operation
from keras.src.saving.keras_saveable import KerasSaveable
from keras.src.trainers.trainer import Trainer
from keras.src.utils.tracking import no_automatic_dependency_tracking

__all__ = [
    "AutocastScope",
    "FLOAT8_VARIABLE_NAMES",
    "Functional",
    "KerasSaveable",
    "NON_STATE_SLOT_NAMES",
    "QUANTIZATION_MODES",
    "Trainer",
    "accumulated_gradients",
    "add_weight_to_built_layer",
    "averaged_pairs_only",
    "all_layers",
    "called_by_keras_saving",
    "float8_amax_histories",
    "float8_source_policy_name",
    "get_autocast_scope",
    "in_stateless_scope",
    "install_call_hook",
    "install_checkpoint_save_guard",
    "install_custom_compile_restore",
    "install_functional_init_hook",
    "install_global_policy_lookup",
    "install_global_policy_setter",
    "install_model_serialization",
    "install_policy_deserialization",
    "install_policy_serialization",
    "keras_thread_policy",
    "moving_averages",
    "no_automatic_dependency_tracking",
    "own_variables",
    "producing_operation",
    "remove_float8_variables",
    "replace_layer_policy",
    "retrack_torch_parameters",
    "set_keras_thread_policy",
    "stored_dtype",
    "torch_builtin_update_state",
    "torch_parallel_optimizer_class",
    "untrack_variable",
    "variable_autocasts",
    "without_autocast",
]


# Names that `BaseOptimizer.build` gives the variables it creates from
# reference variables for every optimizer (keras 3.5 - 3.15): the moving
# average of `use_ema` and the gradient accumulators. They hold copies of
# weights and gradients, not the update rule's state, and Keras writes them
# with `Variable.assign`, not through the optimizer's `assign`.
NON_STATE_SLOT_NAMES = ("average", "gradient_accumulator")


# (value, dtype, device) -> the 0-d (or 1-d) torch tensor `constant` made.
_TORCH_CONSTANTS = {}


def constant(value, dtype):
    """`value` (a Python number, or a tuple of them) for a `keras.ops`
    call of a step, without a copy from the host at each call.

    On PyTorch a Python number given to a `keras.ops` function becomes a
    tensor through `torch.as_tensor(value, device=...)`
    (`keras.src.backend.torch.core.convert_to_tensor`, keras 3.0 - 3.15):
    on a GPU a copy from pageable host memory, which waits for every
    kernel queued before it (PyTorch's sync debug mode reports each one).
    An H100's eager FP8 decoder step made 147 of them, the GPU idle after
    each while the host queued the next kernels. Here each (value, dtype,
    device) is made once, on Keras's torch device, and kept; while
    `torch.compile` traces, and on TensorFlow and JAX (a compiled step's
    constant), a number is returned as it is and a tuple as a tensor.
    """
    import keras

    if keras.backend.backend() != "torch":
        return _as_is(value, dtype)
    import torch

    if torch.compiler.is_compiling():
        return _as_is(value, dtype)
    from keras.src.backend.torch.core import get_device

    device = get_device()
    key = (value, dtype, str(device))
    tensor = _TORCH_CONSTANTS.get(key)
    if tensor is None:
        tensor = ops.convert_to_tensor(value, dtype)
        _TORCH_CONSTANTS[key] = tensor
    return tensor


def _as_is(value, dtype):
    """A number as it is; a tuple as a tensor (an operator needs one)."""
    if isinstance(value, tuple):
        return ops.convert_to_tensor(value, dtype)
    return value


def torch_parallel_optimizer_class():
    """The base class of Keras's PyTorch optimizers that update in bulk.

    On the torch backend `keras.optimizers.Adam(...)` (and SGD, RMSprop,
    Adagrad, Lion, Nadam, ...) returns a subclass of
    `keras.src.backend.torch.optimizers.torch_parallel_optimizer.
    TorchParallelOptimizer` (keras 3.0 - 3.15), whose
    `_backend_update_step` updates every slot with `torch._foreach_*`
    calls instead of `update_step` and `assign`.
    """
    import keras.src.backend.torch.optimizers.torch_parallel_optimizer as bulk

    return bulk.TorchParallelOptimizer


def torch_builtin_update_state(optimizer):
    """The update rule and slots of Keras's PyTorch Adam, AdamW, SGD and
    RMSprop, or None for any other optimizer.

    Returns `(kind, slots, variable_index)`: `kind` is "adam" (AdamW adds
    only weight decay, applied before the update), "sgd" or "rmsprop";
    `slots` the lists of slot variables in the order `update_step` stores
    them (keras 3.0 - 3.15: Adam `_momentums`, `_velocities`, with amsgrad
    `_velocity_hats`; SGD `momentums` when `momentum != 0`; RMSprop
    `_velocities`, `_average_gradients` when centered, `_momentums` when
    `momentum > 0`); `variable_index(variable)` the index of a variable's
    slots in those lists (`_get_variable_index`). Only the exact classes
    `keras.optimizers.*` returns on PyTorch qualify: a subclass may change
    the update.
    """
    import keras.src.backend.torch.optimizers.torch_adam as torch_adam
    import keras.src.backend.torch.optimizers.torch_adamw as torch_adamw
    import keras.src.backend.torch.optimizers.torch_rmsprop as torch_rmsprop
    import keras.src.backend.torch.optimizers.torch_sgd as torch_sgd

    kind = {
        torch_adam.Adam: "adam",
        torch_adamw.AdamW: "adam",
        torch_sgd.SGD: "sgd",
        torch_rmsprop.RMSprop: "rmsprop",
    }.get(type(optimizer))
    if kind == "adam":
        slots = [optimizer._momentums, optimizer._velocities]
        if optimizer.amsgrad:
            slots.append(optimizer._velocity_hats)
    elif kind == "sgd":
        slots = [optimizer.momentums] if optimizer.momentum != 0 else []
    elif kind == "rmsprop":
        slots = [optimizer._velocities]
        if optimizer.centered:
            slots.append(optimizer._average_gradients)
        if optimizer.momentum > 0:
            slots.append(optimizer._momentums)
    else:
        return None
    return kind, slots, optimizer._get_variable_index


def stored_dtype(variable):
    """The dtype a Keras variable stores, whatever autocast scope is active."""
    # `Variable.dtype` answers the autocast dtype inside a layer's call;
    # `_dtype` is the dtype the variable was created with (keras 3.0 - 3.15).
    return variable._dtype


def variable_layout(variable):
    """A Keras variable's layout under `keras.distribution`, or None.

    `_layout` is what Keras's own `add_variable_from_reference` passes on to
    an optimizer slot (keras 3.0 - 3.15); a variable made for a model
    variable takes it so it is sharded the same way.
    """
    return getattr(variable, "_layout", None)


def accumulated_gradients(optimizer):
    """A Keras optimizer's gradient accumulators, one per trainable variable.

    Created by `build` when `gradient_accumulation_steps` is set, in the
    order of the variables it was built for (keras 3.5 - 3.15).
    """
    return list(optimizer._accumulated_gradients)


@contextlib.contextmanager
def averaged_pairs_only(optimizer):
    """Context manager in which a Keras optimizer's EMA lists hold only the
    variables that have a moving average.

    With `use_ema=True`, `BaseOptimizer.build` keeps one entry of
    `_model_variables_moving_average` per entry of `_trainable_variables`,
    None for a variable with `overwrite_with_gradient` (keras 3.0 - 3.15).
    The base class skips the None entries, but the TensorFlow backend's
    `_overwrite_model_variables_with_average_value` and the JAX backend's
    `_backend_apply_gradients` assign every entry, None included. Inside,
    both lists hold only the pairs with an average, in order; the lists are
    swapped past attribute tracking and put back on exit.
    """
    averages = getattr(optimizer, "_model_variables_moving_average", None)
    if (
        not optimizer.use_ema
        or averages is None
        or all(average is not None for average in averages)
    ):
        yield
        return
    saved = {
        "_trainable_variables": optimizer._trainable_variables,
        "_model_variables_moving_average": averages,
    }
    pairs = [
        (variable, average)
        for variable, average in zip(optimizer._trainable_variables, averages)
        if average is not None
    ]
    optimizer.__dict__.update(
        _trainable_variables=[variable for variable, _ in pairs],
        _model_variables_moving_average=[average for _, average in pairs],
    )
    try:
        yield
    finally:
        optimizer.__dict__.update(saved)


def moving_averages(optimizer):
    """The EMA list of a built Keras optimizer with `use_ema=True`: one
    moving average per variable it was built for, None for a variable with
    `overwrite_with_gradient` (keras 3.0 - 3.15)."""
    return list(optimizer._model_variables_moving_average)


def variable_autocasts(variable):
    """Whether a Keras variable opted into autocasting (`autocast=True`)."""
    # Set from the `autocast` argument of `Variable.__init__` (keras 3.0-3.15).
    return variable._autocast


@contextlib.contextmanager
def without_autocast():
    """Context manager in which variables read as their stored dtype.

    `AutocastScope(None)` would also stop the casting, but under it
    `Variable.dtype` answers `floatx()` instead of the stored dtype (keras
    3.0 - 3.15), so the active scope is removed instead.
    """
    previous = get_autocast_scope()
    global_state.set_global_attribute("autocast_scope", None)
    try:
        yield
    finally:
        global_state.set_global_attribute("autocast_scope", previous)


def set_keras_thread_policy(policy):
    """Sets (or with None clears) Keras's global dtype policy for this thread.

    `keras.config.set_dtype_policy` cannot clear it, and keras_mp needs to
    clear it so that the lookup installed below falls through to keras_mp's
    process-global policy.
    """
    global_state.set_global_attribute("dtype_policy", policy)


def called_by_keras_saving(frame):
    """Whether `frame` is Keras's saving walking an object's attributes.

    `keras.src.saving.saving_lib._walk_saveable` (keras 3.0 - 3.15) saves
    every `KerasSaveable` that `dir(obj)` lists; a wrapper hides its inner
    optimizer from that walk only, to keep the inner optimizer's layout.
    """
    return frame is not None and frame.f_globals.get("__name__") == (
        "keras.src.saving.saving_lib"
    )


def keras_thread_policy():
    """The policy Keras stores for this thread, or None."""
    return global_state.get_global_attribute("dtype_policy", None)


def keras_session():
    """A token of Keras's current session: a new one after `clear_session`.

    `keras.utils.clear_session` (`keras.backend.clear_session`, which
    Keras's own `TestCase.setUp` calls) replaces the module attribute
    `keras.src.backend.common.global_state.GLOBAL_STATE_TRACKER` with a
    new `threading.local` (keras 3.0 - 3.15), and with it the global dtype
    policy that `keras.config.set_dtype_policy` stored. Compared by
    identity: the same object until the next `clear_session`, in every
    thread.
    """
    return global_state.GLOBAL_STATE_TRACKER


def install_checkpoint_save_guard(may_save):
    """Lets `may_save(callback)` veto a save of `keras.callbacks.ModelCheckpoint`.

    Every save of the callback, per batch (`save_freq=N`) or at an epoch's
    end, goes through its `_save_model(epoch, batch, logs)` (keras 3.0 -
    3.15, and tf.keras before it; subclasses that override it call it
    through `super()`), before `save_best_only`'s comparison: a vetoed save
    neither writes a file nor becomes the best one.

    Args:
        may_save: Callable taking the `ModelCheckpoint`, returning whether
            it may save now.
    """
    import keras

    checkpoint = keras.callbacks.ModelCheckpoint
    original = checkpoint._save_model
    if getattr(original, "_keras_mp_hook", False):
        return

    @functools.wraps(original)
    def _save_model(self, *args, **kwargs):
        if may_save(self):
            return original(self, *args, **kwargs)
        return None

    _save_model._keras_mp_hook = True
    checkpoint._save_model = _save_model


def install_custom_compile_restore(restore):
    """Lets `restore(model, config)` compile, on load, a model whose
    `compile()` is custom.

    `deserialize_keras_object` (keras 3.0 - 3.15) calls
    `Trainer.compile_from_config(compile_config)` on the model it rebuilt,
    after `build_from_config` and before `load_model` loads the variables
    of the model and of its optimizer. For a class that overrides
    `compile` (keras-hub's tasks), Keras's `compile_from_config` only
    warns "`compile()` was not called as part of model loading", with the
    same test as here (`self.__class__.compile != Trainer.compile`): the
    model keeps what its constructor compiled, and the saved optimizer's
    variables load only where their layout happens to match. Wrapped
    here, such a model goes to `restore` first; where it returns True,
    Keras's warning is left out. A class that overrides
    `compile_from_config` itself never reaches the wrapper.

    Args:
        restore: Callable `(model, config) -> bool`, `config` the
            serialized compile config; returns whether it handled it
            (compiled the model, or warned that it could not).
    """
    original = Trainer.compile_from_config
    if getattr(original, "_keras_mp_hook", False):
        return

    @functools.wraps(original)
    def compile_from_config(self, config):
        custom = self.__class__.compile != Trainer.compile
        if custom and restore(self, config):
            return None
        return original(self, config)

    compile_from_config._keras_mp_hook = True
    Trainer.compile_from_config = compile_from_config


def install_global_policy_lookup(process_policy):
    """Makes Keras layers see keras_mp's process-global policy in every thread.

    Keras keeps its global dtype policy in thread-local state, so a layer built
    in a worker thread would miss a policy set in the main thread. Keras layers
    resolve `dtype=None` through the module attribute
    `keras.src.dtype_policies.dtype_policy.dtype_policy` (keras 3.0 - 3.15),
    which is replaced here by a lookup that prefers a policy set with Keras's
    own API in this thread, then `process_policy()`, then `floatx()`.

    Args:
        process_policy: Callable returning keras_mp's global policy, or None
            while none is set.
    """
    original = dtype_policy_module.dtype_policy
    if getattr(original, "_keras_mp_lookup", False):
        return

    @functools.wraps(original)
    def dtype_policy():
        policy = global_state.get_global_attribute("dtype_policy", None)
        if policy is None:
            policy = process_policy()
        if policy is None:
            # Not cached, unlike Keras: the default keeps tracking floatx().
            from keras import config

            policy = dtype_policy_module.DTypePolicy(config.floatx())
        return policy

    dtype_policy._keras_mp_lookup = True
    dtype_policy_module.dtype_policy = dtype_policy
    # The public names were bound to the original at import: left alone, they
    # would report floatx in a worker thread and cache it there thread-locally,
    # hiding the process-global policy from that thread's layers.
    import keras

    for module in (keras.config, keras.mixed_precision):
        for attribute in ("dtype_policy", "global_policy"):
            if getattr(module, attribute, None) is original:
                setattr(module, attribute, dtype_policy)


def install_global_policy_setter(set_policy):
    """Makes Keras's own policy setters set keras_mp's global policy.

    `keras.config.set_dtype_policy` and its legacy names
    `keras.mixed_precision.set_dtype_policy` / `set_global_policy` are one
    function, `keras.src.dtype_policies.dtype_policy.set_dtype_policy`
    (keras 3.0 - 3.15), which stores the policy thread-locally. Routed here
    to `set_policy(policy, keras_setter)`, so that keras_mp's global policy
    and Keras's are one; `keras_setter` is the original, for policies that
    only Keras handles (quantized ones).
    """
    original = dtype_policy_module.set_dtype_policy
    if getattr(original, "_keras_mp_hook", False):
        return

    @functools.wraps(original)
    def set_dtype_policy(policy):
        set_policy(policy, original)

    set_dtype_policy._keras_mp_hook = True
    dtype_policy_module.set_dtype_policy = set_dtype_policy
    import keras

    for module in (keras.config, keras.mixed_precision):
        for attribute in ("set_dtype_policy", "set_global_policy"):
            if getattr(module, attribute, None) is original:
                setattr(module, attribute, set_dtype_policy)


def install_policy_deserialization(keeps_policy):
    """Lets layers reload with their keras_mp policy object, not its name.

    `Operation.from_config` (keras 3.0 - 3.15) deserializes a dict `dtype` and
    then passes on only the policy's name, which would drop a keras_mp
    Policy's loss scale. For policies where `keeps_policy(policy)` is true,
    the policy object itself reaches the layer's constructor.
    """
    original = Operation.from_config.__func__
    if getattr(original, "_keras_mp_hook", False):
        return
    from keras import dtype_policies

    @functools.wraps(original)
    def from_config(cls, config):
        if isinstance(config, dict) and isinstance(config.get("dtype"), dict):
            policy = dtype_policies.deserialize(config["dtype"])
            if keeps_policy(policy):
                config = dict(config, dtype=policy)
        return original(cls, config)

    from_config._keras_mp_hook = True
    Operation.from_config = classmethod(from_config)


def install_call_hook(name, callback):
    """Lets keras_mp see (and replace) what each layer call returns.

    `Layer.__call__` (keras 3.0 - 3.15) runs the layer's `call` (or, on
    symbolic inputs, `compute_output_spec`) through `Operation.__call__`, on
    every backend (the torch backend's `forward` calls it too), then sets the
    outputs' masks and records the functional-graph node. Wrapped here, an
    output cast happens before both, so masks and symbolic dtypes follow it.

    Args:
        name: Names the hook, so that installing it twice wraps once.
        callback: Callable `(operation, outputs) -> outputs`, called for
            every operation (layers and `keras.ops` operations alike).
    """
    original = Operation.__call__
    hooks = getattr(original, "_keras_mp_hooks", frozenset())
    if name in hooks:
        return

    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        return callback(self, original(self, *args, **kwargs))

    __call__._keras_mp_hooks = hooks | {name}
    Operation.__call__ = __call__


def install_functional_init_hook(callback):
    """Calls `callback(model)` at the end of every functional model's init.

    `keras.Model(inputs, outputs)` and a Sequential model's rebuild both
    construct `keras.src.models.functional.Functional` (keras 3.0 - 3.15);
    when its `__init__` returns, the layer graph and its outputs are known.
    """
    original = Functional.__init__
    if getattr(original, "_keras_mp_hook", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        callback(self)

    __init__._keras_mp_hook = True
    Functional.__init__ = __init__


def install_model_serialization(key, record, restore, context):
    """Lets keras_mp add what it decided to a serialized object, and apply
    it when the object is rebuilt.

    `serialize_keras_object` (keras 3.0 - 3.15) puts an object's
    `build_config` and `compile_config` beside its `config` through
    `serialization_lib.get_build_and_compile_config`; the hook here also
    puts `record(obj)` there under `key`, unless it is None. Keras ignores
    a key it does not know, so a file written so still loads without
    keras_mp. `deserialize_keras_object` (the function in
    `serialization_lib`, the name `saving_lib` imported, and the names
    `keras.saving` and `keras.utils` export) is wrapped to call
    `restore(instance, value)` on the object it rebuilt from such a dict,
    before `load_model` loads its weights.

    Args:
        key: The key of the record in the serialized dict.
        record: Callable `obj -> JSON-able value or None`.
        restore: Callable `(instance, value)`.
        context: A context manager factory each deserialization runs in.
    """
    import keras
    from keras.src import saving as src_saving
    from keras.src.saving import saving_lib
    from keras.src.saving import serialization_lib

    original_extras = serialization_lib.get_build_and_compile_config
    if getattr(original_extras, "_keras_mp_hook", False):
        return
    original_deserialize = serialization_lib.deserialize_keras_object

    @functools.wraps(original_extras)
    def get_build_and_compile_config(obj, config):
        original_extras(obj, config)
        value = record(obj)
        if value is not None:
            config[key] = value

    @functools.wraps(original_deserialize)
    def deserialize_keras_object(config, *args, **kwargs):
        with context():
            instance = original_deserialize(config, *args, **kwargs)
        if isinstance(config, dict) and key in config:
            restore(instance, config[key])
        return instance

    get_build_and_compile_config._keras_mp_hook = True
    deserialize_keras_object._keras_mp_hook = True
    serialization_lib.get_build_and_compile_config = (
        get_build_and_compile_config
    )
    modules = (serialization_lib, saving_lib, src_saving)
    for module in (*modules, keras.saving, keras.utils):
        if getattr(module, "deserialize_keras_object", None) is (
            original_deserialize
        ):
            module.deserialize_keras_object = deserialize_keras_object


def producing_operation(tensor):
    """The operation whose call produced a symbolic tensor, or None.

    Recorded as `KerasTensor._keras_history` (keras 3.0 - 3.15).
    """
    history = getattr(tensor, "_keras_history", None)
    return None if history is None else history.operation


def own_variables(layer):
    """The variables a layer created itself, not those of its sublayers.

    `Layer._trainable_variables` and `_non_trainable_variables` (keras 3.0 -
    3.15) hold them.
    """
    return [*layer._trainable_variables, *layer._non_trainable_variables]


def all_layers(layer):
    """`layer` and every layer inside it, depth first.

    `Layer._flatten_layers` (keras 3.0 - 3.15).
    """
    return list(layer._flatten_layers(include_self=True))


def add_weight_to_built_layer(layer, **kwargs):
    """`layer.add_weight(**kwargs)`, also once `layer` is built.

    A built layer's `_tracker` (keras 3.0 - 3.15) is locked against new
    state; it is unlocked for this one variable, as `Layer.quantize` and
    `_untrack_variable` do.
    """
    locked = layer._tracker.locked
    layer._tracker.unlock()
    try:
        return layer.add_weight(**kwargs)
    finally:
        if locked:
            layer._tracker.lock()


def untrack_variable(layer, variable):
    """Removes a variable `layer` created from its variables.

    `Layer._untrack_variable` (keras 3.0 - 3.15) also unregisters it from the
    torch module of the layer on PyTorch.
    """
    layer._untrack_variable(variable)


# The variables `quantize("float8")` gives a Dense or an EinsumDense
# (`_float8_build`, keras 3.15): per tensor (the inputs, the kernel, the
# output gradient) a scale and an amax history, trainable, which Keras's
# optimizer overwrites with their "gradients".
FLOAT8_VARIABLE_NAMES = (
    "inputs_scale",
    "inputs_amax_history",
    "kernel_scale",
    "kernel_amax_history",
    "outputs_grad_scale",
    "outputs_grad_amax_history",
)


def float8_source_policy_name(layer):
    """The name of the policy a float8 layer was quantized from.

    `QuantizedFloat8DTypePolicy` (keras 3.15) is named
    `"float8_from_<source>"` and keeps the source's name under
    `"source_name"` in its config, e.g. `"float32"` or `"mixed_bfloat16"`.
    """
    return layer.dtype_policy.get_config()["source_name"]


def float8_amax_histories(layer):
    """The amax histories of a float8 layer, newest first.

    Returns float32 NumPy `(3, H)`: rows the inputs, the kernel and the
    output gradient. Keras's history is a ring:
    `keras.quantizers.compute_float8_amax_history` (keras 3.15) rolls it by
    -1 and writes the new amax at index 0, so index 0 holds the newest
    amax, index H - 1 the one before it, and so on down to index 1, the
    oldest.
    """
    names = FLOAT8_VARIABLE_NAMES[1::2]
    rows = [ops.convert_to_numpy(getattr(layer, name)) for name in names]
    return np.stack([np.roll(row[::-1], 1) for row in rows]).astype("float32")


def remove_float8_variables(layer):
    """Deletes a float8 layer's `FLOAT8_VARIABLE_NAMES` variables.

    What `Layer.__delattr__` does to a variable (keras 3.15), as
    `Dense.quantize` deletes its float kernel: untrack it (on PyTorch also
    unregister it), then delete the attribute through the next class of
    the layer (TensorFlow's tracking drops its checkpoint dependency).
    Without its `gc.collect()` per variable, which takes a large part of a
    second in a process that has imported TensorFlow.
    """
    import keras

    for name in FLOAT8_VARIABLE_NAMES:
        untrack_variable(layer, getattr(layer, name))
        super(keras.layers.Layer, layer).__delattr__(name)


def retrack_torch_parameters(model):
    """On PyTorch, remakes the torch parameters of `model` and each layer
    in it from their variables, as `Model.quantize` does once it has
    replaced variables (`_post_quantize`, keras 3.15: `_track_variables`
    on every layer). A layer's torch parameters are a snapshot of its own
    and its sublayers' variables: untracking a variable updates only its
    own layer's. Nothing on other backends.
    """
    import keras

    if keras.backend.backend() != "torch":
        return
    for layer in all_layers(model):
        layer._track_variables()


def replace_layer_policy(layer, policy):
    """Gives `layer` its own `policy`, even where it had a `DTypePolicyMap`.

    Keras's `dtype_policy` setter writes a mapped layer's policy into the map,
    which the global map shares with every other layer; `_dtype_policy`
    (keras 3.0 - 3.15) holds the layer's own.
    """
    layer._dtype_policy = policy


def install_policy_serialization(is_own_policy, note_key, note):
    """Writes a package's policies so that Keras alone refuses them clearly.

    Without the package imported, Keras's `dtype_policies.deserialize`
    (keras 3.0 - 3.15) turns a policy config of a class it does not know
    into the bare class name, and `Operation.from_config` then fails with
    "'str' object has no attribute 'quantization_mode'". A policy written
    by `serialize` here has no `class_name` and carries `note_key: note`
    first, so Keras raises a ValueError that prints it ("Unknown `config`
    as a `dict`, config={note_key: note, ...}"). `deserialize` here puts
    the class name back, so with the package imported a layer reloads
    exactly as from the plain format, which still loads too.

    Layers serialize their policy through
    `keras.src.dtype_policies.serialize`, and `Operation.from_config` and
    `dtype_policies.get` deserialize through `.deserialize`; both are
    replaced there and under their public names.

    Args:
        is_own_policy: Callable telling whether a policy is the package's.
        note_key: The key of the note, such as the package name.
        note: What Keras's error shows, such as "import the package".
    """
    original_serialize = dtype_policies_module.serialize
    original_deserialize = dtype_policies_module.deserialize
    if getattr(original_serialize, "_keras_mp_hook", False):
        return

    @functools.wraps(original_serialize)
    def serialize(dtype_policy):
        config = original_serialize(dtype_policy)
        if not (is_own_policy(dtype_policy) and isinstance(config, dict)):
            return config
        fields = {k: v for k, v in config.items() if k != "class_name"}
        return {note_key: note, **fields}

    @functools.wraps(original_deserialize)
    def deserialize(config, custom_objects=None):
        if (
            isinstance(config, dict)
            and note_key in config
            and "class_name" not in config
            and isinstance(config.get("registered_name"), str)
        ):
            config = {k: v for k, v in config.items() if k != note_key}
            config["class_name"] = config["registered_name"].split(">")[-1]
        return original_deserialize(config, custom_objects=custom_objects)

    serialize._keras_mp_hook = True
    deserialize._keras_mp_hook = True
    dtype_policies_module.serialize = serialize
    dtype_policies_module.deserialize = deserialize
    import keras

    keras.dtype_policies.serialize = serialize
    keras.dtype_policies.deserialize = deserialize


def install_loading_wrapper(wrapper):
    """Runs every Keras load of saved state inside `wrapper`.

    `wrapper` is a context manager factory. `Model.load_weights` and
    `keras.saving.load_model` (`.keras`, `.weights.h5`) call
    `keras.src.saving.saving_lib.load_weights_only` and `load_model`
    through the module (keras 3.0 - 3.15), which are replaced here by
    functions that run the originals inside `wrapper()`.
    """
    from keras.src.saving import saving_lib

    for name in ("load_model", "load_weights_only"):
        original = getattr(saving_lib, name)
        if getattr(original, "_keras_mp_hook", False):
            continue

        def load(*args, _original=original, **kwargs):
            with wrapper():
                return _original(*args, **kwargs)

        functools.update_wrapper(load, original)
        load._keras_mp_hook = True
        setattr(saving_lib, name, load)

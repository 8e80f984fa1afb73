"""The one module of keras_mp that imports `keras.src`.

Keras 3 keeps a few pieces that mixed precision needs outside its public API.
Each symbol below names the Keras versions it was checked against; the test
`tests/keras_internals_test.py` imports every one of them, so a Keras release
that moves one fails loudly in CI instead of in a user's training run.
"""

import contextlib
import functools

# Checked against keras 3.10 - 3.15.
from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.common.variables import AutocastScope
from keras.src.backend.common.variables import get_autocast_scope
from keras.src.dtype_policies import dtype_policy as dtype_policy_module
from keras.src.dtype_policies.dtype_policy import QUANTIZATION_MODES
from keras.src.ops.operation import Operation
from keras.src.saving.keras_saveable import KerasSaveable
from keras.src.trainers.trainer import Trainer
from keras.src.utils.tracking import no_automatic_dependency_tracking

__all__ = [
    "AutocastScope",
    "NON_STATE_SLOT_NAMES",
    "KerasSaveable",
    "QUANTIZATION_MODES",
    "Trainer",
    "accumulated_gradients",
    "called_by_keras_saving",
    "get_autocast_scope",
    "in_stateless_scope",
    "install_global_policy_lookup",
    "install_global_policy_setter",
    "install_policy_deserialization",
    "keras_thread_policy",
    "no_automatic_dependency_tracking",
    "set_keras_thread_policy",
    "stored_dtype",
    "torch_parallel_optimizer_class",
    "variable_autocasts",
    "without_autocast",
]


# Names that `BaseOptimizer.build` gives the variables it creates from
# reference variables for every optimizer (keras 3.5 - 3.15): the moving
# average of `use_ema` and the gradient accumulators. They hold copies of
# weights and gradients, not the update rule's state, and Keras writes them
# with `Variable.assign`, not through the optimizer's `assign`.
NON_STATE_SLOT_NAMES = ("average", "gradient_accumulator")


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


def stored_dtype(variable):
    """The dtype a Keras variable stores, whatever autocast scope is active."""
    # `Variable.dtype` answers the autocast dtype inside a layer's call;
    # `_dtype` is the dtype the variable was created with (keras 3.0 - 3.15).
    return variable._dtype


def accumulated_gradients(optimizer):
    """A Keras optimizer's gradient accumulators, one per trainable variable.

    Created by `build` when `gradient_accumulation_steps` is set, in the
    order of the variables it was built for (keras 3.5 - 3.15).
    """
    return list(optimizer._accumulated_gradients)


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

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
    "KerasSaveable",
    "QUANTIZATION_MODES",
    "Trainer",
    "get_autocast_scope",
    "in_stateless_scope",
    "install_global_policy_lookup",
    "install_policy_deserialization",
    "no_automatic_dependency_tracking",
    "set_keras_thread_policy",
    "stored_dtype",
    "variable_autocasts",
    "without_autocast",
]


def stored_dtype(variable):
    """The dtype a Keras variable stores, whatever autocast scope is active."""
    # `Variable.dtype` answers the autocast dtype inside a layer's call;
    # `_dtype` is the dtype the variable was created with (keras 3.0 - 3.15).
    return variable._dtype


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

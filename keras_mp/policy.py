"""Dtype policies with a loss scale, and the process-global policy."""

import contextlib
import threading
import warnings

import keras

from keras_mp import _keras_internals
from keras_mp import loss_scale as loss_scale_module
from keras_mp.backend import devices

_MIXED_NAMES = ("mixed_float16", "mixed_bfloat16")
_VALID_NAMES_TEXT = (
    "'mixed_float16', 'mixed_bfloat16', or the name of a float dtype "
    "('float16', 'bfloat16', 'float32', 'float64')"
)


@keras.saving.register_keras_serializable(package="keras_mp")
class Policy(keras.DTypePolicy):
    """A dtype policy that also says how to scale the loss.

    A `Policy` is a `keras.DTypePolicy`, so any Keras layer accepts it as
    `dtype=`. Besides the compute and variable dtypes it carries the loss scale
    that `Model.compile` gives the optimizer: float16 has only 5 exponent bits,
    so small gradients flush to zero unless the loss is scaled up first.
    bfloat16 has float32's exponent range and needs no scaling.

    Args:
        name: `"mixed_float16"` (float16 compute, float32 variables),
            `"mixed_bfloat16"` (bfloat16 compute, float32 variables), or the
            name of a dtype used for both.
        loss_scale: `"auto"` gives a `DynamicLossScale()` for
            `"mixed_float16"` and None otherwise. Also takes None,
            `"dynamic"`, a number (a `FixedLossScale`), a `LossScale` or a
            loss scale config dict. Defaults to `"auto"`.

    Example:

    >>> policy = keras_mp.Policy("mixed_float16")
    >>> policy.compute_dtype, policy.variable_dtype
    ('float16', 'float32')
    >>> type(policy.loss_scale).__name__
    'DynamicLossScale'
    >>> keras_mp.Policy("mixed_bfloat16").loss_scale is None
    True
    """

    def __init__(self, name, loss_scale="auto"):
        if not isinstance(name, str):
            raise TypeError(
                f"`name` must be a string: {_VALID_NAMES_TEXT}. "
                f"Received: name={name!r} (of type {type(name).__name__})"
            )
        if name.startswith(_keras_internals.QUANTIZATION_MODES):
            raise ValueError(
                f"keras_mp.Policy takes {_VALID_NAMES_TEXT}. Received: "
                f"name={name!r}, a quantized policy; use "
                "`keras.dtype_policies.get(name)` for quantization."
            )
        try:
            super().__init__(name)
        except ValueError:
            raise ValueError(
                f"Unknown policy name. Expected {_VALID_NAMES_TEXT}. "
                f"Received: name={name!r}"
            ) from None
        if loss_scale == "auto":
            loss_scale = "dynamic" if name == "mixed_float16" else None
        self._loss_scale = loss_scale_module.get(loss_scale)

    @property
    def loss_scale(self):
        """The `LossScale` that `compile` copies for the optimizer, or None."""
        return self._loss_scale

    def get_config(self):
        loss_scale = None
        if self._loss_scale is not None:
            loss_scale = keras.saving.serialize_keras_object(self._loss_scale)
        return {"name": self.name, "loss_scale": loss_scale}

    @classmethod
    def from_config(cls, config):
        if not isinstance(config, dict) or "name" not in config:
            raise ValueError(
                "A Policy config is a dict with a 'name' key and an optional "
                f"'loss_scale' key. Received: config={config!r}"
            )
        unknown = set(config) - {"name", "loss_scale"}
        if unknown:
            raise ValueError(
                "A Policy config takes only 'name' and 'loss_scale'. "
                f"Received unknown keys: {sorted(unknown)}"
            )
        return cls(config["name"], loss_scale=config.get("loss_scale", "auto"))

    def __eq__(self, other):
        if type(other) is not type(self) or self.name != other.name:
            return False
        if self._loss_scale is None or other._loss_scale is None:
            return self._loss_scale is other._loss_scale
        return type(self._loss_scale) is type(other._loss_scale) and (
            self._loss_scale.get_config() == other._loss_scale.get_config()
        )

    __hash__ = None

    def __repr__(self):
        return f'<Policy "{self.name}", loss_scale={self._loss_scale!r}>'


# Process-global, not thread-local: a layer built in a worker thread (a data
# pipeline, a model server) must see the policy the main thread set.
_global_policy = None
_global_policy_lock = threading.Lock()


def _process_policy():
    return _global_policy


_keras_internals.install_global_policy_lookup(_process_policy)
_keras_internals.install_policy_deserialization(
    lambda policy: isinstance(policy, Policy)
)


def global_policy():
    """Returns the global keras_mp `Policy`.

    Until `set_global_policy` is called (and again after
    `set_global_policy(None)`), this is a policy named after
    `keras.config.floatx()`, read afresh on every call.

    Example:

    >>> keras_mp.global_policy().name
    'float32'
    """
    policy = _global_policy
    if policy is None:
        return Policy(keras.config.floatx())
    return policy


def _to_policy(policy):
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return Policy(policy)
    if isinstance(policy, keras.DTypePolicy):
        if policy.quantization_mode is not None:
            raise ValueError(
                "The global policy cannot be a quantized policy. Received: "
                f"policy={policy!r}. Quantize the model with "
                "`model.quantize(mode)` instead."
            )
        return Policy(policy.name)
    raise TypeError(
        "`policy` must be a keras_mp.Policy, a policy name such as "
        "'mixed_float16', a keras.DTypePolicy or None. "
        f"Received: policy={policy!r} (of type {type(policy).__name__})"
    )


def set_global_policy(policy):
    """Sets the global policy, for keras_mp and for Keras's built-in layers.

    Layers created afterwards without a `dtype` use it, and `Model.compile`
    wraps the optimizer in a `keras_mp.LossScaleOptimizer` when the model's
    policy has a loss scale.

    Args:
        policy: A `Policy`, a policy name, a `keras.DTypePolicy`, or None to
            return to following `keras.config.floatx()`.

    Example:

    >>> keras_mp.set_global_policy("mixed_bfloat16")
    >>> keras.layers.Dense(2).compute_dtype
    'bfloat16'
    >>> keras_mp.set_global_policy(None)
    """
    global _global_policy
    if policy is not None:
        policy = _to_policy(policy)
        if not keras.backend.is_float_dtype(policy.compute_dtype):
            raise ValueError(
                "The global policy must be a floating-point policy, such as "
                f"'mixed_float16' or 'float32'. Received: policy={policy!r}. "
                "Give integer dtypes to individual layers with `dtype=`."
            )
        if policy.name in ("float16", "bfloat16"):
            warnings.warn(
                f"The global policy {policy.name!r} keeps the variables in "
                f"{policy.name} too, so small weight updates round away and "
                "training often stalls. Use "
                f"'mixed_{policy.name}' instead: {policy.name} compute with "
                "float32 variables.",
                UserWarning,
                stacklevel=2,
            )
        if policy.name in _MIXED_NAMES:
            devices.check_hardware_once(policy.name)
    _set_global_policy_unchecked(policy)


def _set_global_policy_unchecked(policy):
    global _global_policy
    with _global_policy_lock:
        _global_policy = policy
        # Cleared rather than set: a policy cached in this thread's Keras state
        # would outlive a later set_global_policy made from another thread.
        _keras_internals.set_keras_thread_policy(None)


@contextlib.contextmanager
def policy_scope(policy):
    """Context manager that sets the global policy and restores the old one.

    Args:
        policy: Anything `set_global_policy` takes.

    Example:

    >>> with keras_mp.policy_scope("mixed_bfloat16"):
    ...     keras_mp.global_policy().name
    'mixed_bfloat16'
    >>> keras_mp.global_policy().name
    'float32'
    """
    previous = _global_policy
    set_global_policy(policy)
    try:
        yield
    finally:
        _set_global_policy_unchecked(previous)

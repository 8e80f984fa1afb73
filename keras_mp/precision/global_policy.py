"""The global policy and the precision rules in force with it.

`set_global_policy` (also Keras's own setter, routed here), `policy_scope`
(the same for one thread) and what layers created now read:
`global_policy()`, `global_float32_islands()` (a `PrecisionRules`, from
`rules.py`), `global_fp8()` and `global_skip_nonfinite()`. A policy set
through Keras's setter is forgotten at Keras's `clear_session`, as in
Keras.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any
from typing import NamedTuple

import keras

from keras_mp import _keras_internals
from keras_mp import policy as policy_module
from keras_mp._fp8 import recipe as recipe_module
from keras_mp.policy import Policy
from keras_mp.precision.rules import resolve_rules


class _GlobalSettings(NamedTuple):
    """What `set_global_policy` sets, replaced whole at each call."""

    # A `Policy` or `DTypePolicyMap`, or None (follow `floatx()`).
    policy: Any = None
    # The float32 islands (a `keras_mp.PrecisionRules`) that layers created
    # without a `dtype` follow, or None.
    float32_islands: Any = None
    # The FP8 recipe that `fp8.DEFAULT_RULES` give such layers, or None.
    fp8: Any = None
    # `set_global_policy(..., skip_nonfinite=...)`: True, False, or None (on
    # where an FP8 recipe is in use; `models.py` resolves it at `compile`).
    skip_nonfinite: bool | None = None
    # The Keras session (`_keras_internals.keras_session`) in which the
    # policy was set through Keras's own setter
    # (`keras.config.set_dtype_policy`,
    # `keras.mixed_precision.set_global_policy`), or None. Keras forgets
    # such a policy at `keras.utils.clear_session()`, and keras_mp does the
    # same, so that importing keras_mp changes nothing Keras's own code
    # relies on. A policy of `keras_mp.set_global_policy` outlives
    # `clear_session`, as tf.keras's global policy did: it carries keras_mp's
    # settings (FP8 recipe, float32 islands, `skip_nonfinite`) that Keras
    # knows nothing of.
    session: Any = None


# Process-global, not thread-local: a layer built in a worker thread (a data
# pipeline, a model server) must see the policy the main thread set. Only a
# `policy_scope` is per thread.
_settings = _GlobalSettings()
_global_policy_lock = threading.Lock()
_scopes = threading.local()
# The value of a `policy_scope(None)`: the floatx-tracking default.
_FLOATX = object()


def _scoped_policy():
    """The policy of this thread's innermost `policy_scope`, or None."""
    policy = getattr(_scopes, "policy", None)
    if policy is _FLOATX:
        return Policy(keras.config.floatx())
    return policy


def _process_policy():
    scoped = _scoped_policy()
    if scoped is not None:
        return scoped
    session = _settings.session
    if session is not None and session is not _keras_internals.keras_session():
        # Set with Keras's own setter, which `clear_session` undoes in
        # Keras: so it does here.
        _set_global_policy_unchecked(None)
    return _settings.policy


_keras_internals.install_global_policy_lookup(_process_policy)


def global_policy() -> Policy | keras.dtype_policies.DTypePolicyMap:
    """Returns the global keras_mp `Policy`.

    Until `set_global_policy` is called (and again after
    `set_global_policy(None)`), this is a policy named after
    `keras.config.floatx()`, read afresh on every call. Inside a
    `policy_scope`, this thread sees the scope's policy. A
    `keras.dtype_policies.DTypePolicyMap` set as the global policy is
    returned as is.

    Example:

    >>> keras_mp.global_policy().name
    'float32'
    """
    policy = _process_policy()
    if policy is None:
        return Policy(keras.config.floatx())
    return policy


def set_global_policy(
    policy: Policy | keras.DTypePolicy | str | None,
    float32_islands: Any = None,
    fp8: recipe_module.Recipe | bool | None = None,
    skip_nonfinite: bool | None = None,
) -> None:
    """Sets the global policy, for keras_mp and for Keras's built-in layers.

    Call it before building models: layers take the global policy when they
    are created, so a model built earlier keeps the policy it was built
    with (`compile` warns when that differs from a global policy with a loss
    scale). Layers created afterwards without a `dtype` use it, and
    `Model.compile` wraps the optimizer in a `keras_mp.LossScaleOptimizer`
    when the model's policy has a loss scale.

    `keras.config.set_dtype_policy` (and its legacy name
    `keras.mixed_precision.set_global_policy`) set this same policy, and
    like `set_global_policy(policy)` they turn the float32 islands off. As
    in Keras, `keras.utils.clear_session()` forgets a policy set through
    them; one set here outlives it, as tf.keras's global policy did. Setting
    a policy does not initialize the TensorFlow or JAX runtime: the hardware
    check runs when the first mixed layer is built.

    Args:
        policy: A `Policy`, a policy name, a `keras.DTypePolicy`, a
            `keras.dtype_policies.DTypePolicyMap` (each layer then takes the
            entry of its path), or None to return to following
            `keras.config.floatx()`.
        float32_islands: Precision rules that layers created afterwards
            without a `dtype` follow: `"default"`
            (`keras_mp.DEFAULT_FLOAT32_ISLANDS`: softmax and the model's
            output layers in float32), a `keras_mp.precision_rules(...)`, or
            None. Each call replaces the previous rules. Over a
            `DTypePolicyMap`, a rule that matches a layer wins over the
            map's entry for it, with a warning (see
            `keras_mp.precision_rules`). Defaults to None.
        fp8: A `keras_mp.fp8.Recipe`, `True` (`keras_mp.fp8.DEFAULT_RECIPE`)
            or None. The layers that `keras_mp.fp8.DEFAULT_RULES` select
            among those created afterwards without a `dtype` compute their
            GEMMs in FP8 by this recipe: every `Dense` and `EinsumDense`
            (`MultiHeadAttention`'s projections included) except a
            Sequential or functional model's output layers and GEMMs whose
            dimensions are not multiples of 16 (128 for `"block"`).
            A `float32_islands` rule that gives a layer a policy wins over
            them: a subclassed model's output layers cannot be found, so
            name them by path (`precision_rules({"head": "float32"})`).
            `keras_mp.explain_precision` shows each layer's recipe or why
            it has none. Defaults to None.
        skip_nonfinite: Whether `Model.compile` makes a step whose
            gradients hold an inf or NaN a skipped step even without a loss
            scale: the optimizer is wrapped in
            `keras_mp.LossScaleOptimizer(optimizer, loss_scale=1,
            skip_nonfinite=True, track_overflow=True)`, which scales
            nothing, skips and counts the step (`skipped_steps` in the
            `fit` logs) exactly as a dynamic loss scale does, and stops
            `fit` with an error naming the layers that overflowed most once
            `max_consecutive_skips` (2) steps in a row were skipped. None
            turns it on for models that use an FP8 recipe (this `fp8`, or
            layers whose policy has one) and off otherwise; True or False
            decide for every model. A policy with a loss scale gets its
            `LossScaleOptimizer` as before (a dynamic scale always skips;
            with True a fixed one does too); an optimizer that is or wraps
            a `LossScaleOptimizer` is never wrapped again. Defaults to None.

    Example:

    >>> keras_mp.set_global_policy("mixed_bfloat16")
    >>> keras.layers.Dense(2).compute_dtype
    'bfloat16'
    >>> keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
    >>> keras.layers.Softmax().compute_dtype
    'float32'
    >>> keras_mp.set_global_policy("mixed_bfloat16", fp8=True)
    >>> layer = keras.layers.Dense(32)
    >>> layer.build((None, 64))
    >>> layer.dtype_policy.fp8.granularity
    'tensorwise'
    >>> keras_mp.set_global_policy(None)
    """
    if skip_nonfinite is not None and not isinstance(skip_nonfinite, bool):
        raise TypeError(
            "`skip_nonfinite` must be True, False or None (on under an FP8 "
            f"recipe). Received: skip_nonfinite={skip_nonfinite!r} (of type "
            f"{type(skip_nonfinite).__name__}). Pass e.g. "
            "skip_nonfinite=True."
        )
    if policy is not None:
        policy = policy_module._checked(policy)
    if float32_islands is not None:
        float32_islands = resolve_rules(float32_islands, "float32_islands")
    # A float policy (`_checked`), so FP8 GEMMs always have a float
    # compute dtype around them.
    fp8 = recipe_module.get(fp8)
    _set_global_policy_unchecked(policy, float32_islands, fp8, skip_nonfinite)


def global_skip_nonfinite():
    """The `skip_nonfinite` of the last `set_global_policy`: True, False or
    None (decided per model by `compile`)."""
    return _settings.skip_nonfinite


def _set_from_keras(policy, keras_setter):
    # `keras.config.set_dtype_policy(policy)`: Keras accepts names that are
    # not keras_mp policies (quantized ones), which stay Keras's alone.
    try:
        converted = policy_module._to_policy(policy)
    except (TypeError, ValueError):
        keras_setter(policy)
        return
    policy_module._check_no_fp8(converted)
    _set_global_policy_unchecked(
        converted, session=_keras_internals.keras_session()
    )


_keras_internals.install_global_policy_setter(_set_from_keras)


def _set_global_policy_unchecked(
    policy, float32_islands=None, fp8=None, skip_nonfinite=None, session=None
):
    global _settings
    with _global_policy_lock:
        _settings = _GlobalSettings(
            policy,
            float32_islands,
            fp8,
            skip_nonfinite,
            None if policy is None else session,
        )
        # Cleared rather than set: a policy cached in this thread's Keras state
        # would outlive a later set_global_policy made from another thread.
        _keras_internals.set_keras_thread_policy(None)


@contextlib.contextmanager
def policy_scope(
    policy: Policy | keras.DTypePolicy | str | None,
    float32_islands: Any = None,
    fp8: recipe_module.Recipe | bool | None = None,
) -> Iterator[None]:
    """Context manager that sets the policy for this thread, then restores it.

    The scope is a `set_global_policy` for this thread alone: the scoped
    policy, float32 islands and FP8 recipe are seen only by the thread
    that opened the scope (by `global_policy()` and by layers created
    there); other threads keep seeing the global ones, and on exit this
    thread sees again whatever the scope replaced, even when the block
    raised or set the global policy. Like `set_global_policy(policy)`, a
    scope without `float32_islands` or `fp8` has none inside.

    Args:
        policy: Anything `set_global_policy` takes; None scopes the
            `keras.config.floatx()` default.
        float32_islands: Precision rules, as `set_global_policy` takes
            them. Defaults to None.
        fp8: A `keras_mp.fp8.Recipe`, `True` or None, as
            `set_global_policy` takes it. Defaults to None.

    Example:

    >>> with keras_mp.policy_scope("mixed_bfloat16"):
    ...     keras_mp.global_policy().name
    'mixed_bfloat16'
    >>> keras_mp.global_policy().name
    'float32'
    >>> with keras_mp.policy_scope("mixed_bfloat16", fp8=True):
    ...     layer = keras.layers.Dense(32)
    ...     layer.build((None, 64))
    >>> layer.dtype_policy.fp8.granularity
    'tensorwise'
    """
    # Every argument checked before anything changes.
    scoped = _FLOATX if policy is None else policy_module._checked(policy)
    if float32_islands is not None:
        float32_islands = resolve_rules(float32_islands, "float32_islands")
    fp8 = recipe_module.get(fp8)
    previous = getattr(_scopes, "policy", None)
    previous_settings = getattr(_scopes, "settings", None)
    previous_keras = _keras_internals.keras_thread_policy()
    _scopes.policy = scoped
    _scopes.settings = (float32_islands, fp8)
    _keras_internals.set_keras_thread_policy(None)
    try:
        yield
    finally:
        _scopes.policy = previous
        _scopes.settings = previous_settings
        _keras_internals.set_keras_thread_policy(previous_keras)


def global_float32_islands():
    """The float32 islands (a `PrecisionRules`) that layers created now
    without a `dtype` follow, or None: this thread's `policy_scope`'s, else
    the last `set_global_policy`'s."""
    settings = getattr(_scopes, "settings", None)
    return _settings.float32_islands if settings is None else settings[0]


def global_fp8():
    """The FP8 recipe that `fp8.DEFAULT_RULES` give layers created now
    without a `dtype`, or None: this thread's `policy_scope`'s, else the
    last `set_global_policy`'s."""
    settings = getattr(_scopes, "settings", None)
    return _settings.fp8 if settings is None else settings[1]

"""Dtype policies with a loss scale, and the process-global policy."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import keras

from keras_mp import _keras_internals
from keras_mp import loss_scale as loss_scale_module
from keras_mp import policy_names
from keras_mp._fp8 import recipe as recipe_module


@keras.saving.register_keras_serializable(package="keras_mp")
class Policy(keras.DTypePolicy):
    """A dtype policy that also says how to scale the loss.

    A `Policy` is a `keras.DTypePolicy`, so any Keras layer accepts it as
    `dtype=`. Besides the compute and variable dtypes it carries the loss scale
    that `Model.compile` gives the optimizer: float16 has only 5 exponent bits,
    so small gradients flush to zero unless the loss is scaled up first.
    bfloat16 has float32's exponent range and needs no scaling.

    A third dtype, `output_dtype`, is what the layer returns: a layer whose
    policy says `output=float32` computes in its compute dtype and casts its
    float outputs to float32, so logits or probabilities leave a 16-bit layer
    at full precision. jmp-style specs set it; names keep it equal to the
    compute dtype.

    Args:
        name: `"mixed_float16"` (float16 compute, float32 variables),
            `"mixed_bfloat16"` (bfloat16 compute, float32 variables), the
            name of a dtype used for all three, or a jmp-style spec
            `"params=float32,compute=bfloat16,output=float32"`. A spec's keys
            may be shortened to `p`/`c`/`o` and left out (params defaults to
            float32, compute follows params, output follows compute); its
            dtypes may be written `f32`/`full`, `bf16`, `f16`, `f64`, or
            `half` (bfloat16 on TPU, float16 elsewhere, as in jmp: it looks
            at the devices, so it initializes the backend runtime). The
            policy's `name` is the shortest equivalent: `"p=f32,c=bf16"` is
            named `"mixed_bfloat16"`.
        loss_scale: `"auto"` gives a `DynamicLossScale()` when float16
            compute meets float32 variables (`"mixed_float16"`, or a spec
            saying so) and None otherwise. Also takes None,
            `"dynamic"`, a number (a `FixedLossScale`), a `LossScale` or a
            loss scale config dict. Defaults to `"auto"`.
        fp8: The `keras_mp.fp8.Recipe` by which a `Dense` or `EinsumDense`
            layer with this policy computes its GEMM (its matrix product)
            in FP8, `True` for `keras_mp.fp8.DEFAULT_RECIPE`, or None.
            Only the GEMM changes: the layer's bias, activation and
            output stay in the compute dtype, its kernel in the variable
            dtype (the GEMM quantizes the stored kernel, not a 16-bit copy
            of it). A `"float32"` policy with a recipe is allowed: FP8
            GEMMs, float32 everywhere else. Other layers have no GEMM and
            refuse such a policy. This is not Keras's `"float8"`
            quantization mode: `quantization_mode` stays None. Defaults to
            None.

    Example:

    >>> policy = keras_mp.Policy("mixed_float16")
    >>> policy.compute_dtype, policy.variable_dtype
    ('float16', 'float32')
    >>> type(policy.loss_scale).__name__
    'DynamicLossScale'
    >>> keras_mp.Policy("mixed_bfloat16").loss_scale is None
    True
    >>> policy = keras_mp.Policy("p=f32,c=bf16,o=f32")
    >>> policy.name
    'params=float32,compute=bfloat16,output=float32'
    >>> policy.variable_dtype, policy.compute_dtype, policy.output_dtype
    ('float32', 'bfloat16', 'float32')
    >>> policy = keras_mp.Policy("mixed_bfloat16", fp8=True)
    >>> policy.fp8 == keras_mp.fp8.DEFAULT_RECIPE, policy.quantization_mode
    (True, None)
    """

    def __init__(
        self,
        name: str,
        loss_scale: loss_scale_module.LossScaleLike = "auto",
        fp8: recipe_module.Recipe | bool | None = None,
    ) -> None:
        if not isinstance(name, str):
            raise TypeError(
                f"`name` must be a string: {policy_names.VALID_NAMES_TEXT}. "
                f"Received: name={name!r} (of type {type(name).__name__})"
            )
        if name.startswith(_keras_internals.QUANTIZATION_MODES):
            raise ValueError(
                f"keras_mp.Policy takes {policy_names.VALID_NAMES_TEXT}. Received: "
                f"name={name!r}, a quantized policy; use "
                "`keras.dtype_policies.get(name)` for quantization."
            )
        if "=" in name or name in policy_names.SPEC_DTYPES:
            dtypes = policy_names.parse_spec(name)
        else:
            try:
                keras_policy = keras.DTypePolicy(name)
            except ValueError:
                raise ValueError(
                    f"Unknown policy name. Expected {policy_names.VALID_NAMES_TEXT}. "
                    f"Received: name={name!r}"
                ) from None
            compute = keras_policy.compute_dtype
            dtypes = keras_policy.variable_dtype, compute, compute
        self._variable, self._compute, self._output = dtypes
        super().__init__(policy_names.canonical_name(*dtypes))
        if loss_scale == "auto":
            loss_scale = (
                "dynamic"
                if (self._compute, self._variable) == ("float16", "float32")
                else None
            )
        self._loss_scale = loss_scale_module.get(loss_scale)
        self._fp8 = recipe_module.get(fp8)
        if self._fp8 is not None and not keras.backend.is_float_dtype(
            self._compute
        ):
            raise ValueError(
                "An FP8 recipe needs a float compute dtype, such as "
                f"'mixed_bfloat16'. Received: name={name!r}, fp8={fp8!r}. "
                "Leave `fp8` None for this policy."
            )

    def _parse_name(self, name):
        # Called by `keras.DTypePolicy.__init__` with the canonical name,
        # which a spec can only be parsed into by this class.
        return self._compute, self._variable

    @property
    def output_dtype(self) -> str:
        """The dtype a layer with this policy casts its float outputs to.

        Equal to `compute_dtype` unless a spec says otherwise.
        """
        return self._output

    @property
    def loss_scale(self) -> loss_scale_module.LossScale | None:
        """The `LossScale` that `compile` copies for the optimizer, or None."""
        return self._loss_scale

    @property
    def fp8(self) -> recipe_module.Recipe | None:
        """The `keras_mp.fp8.Recipe` of the layer's GEMM, or None."""
        return self._fp8

    def get_config(self) -> dict[str, Any]:
        """Every constructor argument, as `from_config` takes it.

        `fp8` (the recipe's config) is present only when set, as Keras
        writes `lora_rank` only when set: a policy without a recipe keeps
        the config it had before FP8 existed.
        """
        loss_scale = None
        if self._loss_scale is not None:
            loss_scale = keras.saving.serialize_keras_object(self._loss_scale)
        config = {"name": self.name, "loss_scale": loss_scale}
        if self._fp8 is not None:
            config["fp8"] = self._fp8.get_config()
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Policy:
        if not isinstance(config, dict) or "name" not in config:
            raise ValueError(
                "A Policy config is a dict with a 'name' key and optional "
                f"'loss_scale' and 'fp8' keys. Received: config={config!r}"
            )
        unknown = set(config) - {"name", "loss_scale", "fp8"}
        if unknown:
            raise ValueError(
                "A Policy config takes only 'name', 'loss_scale' and 'fp8'. "
                f"Received unknown keys: {sorted(unknown)}"
            )
        return cls(
            config["name"],
            loss_scale=config.get("loss_scale", "auto"),
            fp8=config.get("fp8"),
        )

    def __eq__(self, other):
        if type(other) in _KERAS_FLOAT_POLICIES:
            # Keras's float policy of a name means what `Policy(name)` does
            # (`compile` scales the loss under "mixed_float16" in both), and
            # `keras.config.set_dtype_policy(keras.DTypePolicy(name))` gives
            # `Policy(name)`: equal, from either side (Python asks the
            # subclass first).
            try:
                other = Policy(other.name)
            except ValueError:
                return False
        if type(other) is not type(self) or self.name != other.name:
            return False
        if self._fp8 != other._fp8:
            return False
        if self._loss_scale is None or other._loss_scale is None:
            return self._loss_scale is other._loss_scale
        return type(self._loss_scale) is type(other._loss_scale) and (
            self._loss_scale.get_config() == other._loss_scale.get_config()
        )

    __hash__ = None

    def __repr__(self):
        fp8 = "" if self._fp8 is None else f", fp8={self._fp8!r}"
        return f'<Policy "{self.name}", loss_scale={self._loss_scale!r}{fp8}>'


# Keras's plain float policy classes (`FloatDTypePolicy` is Keras's older
# name of `DTypePolicy`), not its quantized ones.
_KERAS_FLOAT_POLICIES = tuple(
    {keras.DTypePolicy, keras.dtype_policies.FloatDTypePolicy}
)

# Process-global, not thread-local: a layer built in a worker thread (a data
# pipeline, a model server) must see the policy the main thread set. Only a
# `policy_scope` is per thread.
_global_policy = None
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
    if (
        _global_policy_session is not None
        and _global_policy_session is not _keras_internals.keras_session()
    ):
        # Set with Keras's own setter, which `clear_session` undoes in
        # Keras: so it does here.
        _set_global_policy_unchecked(None)
    return _global_policy


def layer_policy(layer):
    """The policy that applies to `layer`: its entry if it has a policy map."""
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return policy[layer.path] if layer.path else policy.default_policy
    return policy


def _cast_outputs(operation, outputs):
    if not isinstance(operation, keras.layers.Layer):
        return outputs
    policy = layer_policy(operation)
    if not isinstance(policy, Policy) or policy.output_dtype == (
        policy.compute_dtype
    ):
        return outputs
    dtype = policy.output_dtype

    def cast(x):
        symbolic = isinstance(x, keras.KerasTensor)
        if not (symbolic or keras.ops.is_tensor(x)):
            return x
        if not keras.backend.is_float_dtype(x.dtype):
            return x
        if keras.backend.standardize_dtype(x.dtype) == dtype:
            return x
        if symbolic:
            # A new symbolic tensor, not `ops.cast`: that would record a
            # Cast node of its own in the functional graph.
            return keras.KerasTensor(
                x.shape, dtype=dtype, sparse=x.sparse, ragged=x.ragged
            )
        return keras.ops.cast(x, dtype)

    return keras.tree.map_structure(cast, outputs)


_keras_internals.install_call_hook("output_dtype", _cast_outputs)
_keras_internals.install_policy_serialization(
    lambda policy: isinstance(policy, Policy),
    note_key="keras_mp",
    note="This model was saved with keras_mp: `import keras_mp` before "
    "loading it.",
)
_keras_internals.install_global_policy_lookup(_process_policy)
_keras_internals.install_policy_deserialization(
    lambda policy: isinstance(policy, Policy)
)


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


def _to_policy(policy):
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return Policy(policy)
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        # Kept whole: Keras layers look their own path up in the map.
        _to_policy(policy.default_policy)
        return policy
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
        "'mixed_float16', a keras.DTypePolicy, a "
        "keras.dtype_policies.DTypePolicyMap or None. "
        f"Received: policy={policy!r} (of type {type(policy).__name__})"
    )


def _check_no_fp8(policy):
    default = getattr(policy, "default_policy", policy)
    if getattr(default, "fp8", None) is not None:
        raise ValueError(
            "A global or scoped policy cannot carry an FP8 recipe: every "
            "layer would take it, including those without a GEMM. Received: "
            f"policy={policy!r}. Give the recipe on its own, "
            f"`keras_mp.set_global_policy({default.name!r}, fp8=recipe)`, "
            "which gives it to the Dense and EinsumDense layers that "
            "`keras_mp.fp8.DEFAULT_RULES` select, or to chosen layers with "
            "`keras_mp.precision_rules`."
        )


def _checked(policy):
    """`policy` as a keras_mp Policy (or DTypePolicyMap), validated."""
    policy = _to_policy(policy)
    _check_no_fp8(policy)
    default = getattr(policy, "default_policy", policy)
    if not keras.backend.is_float_dtype(default.compute_dtype):
        raise ValueError(
            "The global policy must be a floating-point policy, such as "
            f"'mixed_float16' or 'float32'. Received: policy={policy!r}. "
            "Give integer dtypes to individual layers with `dtype=`."
        )
    if default.name in ("float16", "bfloat16"):
        warnings.warn(
            f"The global policy {default.name!r} keeps the variables in "
            f"{default.name} too, so small weight updates round away and "
            "training often stalls. Use "
            f"'mixed_{default.name}' instead: {default.name} compute with "
            "float32 variables; or, to keep 16-bit variables, an optimizer "
            "with float32 master copies: `keras_mp.OptimizerWrapper("
            "optimizer, master_weights=True)`.",
            UserWarning,
            stacklevel=3,
        )
    return policy


# The float32 islands (a `keras_mp.PrecisionRules`) that layers created
# without a `dtype` follow, or None; and the FP8 recipe that
# `fp8.DEFAULT_RULES` give such layers, or None. Set with the global policy.
_global_float32_islands = None
_global_fp8 = None
# `set_global_policy(..., skip_nonfinite=...)`: True, False, or None (on
# where an FP8 recipe is in use; `models.py` resolves it at `compile`).
_global_skip_nonfinite = None
_islands_resolver = None
# The Keras session (`_keras_internals.keras_session`) in which the global
# policy was set through Keras's own setter (`keras.config.set_dtype_policy`,
# `keras.mixed_precision.set_global_policy`), or None. Keras forgets such a
# policy at `keras.utils.clear_session()`, and keras_mp does the same, so
# that importing keras_mp changes nothing Keras's own code relies on. A
# policy of `keras_mp.set_global_policy` outlives `clear_session`, as
# tf.keras's global policy did: it carries keras_mp's settings (FP8
# recipe, float32 islands, `skip_nonfinite`) that Keras knows nothing of.
_global_policy_session = None


def _install_islands_resolver(resolver):
    # `keras_mp.precision` (above this module) turns "default" into its rules.
    global _islands_resolver
    _islands_resolver = resolver


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
        policy = _checked(policy)
    if float32_islands is not None:
        float32_islands = _islands_resolver(float32_islands)
    # A float policy (`_checked`), so FP8 GEMMs always have a float
    # compute dtype around them.
    fp8 = recipe_module.get(fp8)
    _set_global_policy_unchecked(policy, float32_islands, fp8, skip_nonfinite)


def global_skip_nonfinite():
    """The `skip_nonfinite` of the last `set_global_policy`: True, False or
    None (decided per model by `compile`)."""
    return _global_skip_nonfinite


def _set_from_keras(policy, keras_setter):
    # `keras.config.set_dtype_policy(policy)`: Keras accepts names that are
    # not keras_mp policies (quantized ones), which stay Keras's alone.
    try:
        converted = _to_policy(policy)
    except (TypeError, ValueError):
        keras_setter(policy)
        return
    _check_no_fp8(converted)
    _set_global_policy_unchecked(
        converted, session=_keras_internals.keras_session()
    )


_keras_internals.install_global_policy_setter(_set_from_keras)


def _set_global_policy_unchecked(
    policy, float32_islands=None, fp8=None, skip_nonfinite=None, session=None
):
    global _global_policy, _global_float32_islands, _global_fp8
    global _global_skip_nonfinite, _global_policy_session
    with _global_policy_lock:
        _global_policy = policy
        _global_policy_session = None if policy is None else session
        _global_float32_islands = float32_islands
        _global_fp8 = fp8
        _global_skip_nonfinite = skip_nonfinite
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
    scoped = _FLOATX if policy is None else _checked(policy)
    if float32_islands is not None:
        float32_islands = _islands_resolver(float32_islands)
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
    return _global_float32_islands if settings is None else settings[0]


def global_fp8():
    """The FP8 recipe that `fp8.DEFAULT_RULES` give layers created now
    without a `dtype`, or None: this thread's `policy_scope`'s, else the
    last `set_global_policy`'s."""
    settings = getattr(_scopes, "settings", None)
    return _global_fp8 if settings is None else settings[1]

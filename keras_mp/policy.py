"""Dtype policies with a loss scale and an FP8 recipe: `Policy`, a value."""

from __future__ import annotations

import warnings
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
_keras_internals.install_policy_deserialization(
    lambda policy: isinstance(policy, Policy)
)


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

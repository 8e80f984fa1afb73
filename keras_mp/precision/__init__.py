"""Precision rules: float32 islands in a mixed model, and the FP8 rules.

Mixed precision is a per-layer decision. A few places lose too much in 16
bits: a softmax over many classes, the logits a loss reads. tf.keras left
them to a rule users had to remember ("put `dtype='float32'` on the last
layer"). Here they are declared once, as rules from a layer class or a layer
path pattern to a policy, applied to every model built while they are active,
and `explain_precision` (in `explain.py`) answers "why is this layer
float32?". The FP8 rules of `set_global_policy(..., fp8=recipe)` are
decided here too, with `fp8_layers`, at the same three moments: a layer's
creation, its build and its model's build.

What Keras 3 already does, so no rule is needed for it:

- Normalization statistics: `BatchNormalization`, `LayerNormalization`,
  `GroupNormalization` and `RMSNormalization` upcast their inputs to float32
  to compute mean and variance, keep their gamma/beta/moving statistics in
  float32 (`autocast=False`), and cast the result back to the compute dtype.
  Giving them a float32 policy would only add casts.
- Losses: Keras losses convert predictions to their own `dtype` (float32
  unless set), and `keras_mp.losses` do the same; the loss is a float32
  island already.

The package, one file per concept: `rules.py` (the rules API and what a
rule reads of a model), `global_policy.py` (the global policy with the
float32 islands and FP8 recipe in force: `set_global_policy`,
`policy_scope`), `apply.py` (the hooks that apply the rules to a model's
layers), `record.py` (the decisions saved with a model and restored by
`load_model`). This file re-exports what the rest of keras_mp uses and, at
its end, installs the hooks (once).
"""

from keras_mp import _keras_internals
from keras_mp.precision import apply
from keras_mp.precision import record
from keras_mp.precision.apply import given_dtype
from keras_mp.precision.record import RECORD_KEY
from keras_mp.precision.rules import DEFAULT_FLOAT32_ISLANDS
from keras_mp.precision.rules import PrecisionRules
from keras_mp.precision.rules import check_model
from keras_mp.precision.rules import fitted_policy
from keras_mp.precision.rules import layer_path
from keras_mp.precision.rules import output_layers
from keras_mp.precision.rules import precision_rules
from keras_mp.precision.rules import resolve_rules
from keras_mp.precision.rules import walk_layers

__all__ = [
    "DEFAULT_FLOAT32_ISLANDS",
    "PrecisionRules",
    "RECORD_KEY",
    "check_model",
    "fitted_policy",
    "given_dtype",
    "layer_path",
    "output_layers",
    "precision_rules",
    "resolve_rules",
    "walk_layers",
]

apply._install_layer_init_hook()
_keras_internals.install_functional_init_hook(apply._apply_rules)
_keras_internals.install_call_hook("precision_rules", apply._after_call)
_keras_internals.install_model_serialization(
    RECORD_KEY, record._record, record._restore, apply._deserializing
)

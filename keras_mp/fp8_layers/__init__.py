"""FP8 GEMMs in Keras's `Dense` and `EinsumDense`, and the default FP8 rules
applied to each layer.

`precision/apply.py` calls `decide` when it applies precision rules.

A `Dense` or `EinsumDense` whose policy (its own, or its entry in a
`DTypePolicyMap`) is a `keras_mp.Policy` with an `fp8` recipe computes its
GEMM with `keras_mp.fp8.dot` / `keras_mp.fp8.einsum`, then adds the bias and
applies the activation in the compute dtype as Keras does. Everything else,
Keras's own quantized layers included (Keras routes them to
`quantized_call`, never to `call`), runs Keras's `call` unchanged. The hooks
are installed once, on the classes, when keras_mp is imported.

With LoRA (`layer.enable_lora(rank)`), the FP8 GEMM multiplies the frozen
base kernel and the low-rank path `inputs @ A @ B * alpha / rank` runs in
the compute dtype, added before the bias. Keras saves such a layer's kernel
with `A @ B` merged in (what a layer without LoRA loads); the save hook
also stores W, A and B under their own names, which an FP8 layer with LoRA
reloads as they were (the merged kernel, rounded to FP8, would lose a small
update).

A layer whose recipe has `stats=True` also owns a statistics carrier (see
`keras_mp/_fp8/stats.py`), the `fp8_stats` variable, passed to its GEMM; it
is saved after the layer's other variables.

A layer whose recipe has `scaling="delayed"` owns a carrier of the shape
`keras_mp/_fp8/delayed.py` says, and three non-trainable float32/int32
variables: `fp8_amax_history` `(3, H)`, `fp8_steps` (the steps folded into
it) and `fp8_scale` `(3,)` (the delayed scales of the last call; 0 while
the layer has no history and runs current scaling). Each call first folds
a fresh carrier into the history (`delayed.fold`), then quantizes with the
history's scales. They are saved by name beside Keras's entries.

The package, by concept: `decisions.py` (which layers run FP8),
`state.py` (a layer's carrier, delayed and frozen state), `calls.py` (the
call hooks), `lora.py` (LoRA), `saving.py` (the save and load hooks); this
module re-exports what the rest of keras_mp uses and installs the hooks.
"""

import functools

import keras

from keras_mp import _keras_internals
from keras_mp._fp8 import availability
from keras_mp.backend import devices
from keras_mp.fp8_layers import calls
from keras_mp.fp8_layers import saving
from keras_mp.fp8_layers.decisions import check_layer
from keras_mp.fp8_layers.decisions import consider
from keras_mp.fp8_layers.decisions import considered
from keras_mp.fp8_layers.decisions import decide
from keras_mp.fp8_layers.decisions import describe
from keras_mp.fp8_layers.decisions import has_gemm
from keras_mp.fp8_layers.decisions import layer_recipe
from keras_mp.fp8_layers.decisions import mark_boundaries
from keras_mp.fp8_layers.decisions import with_recipe
from keras_mp.fp8_layers.state import check_model
from keras_mp.fp8_layers.state import delayed_state
from keras_mp.fp8_layers.state import static_state
from keras_mp.fp8_layers.state import sync_stats_carrier

__all__ = [
    "check_layer",
    "check_model",
    "consider",
    "considered",
    "decide",
    "delayed_state",
    "describe",
    "has_gemm",
    "layer_recipe",
    "mark_boundaries",
    "static_state",
    "sync_stats_carrier",
    "with_recipe",
]


def _install_build_hooks():
    for cls in (keras.layers.Dense, keras.layers.EinsumDense):
        original = cls.build
        if getattr(original, "_keras_mp_hook", False):
            continue
        cls.build = _build_hook(original)
        cls.save_own_variables = saving.save_hook(cls.save_own_variables)
        cls.load_own_variables = saving.load_hook(cls.load_own_variables)


def _build_hook(original):
    @functools.wraps(original)
    def build(self, input_shape):
        original(self, input_shape)
        # The GEMM's dimensions (and a map entry's path) are known now.
        decide(self)
        check_layer(self)
        sync_stats_carrier(self)
        recipe = layer_recipe(self)
        if recipe is not None and recipe.formats in availability.BLOCK_SCALED:
            # Said once: MXFP8's and NVFP4's GEMMs need Blackwell.
            devices.check_block_scaled_once(
                availability.BLOCK_SCALED[recipe.formats]
            )

    build._keras_mp_hook = True
    return build


calls.install_call_hooks()
_install_build_hooks()
_keras_internals.install_loading_wrapper(saving.one_migration_warning)

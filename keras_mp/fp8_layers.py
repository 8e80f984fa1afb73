"""FP8 GEMMs in Keras's `Dense` and `EinsumDense`, and the default FP8 rules
applied to each layer.

Imports from keras_mp only `_keras_internals`, `backend`, `fp8`,
`policy`; nothing above its floor (see ARCHITECTURE.md). `precision.py`
calls `decide` when it applies precision rules.

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
`keras_mp/fp8/stats.py`), the `fp8_stats` variable, passed to its GEMM; it
is saved after the layer's other variables.

A layer whose recipe has `scaling="delayed"` owns a carrier of the shape
`keras_mp/fp8/delayed.py` says, and three non-trainable float32/int32
variables: `fp8_amax_history` `(3, H)`, `fp8_steps` (the steps folded into
it) and `fp8_scale` `(3,)` (the delayed scales of the last call; 0 while
the layer has no history and runs current scaling). Each call first folds
a fresh carrier into the history (`delayed.fold`), then quantizes with the
history's scales. They are saved by name beside Keras's entries.
"""

import contextlib
import functools
import threading
import warnings

import keras
import ml_dtypes
import numpy as np

from keras_mp import _keras_internals
from keras_mp import fp8
from keras_mp import policy as policy_module
from keras_mp.backend import fp8 as backend_fp8
from keras_mp.fp8 import delayed as delayed_module
from keras_mp.fp8 import rules as rules_module
from keras_mp.fp8 import stats as stats_module
from keras_mp.policy import Policy

has_gemm = rules_module.has_gemm


def layer_recipe(layer):
    """The FP8 recipe of `layer`'s policy (its map entry), or None."""
    policy = policy_module.layer_policy(layer)
    return policy.fp8 if isinstance(policy, Policy) else None


def with_recipe(policy, recipe):
    """`policy` as a keras_mp `Policy` whose GEMMs follow `recipe`."""
    loss_scale = policy.loss_scale if isinstance(policy, Policy) else "auto"
    return Policy(policy.name, loss_scale=loss_scale, fp8=recipe)


def consider(layer, recipe):
    """Marks a layer created under `set_global_policy(..., fp8=recipe)`.

    The default rules then decide for it (`decide`) when it is created,
    when it builds (its dimensions are known) and when its model is built
    (its output layers are known).
    """
    layer._keras_mp_fp8_rules_recipe = recipe


def decide(layer, is_output=None, ruled=False):
    """Gives a considered layer the default rules' recipe, or takes it back.

    Args:
        layer: A layer `consider` marked; others are left alone.
        is_output: Whether it produces its model's outputs; None keeps
            what the last decision knew. Defaults to None.
        ruled: A precision rule gave the layer its policy, which wins over
            the FP8 rules. Defaults to `False`.
    """
    recipe = getattr(layer, "_keras_mp_fp8_rules_recipe", None)
    if recipe is None:
        return
    if ruled:
        layer._keras_mp_fp8_rules_recipe = None
        layer._keras_mp_fp8_reason = "precision rule"
        return
    if not rules_module.has_gemm(layer):
        return
    if is_output is None:
        is_output = getattr(layer, "_keras_mp_fp8_output", False)
    layer._keras_mp_fp8_output = is_output
    base = entry = layer._keras_mp_global_policy
    if isinstance(base, keras.dtype_policies.DTypePolicyMap):
        if layer.path is None:
            return  # Its entry is known once it builds.
        entry = base[layer.path]
        if isinstance(entry, Policy) and entry.fp8 is not None:
            # The map's own recipe for this path: asked for explicitly.
            layer._keras_mp_fp8_rules_recipe = None
            return
    reason = rules_module.DEFAULT_RULES.skip_reason(layer, recipe, is_output)
    layer._keras_mp_fp8_reason = reason
    target = base if reason else with_recipe(entry, recipe)
    _keras_internals.replace_layer_policy(layer, target)


def describe(layer, policy):
    """The FP8 column of `explain_precision`: the recipe, or why none."""
    recipe = policy.fp8 if isinstance(policy, Policy) else None
    if recipe is not None:
        text = f"{recipe.scaling}/{recipe.granularity}/{recipe.formats}"
        if recipe.scaling == "delayed":
            text += f" history={recipe.amax_history} {recipe.amax_algo}"
        if recipe.margin:
            text += f" margin={recipe.margin}"
        return text + (" +stats" if recipe.stats else "")
    reason = getattr(layer, "_keras_mp_fp8_reason", None)
    if reason is not None:
        return reason
    if isinstance(layer, keras.layers.Embedding):
        return "embedding"
    if not rules_module.has_gemm(layer):
        return "no GEMM"
    return "off"


def considered(layer):
    """Whether the default FP8 rules decided (or will decide) for `layer`."""
    return (
        getattr(layer, "_keras_mp_fp8_rules_recipe", None) is not None
        or getattr(layer, "_keras_mp_fp8_reason", None) is not None
    )


def check_layer(layer):
    """Raises ValueError when `layer`'s policy gives it a recipe it cannot
    take (it has no GEMM; block tiles that its dimensions do not fill)."""
    rules_module.check_layer(layer, layer_recipe(layer))


def check_model(model):
    """`check_layer` for `model` and each of its layers, whose statistics
    carriers then follow their (now decided) recipes."""
    for layer in _keras_internals.all_layers(model):
        check_layer(layer)
        if layer.built:
            sync_stats_carrier(layer)


def sync_stats_carrier(layer):
    """Gives a built FP8 layer the state its recipe asks for, and takes
    from it any it no longer needs: the statistics carrier (see
    `keras_mp/fp8/stats.py`) with `stats=True` or `scaling="delayed"`, and
    the delayed-scaling state (`fp8_amax_history`, `fp8_steps`,
    `fp8_scale`) with `scaling="delayed"`.

    Called when the layer builds and when its model is built, where
    `decide` may take a recipe back (from the model's output layers): a
    layer without an FP8 recipe never keeps FP8 state.
    """
    recipe = layer_recipe(layer)
    usable = recipe is not None and has_gemm(layer)
    delayed = usable and recipe.scaling == "delayed"
    static = usable and recipe.scaling == "static"
    if static and not static_state(layer):
        _make_static(layer)
    wanted = usable and not static and (recipe.stats or delayed)
    shape = delayed_module.CARRIER_SHAPE if delayed else stats_module.SHAPE
    carrier = stats_module.layer_carrier(layer)
    if carrier is not None and tuple(carrier.shape) != shape:
        _keras_internals.untrack_variable(layer, carrier)
        carrier = None
    if wanted and carrier is None:
        # A layer may be given its recipe after it was built (a path rule
        # applied when its model is built).
        carrier = _keras_internals.add_weight_to_built_layer(
            layer,
            name="fp8_stats",
            shape=shape,
            initializer="zeros",
            dtype="float32",
            trainable=True,
            autocast=False,
            overwrite_with_gradient=True,
        )
        carrier._keras_mp_fp8_stats = True
    elif carrier is not None and not wanted:
        _keras_internals.untrack_variable(layer, carrier)
    history = recipe.amax_history if delayed else None
    for name, variable in delayed_state(layer).items():
        wrong = name == "fp8_amax_history" and variable.shape[1] != history
        if not delayed or wrong:
            _keras_internals.untrack_variable(layer, variable)
    if delayed and not delayed_state(layer):
        _add_delayed_state(layer, history)


# The attributes that mark a layer's delayed-scaling and frozen variables.
_DELAYED_TAG = "_keras_mp_fp8_state"
_STATIC_TAG = "_keras_mp_fp8_static"
_STATE_SHAPES = {
    "fp8_amax_history": lambda h: (len(stats_module.TENSORS), h),
    "fp8_steps": lambda h: (),
    "fp8_scale": lambda h: (len(stats_module.TENSORS),),
}


def _add_tagged_state(layer, tag, specs, **kwargs):
    """Adds non-trainable variables `{name: (shape, dtype, initializer)}`
    to a built layer, each tagged with its name under attribute `tag`
    (`_tagged_state` finds them again)."""
    for name, (shape, dtype, initializer) in specs.items():
        variable = _keras_internals.add_weight_to_built_layer(
            layer,
            name=name,
            shape=shape,
            initializer=initializer,
            dtype=dtype,
            trainable=False,
            autocast=False,
            **kwargs,
        )
        setattr(variable, tag, name)


def _tagged_state(layer, tag):
    """`{name: variable}` of `layer`'s own variables tagged under `tag`."""
    own = _keras_internals.own_variables(layer)
    return {
        getattr(v, tag): v for v in own if getattr(v, tag, None) is not None
    }


def _add_delayed_state(layer, history):
    specs = {
        name: (
            shape(history),
            "int32" if name == "fp8_steps" else "float32",
            "zeros",
        )
        for name, shape in _STATE_SHAPES.items()
    }
    # Every replica folds the same carrier into the same state.
    _add_tagged_state(
        layer, _DELAYED_TAG, specs, aggregation="only_first_replica"
    )


def _make_static(layer):
    """Gives a layer the state of a static (frozen) recipe, in place of
    its float kernel: the kernel's FP8 E4M3 codes (uint8 bit patterns),
    the kernel's scale and the input's (assigned by `fp8.freeze` or a
    load)."""
    if layer._kernel is None:
        return
    shape = tuple(layer._kernel.shape)
    _keras_internals.untrack_variable(layer, layer._kernel)
    layer._kernel = None
    specs = {
        "fp8_kernel_codes": (shape, "uint8", "zeros"),
        "fp8_kernel_scale": ((), "float32", "ones"),
        "fp8_input_scale": ((), "float32", "ones"),
    }
    _add_tagged_state(layer, _STATIC_TAG, specs)


def static_state(layer):
    """`{name: variable}` of a frozen layer's codes and scales, or `{}`."""
    return _tagged_state(layer, _STATIC_TAG)


# The float32 value of each E4M3 code, by its bit pattern.
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
_E4M3_VALUES = _E4M3_VALUES.astype(np.float32)


def _static_output(layer, recipe, inputs, training, equation=None):
    """A frozen layer's GEMM: the input quantized with its fixed scale, the
    stored kernel codes with theirs (the same FP8 GEMM `fp8.dot` runs, on
    the same codes). For inference only."""
    if training:
        raise ValueError(
            f"Layer {layer.name!r} was frozen for inference by "
            "`keras_mp.fp8.freeze`: its kernel is stored as FP8 codes and "
            "cannot train. Received: a call with training=True. Train the "
            "model before freezing it, and use the frozen one with "
            "`predict` or `model(x)`."
        )
    state = static_state(layer)
    ops = keras.ops
    codes = ops.cast(_stored(state["fp8_kernel_codes"]), "int32")
    kernel_scale = _stored(state["fp8_kernel_scale"])
    kernel = ops.take(_E4M3_VALUES, codes) * kernel_scale
    scaling = delayed_module.Scaling(
        scales=ops.stack(
            [_stored(state["fp8_input_scale"]), kernel_scale, 1.0]
        ),
        first=ops.convert_to_tensor(False),
        parity=ops.zeros((2,), "float32"),
        loss_scale=ops.convert_to_tensor(1.0, "float32"),
    )
    gemm_recipe = fp8.Recipe(
        scaling="delayed", formats=recipe.formats, margin=recipe.margin
    )
    kwargs = dict(
        recipe=gemm_recipe,
        output_dtype=layer.compute_dtype,
        stats=ops.zeros(delayed_module.CARRIER_SHAPE, "float32"),
        delayed=scaling,
    )
    if equation is None:
        return fp8.dot(inputs, kernel, **kwargs)
    return fp8.einsum(equation, inputs, kernel, **kwargs)


def _calibrate(layer, inputs):
    """Records the amax of a call's inputs while `fp8.freeze` calibrates."""
    amaxes = getattr(layer, "_keras_mp_fp8_calibration", None)
    if amaxes is not None:
        value = backend_fp8.amax(keras.ops.cast(inputs, "float32"), None)
        amaxes.append(float(keras.ops.convert_to_numpy(value).max()))


def delayed_state(layer):
    """`{name: variable}` of `layer`'s delayed-scaling state, or `{}`."""
    return _tagged_state(layer, _DELAYED_TAG)


def _call_recipe(layer):
    """The recipe this call runs with, or None for Keras's own call."""
    recipe = layer_recipe(layer)
    if recipe is None:
        return None
    rules_module.check_layer(layer, recipe)
    return recipe


def _stored(variable):
    # The GEMM quantizes the stored (float32) kernel: rounding it to the
    # compute dtype first would round twice, and its gradient would pass
    # through the compute dtype on the way to a float32 variable. A read
    # (`copy`), not the variable: TensorFlow's custom gradient refuses a
    # function that captures a variable.
    with _keras_internals.without_autocast():
        return keras.ops.copy(variable)


def _stats_input(layer, recipe):
    if not (recipe.stats or recipe.scaling == "delayed"):
        return None
    carrier = stats_module.layer_carrier(layer)
    return None if carrier is None else _stored(carrier)


def _delayed_scaling(layer, recipe, carrier):
    """Folds a fresh carrier into the layer's delayed state and returns
    the `delayed.Scaling` of this call; None for current scaling."""
    if recipe.scaling != "delayed":
        return None
    state = delayed_state(layer)
    if carrier is None or not state:
        raise ValueError(
            f"Layer {layer.name!r} runs delayed FP8 scaling but has no "
            "FP8 state: it was given its recipe after it was built, "
            "outside a model keras_mp saw. Received: fp8="
            f"{recipe!r}. Set the policy before building the layer."
        )
    history, steps = delayed_module.fold(
        _stored(state["fp8_amax_history"]),
        _stored(state["fp8_steps"]),
        carrier,
    )
    scaling = delayed_module.scaling(history, steps, carrier, recipe)
    state["fp8_amax_history"].assign(history)
    state["fp8_steps"].assign(steps)
    state["fp8_scale"].assign(
        keras.ops.where(
            scaling.first, keras.ops.zeros_like(scaling.scales), scaling.scales
        )
    )
    return scaling


def _has_lora(layer):
    return getattr(layer, "lora_enabled", False)


def _kernel(layer):
    """The kernel the FP8 GEMM multiplies: with LoRA, the frozen base
    kernel alone (Keras's `layer.kernel` adds the low-rank product, which
    would then be rounded to FP8 with it and mostly lost). On PyTorch the
    variable's own tensor, not a copy: `fp8.dot` then quantizes it once
    per optimizer step (`keras_mp.backend.fp8.reuse`)."""
    kernel = layer._kernel if _has_lora(layer) else layer.kernel
    with _keras_internals.without_autocast():
        return backend_fp8.stored_variable(kernel)


def _lora(layer, inputs, x, equation=None):
    """`x` plus the LoRA path of `layer`, if it has one: `inputs @ A @ B`
    times `lora_alpha / lora_rank` in the compute dtype (not in FP8: the
    low-rank update is small next to the kernel's FP8 rounding)."""
    if not _has_lora(layer):
        return x
    dtype = layer.compute_dtype
    a = keras.ops.cast(layer.lora_kernel_a, dtype)
    b = keras.ops.cast(layer.lora_kernel_b, dtype)
    if equation is None:
        low_rank = keras.ops.matmul(keras.ops.matmul(inputs, a), b)
    else:
        # The kernel `...l` is `A[..., r] @ B[r, l]`: one three-operand
        # einsum, which contracts the small rank axis first.
        operands, output = equation.split("->")
        x_spec, kernel_spec = operands.split(",")
        rank = next(
            c for c in "rstuvwxyzqponmlkjihgfedcba" if c not in equation
        )
        last = kernel_spec[-1]
        low_rank = keras.ops.einsum(
            f"{x_spec},{kernel_spec[:-1]}{rank},{rank}{last}->{output}",
            inputs,
            a,
            b,
        )
    scale = layer.lora_alpha / layer.lora_rank
    return keras.ops.add(x, keras.ops.multiply(low_rank, scale))


def _bias_and_activation(layer, x):
    if layer.bias is not None:
        x = keras.ops.add(x, layer.bias)
    if layer.activation is not None:
        x = layer.activation(x)
    return x


def _install_call_hooks():
    dense_call = keras.layers.Dense.call
    einsum_call = keras.layers.EinsumDense.call
    if getattr(dense_call, "_keras_mp_hook", False):
        return

    @functools.wraps(dense_call)
    def dense(self, inputs, training=None):
        recipe = _call_recipe(self)
        if recipe is None:
            return dense_call(self, inputs, training=training)
        _calibrate(self, inputs)
        if recipe.scaling == "static":
            x = _static_output(self, recipe, inputs, training)
            return _bias_and_activation(self, x)
        stats = _stats_input(self, recipe)
        x = fp8.dot(
            inputs,
            _kernel(self),
            recipe=recipe,
            output_dtype=self.compute_dtype,
            stats=stats,
            delayed=_delayed_scaling(self, recipe, stats),
        )
        return _bias_and_activation(self, _lora(self, inputs, x))

    @functools.wraps(einsum_call)
    def einsum_dense(self, inputs, training=None):
        recipe = _call_recipe(self)
        if recipe is None:
            return einsum_call(self, inputs, training=training)
        _calibrate(self, inputs)
        if recipe.scaling == "static":
            x = _static_output(self, recipe, inputs, training, self.equation)
            return _bias_and_activation(self, x)
        stats = _stats_input(self, recipe)
        x = fp8.einsum(
            self.equation,
            inputs,
            _kernel(self),
            recipe=recipe,
            output_dtype=self.compute_dtype,
            stats=stats,
            delayed=_delayed_scaling(self, recipe, stats),
        )
        x = _lora(self, inputs, x, self.equation)
        return _bias_and_activation(self, x)

    dense._keras_mp_hook = True
    einsum_dense._keras_mp_hook = True
    keras.layers.Dense.call = dense
    keras.layers.EinsumDense.call = einsum_dense


def _install_build_hooks():
    for cls in (keras.layers.Dense, keras.layers.EinsumDense):
        original = cls.build
        if getattr(original, "_keras_mp_hook", False):
            continue
        cls.build = _build_hook(original)
        cls.save_own_variables = _save_hook(cls.save_own_variables)
        cls.load_own_variables = _load_hook(cls.load_own_variables)


def _build_hook(original):
    @functools.wraps(original)
    def build(self, input_shape):
        original(self, input_shape)
        # The GEMM's dimensions (and a map entry's path) are known now.
        decide(self)
        check_layer(self)
        sync_stats_carrier(self)

    build._keras_mp_hook = True
    return build


# Named entries of an FP8 layer with LoRA, besides Keras's merged kernel.
_LORA_ENTRIES = (
    "fp8_lora_base_kernel",
    "fp8_lora_kernel_a",
    "fp8_lora_kernel_b",
)


def _lora_variables(layer):
    return (layer._kernel, layer.lora_kernel_a, layer.lora_kernel_b)


def _saves_lora(layer):
    return _has_lora(layer) and layer_recipe(layer) is not None


# Dense and EinsumDense save and load their variables by a list of names
# (kernel, bias, quantization state) and check that the file holds as many
# entries as the layer has variables: the carrier goes last.
def _save_hook(original):
    @functools.wraps(original)
    def save_own_variables(self, store):
        static = static_state(self)
        if static:
            # A frozen layer has no float kernel: its bias by index, its
            # codes and scales by name.
            if self.bias is not None:
                store["0"] = self.bias
            for name, variable in static.items():
                store[name] = variable
            return
        original(self, store)
        carrier = stats_module.layer_carrier(self)
        if carrier is not None:
            store[str(len(store.keys()))] = carrier
        for name, variable in delayed_state(self).items():
            store[name] = variable
        if _saves_lora(self):
            # Keras saves `W + A @ B` as the kernel (what a layer without
            # LoRA loads). An FP8 layer with LoRA reloads W, A and B as
            # they were: its GEMM rounds W alone to FP8.
            for name, variable in zip(_LORA_ENTRIES, _lora_variables(self)):
                store[name] = variable

    return save_own_variables


class _StoreView:
    """Some entries of a weights store, as Dense's loader reads it: a file
    saved with or without statistics loads into a layer with or without
    them (a carrier missing from the file keeps its value)."""

    def __init__(self, store, keys):
        self._store = store
        self._keys = list(keys)

    def keys(self):
        return list(self._keys)

    def __len__(self):
        return len(self._keys)

    def __getitem__(self, key):
        return self._store[key]


def _load_hook(original):
    @functools.wraps(original)
    def load_own_variables(self, store):
        names = set(store.keys())
        static = static_state(self)
        if static:
            _load_static(self, store, names, static)
            return
        entries = [name for name in _LORA_ENTRIES if name in names]
        named = set(_LORA_ENTRIES) | set(_STATE_SHAPES)
        full = store
        if names & named:
            # Keras's loader counts the entries: it sees the others only.
            store = _StoreView(store, sorted(names - named, key=int))
        _load_carrier(self, store, original)
        _load_delayed_state(self, full, names)
        if entries and _saves_lora(self):
            # Read only here: a layer without LoRA keeps the merged kernel.
            lora = [full[name] for name in entries]
            variables = _lora_variables(self)
            shapes = [tuple(v.shape) for v in variables]
            if [tuple(value.shape) for value in lora] == shapes:
                for variable, value in zip(variables, lora):
                    variable.assign(value)

    return load_own_variables


def _load_carrier(layer, store, original):
    """Dense's loader, around the statistics carrier the file or the layer
    may have."""
    carrier = stats_module.layer_carrier(layer)
    keys = [str(i) for i in range(len(store.keys()))]
    own = len(_keras_internals.own_variables(layer))
    if _has_lora(layer):
        own -= 2  # Keras saves the merged kernel, not A and B
    own -= len(delayed_state(layer))  # saved by name
    last = keys[-1] if keys else None
    saved = last is not None and tuple(getattr(store[last], "shape", ())) in (
        stats_module.SHAPE,
        delayed_module.CARRIER_SHAPE,
    )
    # Keras's check counts the layer's variables, the state saved by name
    # among them (never read: Dense reads its own entries by index).
    state = list(delayed_state(layer))

    def load(view):
        original(layer, _StoreView(store, [*view, *state]))

    if carrier is not None and saved and len(keys) == own:
        load(keys)
        carrier.assign(_carrier_value(store[last], tuple(carrier.shape)))
    elif carrier is not None and len(keys) == own - 1:
        load([*keys, "fp8_stats"])
    elif carrier is None and saved and len(keys) == own + 1:
        load(keys[:-1])
    else:
        load(keys)


def _load_static(layer, store, names, static):
    if not set(static) <= names:
        raise ValueError(
            f"Layer {layer.name!r} is frozen (`keras_mp.fp8.freeze`) and "
            "loads FP8 kernel codes and scales, which this file does not "
            f"hold for it. Received entries: {sorted(names)}. Load the "
            "file into the model before freezing it, then call "
            "`keras_mp.fp8.freeze` again."
        )
    values = {name: store[name] for name in static}
    if layer.bias is not None:
        values["bias"] = store["0"]
    for name, variable in static.items():
        variable.assign(values[name])
    if layer.bias is not None:
        layer.bias.assign(values["bias"])


def _carrier_value(value, shape):
    """A saved carrier as the layer's: the statistics columns, and the
    delayed columns where both have them (zeros, a carrier not to fold,
    where the file has none)."""
    value = keras.ops.convert_to_numpy(value)
    width = min(value.shape[1], shape[1])
    result = np.zeros(shape, "float32")
    result[:, :width] = value[:, :width]
    return result


def _load_delayed_state(layer, store, names):
    """Restores the delayed state saved by name; a history of another
    length keeps its newest entries, or is padded with zeros (older
    steps that never were). A file without it leaves the layer to seed
    its state at its first step; a layer without it ignores the file's.
    Each such case is noted for the one warning of the load."""
    state = delayed_state(layer)
    saved = set(_STATE_SHAPES) <= names
    path = layer.path or layer.name
    if not state:
        if saved:
            _note_migration("ignored", path)
        return
    if not saved:
        _note_migration("seeded", path)
        return
    values = {name: keras.ops.convert_to_numpy(store[name]) for name in state}
    history = values["fp8_amax_history"]
    length = state["fp8_amax_history"].shape[1]
    if history.shape[1] != length:
        _note_migration("resized", f"{path} ({history.shape[1]} -> {length})")
    padded = np.zeros((history.shape[0], length), "float32")
    kept = min(length, history.shape[1])
    padded[:, :kept] = history[:, :kept]
    values["fp8_amax_history"] = padded
    for name, variable in state.items():
        variable.assign(values[name])


_MIGRATIONS = {
    "seeded": (
        "have delayed FP8 scaling but the file has no state for them: "
        "they run current scaling at their first step and start their "
        "histories there"
    ),
    "ignored": (
        "have no delayed FP8 scaling and ignored the file's state for them"
    ),
    "resized": (
        "have an amax history of another length than the file's: it kept "
        "its newest entries, padded with zeros"
    ),
}
_loading = threading.local()


def _note_migration(kind, where):
    notes = getattr(_loading, "notes", None)
    if notes is None:
        # A layer loaded outside Keras's loaders: its own warning.
        warnings.warn(_migration_message([(kind, where)]), stacklevel=3)
    else:
        notes.append((kind, where))


def _migration_message(notes):
    parts = []
    for kind, text in _MIGRATIONS.items():
        where = [w for k, w in notes if k == kind]
        if where:
            parts.append(f"{len(where)} layer(s) {text}: {', '.join(where)}")
    return (
        "Loaded a checkpoint saved with other FP8 recipes: "
        + "; ".join(parts)
        + ". Nothing else changed. Save again under the new recipes to "
        "silence this."
    )


@contextlib.contextmanager
def _one_migration_warning():
    """Collects the FP8 state migrations of one Keras load and warns once
    at its end, if there were any (nothing when the load fails)."""
    if getattr(_loading, "notes", None) is not None:
        yield  # a load inside a load: the outer one warns
        return
    _loading.notes = []
    try:
        yield
        notes = _loading.notes
    finally:
        _loading.notes = None
    if notes:
        warnings.warn(_migration_message(notes), stacklevel=4)


_install_call_hooks()
_install_build_hooks()
_keras_internals.install_loading_wrapper(_one_migration_warning)

"""An FP8 layer's own state: the statistics carrier of a `stats=True` or
delayed recipe (`sync_stats_carrier`), delayed scaling's history, step
count and scales (`delayed_state`, folded at each call by
`delayed_scaling`), and a frozen layer's codes and scales
(`static_state`); `check_model` checks a model's layers and syncs their
state with their decided recipes.
"""

import keras

from keras_mp import _keras_internals
from keras_mp._fp8 import delayed as delayed_module
from keras_mp._fp8 import quantizers
from keras_mp._fp8 import stats as stats_module
from keras_mp._fp8.einsum import kernel_matrix
from keras_mp.backend.torch import ops as torch_ops
from keras_mp.fp8_layers.decisions import check_layer
from keras_mp.fp8_layers.decisions import has_gemm
from keras_mp.fp8_layers.decisions import layer_recipe


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
    `keras_mp/_fp8/stats.py`) with `stats=True` or `scaling="delayed"`, and
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
        _make_static(layer, recipe)
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
STATE_SHAPES = {
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
        for name, shape in STATE_SHAPES.items()
    }
    # Every replica folds the same carrier into the same state.
    _add_tagged_state(
        layer, _DELAYED_TAG, specs, aggregation="only_first_replica"
    )


def _make_static(layer, recipe):
    """Gives a layer the state of a static (frozen) recipe in place of its
    float kernel: what the recipe's quantizer stores of a frozen kernel
    (`Quantizer.frozen_variables`: E4M3 codes as uint8 bit patterns and
    their scales; for tensorwise recipes also the input's scale), in the
    kernel's shape or its GEMM's `[K, N]` (`frozen_layout`), assigned by
    `fp8.freeze` or a load."""
    if layer._kernel is None:
        return
    quantizer = quantizers.get(recipe)
    shape = tuple(layer._kernel.shape)
    stored_shape = shape
    if quantizer.frozen_layout == "matrix":
        stored_shape = kernel_matrix_shape(layer, shape)
    specs = quantizer.frozen_variables(stored_shape)
    layer._keras_mp_fp8_kernel_shape = shape
    _keras_internals.untrack_variable(layer, layer._kernel)
    layer._kernel = None
    _add_tagged_state(layer, _STATIC_TAG, specs)


def kernel_matrix_shape(layer, shape):
    """`(K, N)`: the kernel of `shape` as its layer's GEMM multiplies it."""
    if isinstance(layer, keras.layers.EinsumDense):
        _, k, n = kernel_matrix(layer.equation, shape)
        return k, n
    return shape[0], shape[-1]


def static_state(layer):
    """`{name: variable}` of a frozen layer's codes and scales, or `{}`."""
    return _tagged_state(layer, _STATIC_TAG)


def delayed_state(layer):
    """`{name: variable}` of `layer`'s delayed-scaling state, or `{}`."""
    return _tagged_state(layer, _DELAYED_TAG)


def stored(variable):
    # The GEMM quantizes the stored (float32) kernel: rounding it to the
    # compute dtype first would round twice, and its gradient would pass
    # through the compute dtype on the way to a float32 variable. A read
    # (`copy`), not the variable: TensorFlow's custom gradient refuses a
    # function that captures a variable.
    with _keras_internals.without_autocast():
        return keras.ops.copy(variable)


def stats_input(layer, recipe):
    if not (recipe.stats or recipe.scaling == "delayed"):
        return None
    carrier = stats_module.layer_carrier(layer)
    if carrier is None:
        return None
    # PyTorch's eager step takes the variable's tensor itself (its gradient
    # reaches it all the same): no copy of it each call.
    value = torch_ops.variable_tensor(carrier)
    return stored(carrier) if value is None else value


def delayed_scaling(layer, recipe, carrier):
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
    if (
        torch_ops.has_bit_ops(carrier)
        and not _keras_internals.in_stateless_scope()
    ):
        return _torch_delayed_scaling(recipe, carrier, state)
    history, steps = delayed_module.fold(
        stored(state["fp8_amax_history"]),
        stored(state["fp8_steps"]),
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


# What the host knows of a delayed layer's fold count on PyTorch, kept on
# its `fp8_steps` variable: `(folded, tensors)`, whether the count was
# above 0 after the fold that wrote it last, and `tensors`, the carrier's
# and the count's values and versions then (`_versions`).
_HOST_FOLDS = "_keras_mp_host_folds"


def _versions(carrier, steps):
    return (carrier, carrier._version, steps, steps._version)


def _still(known, now):
    """Whether what the host knew, `known`, still holds at `now`
    (`_versions`): nothing but the fold wrote the count since, which only
    counts up; and for a count of 0, the carrier is the same."""
    if known is None:
        return False
    folded, then = known
    if then[2] is not now[2] or then[3] != now[3]:
        return False
    return folded or (then[0] is now[0] and then[1] == now[1])


def _torch_delayed_scaling(recipe, carrier, state):
    """`delayed_scaling` on PyTorch's eager step, bit for bit, `carrier`
    being the carrier variable's own tensor (`stats_input`): the state
    read and written in place (Keras's `assign` and `copy` convert each
    tensor again; on CUDA the fold's Triton kernel writes it), and the
    call's `Scaling.first` a Python False once the layer has folded a
    carrier, so that no call computes current scales only to select them
    away (about twenty ops a call; `tensorwise.py`).

    The host learns that the count is above 0 by reading it (`bool`), at
    most once per carrier the optimizer assigns, until it is: the first
    two training steps, and the first call after a load or an assignment
    of the count. Then torch's version counters say that only the fold
    wrote the count since, and the fold only counts up (a write through
    `.data` escapes them; Keras's and keras_mp's never write so)."""
    import torch

    history = state["fp8_amax_history"].value
    steps = state["fp8_steps"].value
    stored_scales = state["fp8_scale"].value
    known = getattr(state["fp8_steps"], _HOST_FOLDS, None)
    unchanged = _still(known, _versions(carrier, steps))
    history, folds, scaling, written = delayed_module.fold_and_scaling(
        history,
        steps,
        carrier,
        recipe,
        first=False if unchanged and known[0] else None,
        state=(history, steps, stored_scales),
    )
    folded = known[0] if unchanged else bool(folds > 0)
    scales = scaling.scales
    if folded:
        scaling = scaling._replace(first=False)
    elif not written:
        scales = torch.where(scaling.first, 0.0, scales)
    if not written:
        # torch's operations made new tensors (the Triton kernel wrote the
        # state in place).
        with torch.no_grad():
            state["fp8_amax_history"].value.copy_(history)
            steps.copy_(folds)
            stored_scales.copy_(scales)
    setattr(
        state["fp8_steps"], _HOST_FOLDS, (folded, _versions(carrier, steps))
    )
    return scaling

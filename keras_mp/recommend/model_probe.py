"""The model probe: `recommend_policy(model, x, y)`.

Builds a copy of the user's model under each policy, starts them from the
same weights, checks their losses against float32's over a few training
steps and times their training steps.

Imports the timing engine, the report, `keras_mp.policy`,
`keras_mp.precision.global_policy` and `keras_mp.backend`; nothing from the
matmul probe or `keras_mp.recommend.api`.
"""

import contextlib
import math
import random
import warnings

import keras
import numpy as np

from keras_mp import policy as policy_module
from keras_mp._fp8.recipe import DEFAULT_RECIPE
from keras_mp.backend import devices
from keras_mp.backend import throughput as backend_throughput
from keras_mp.precision import global_policy as global_policy_module
from keras_mp.recommend.report import _FP8
from keras_mp.recommend.report import _POLICIES
from keras_mp.recommend.report import PolicyRecommendation
from keras_mp.recommend.report import _model_reason
from keras_mp.recommend.report import _unsettled_text
from keras_mp.recommend.timing import _choose
from keras_mp.recommend.timing import _choose_fp8
from keras_mp.recommend.timing import _medians
from keras_mp.recommend.timing import _speedups
from keras_mp.recommend.timing import _time_until_stable
from keras_mp.recommend.timing import _units


@contextlib.contextmanager
def _global_state_kept():
    """Restores what building and training copies of a model touch.

    Layers draw their initializer seeds from Python's `random` when none is
    given; the hardware check warns once per process. Neither is the
    caller's business: the caller's next model must be built and checked
    as if this had not run.
    """
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    checked = set(devices._checked_policies)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", "Mixed precision compatibility check"
            )
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        devices._checked_policies.clear()
        devices._checked_policies.update(checked)


def _recommend_from_model(
    model,
    x,
    y,
    *,
    loss,
    optimizer,
    margin,
    budget_seconds,
    loss_tolerance,
    check_steps,
    timer,
):
    source = model if isinstance(model, keras.Model) else None
    details = devices.device_details()
    fp8_skipped = devices.fp8_unsupported_reason(details)
    names = list(_POLICIES) + ([] if fp8_skipped else [_FP8])
    with _global_state_kept():
        models = {}
        for name in names:
            with _building(name):
                built = _build(model, source, _policy_of(name))
                _compile(built, source, loss, optimizer)
            models[name] = built
        for name in names:
            if not models[name].built:
                models[name](x)
            _check_policy_taken(models[name], _policy_of(name), source)
        if _FP8 in models and not _fp8_layers(models[_FP8]):
            fp8_skipped = (
                "no layer of this model takes FP8 under "
                "keras_mp.fp8.DEFAULT_RULES (Dense and EinsumDense layers "
                "whose dimensions are multiples of 16, other than the "
                "output layers)"
            )
            names.remove(_FP8)
            del models[_FP8]
        reference = models["float32"]
        if source is not None and source.built:
            reference = source
        _copy_variables(reference, models)
        losses = {
            name: [
                _train_on_batch(models[name], x, y) for _ in range(check_steps)
            ]
            for name in names
        }
        loss_deltas, unsound = _check_losses(losses, loss_tolerance)
        runners = {name: _steps(models[name], x, y) for name in names}
        first = {
            name: timer(name, 1, lambda name=name: runners[name](1))
            for name in names
        }
        candidates = [name for name in names[1:] if name not in unsound]
        rounds, stable = _time_until_stable(
            runners,
            _units(first, budget_seconds),
            candidates,
            margin,
            budget_seconds,
            timer,
        )
    step_seconds = _medians(rounds, names)
    speedups = _speedups(rounds, names)
    sixteen_bit = [name for name in candidates if name != _FP8]
    chosen = _choose(speedups, margin, sixteen_bit)
    if _FP8 in candidates and _choose_fp8(speedups, margin, sixteen_bit, _FP8):
        chosen = _FP8
    notes = {
        f"mixed_{dtype}": note
        for dtype, note in backend_throughput.dtype_notes(details).items()
    }
    return PolicyRecommendation(
        policy="float32" if chosen is None else _policy_of(chosen),
        throughput={name: 1.0 / s for name, s in step_seconds.items()},
        reason=_model_reason(
            chosen, speedups, margin, unsound, loss_tolerance, fp8_skipped
        )
        + _unsettled_text(stable, rounds, budget_seconds),
        backend=keras.backend.backend(),
        device=devices._describe(details),
        notes=notes,
        kind="model",
        speedups=speedups,
        step_seconds=step_seconds,
        loss_deltas=loss_deltas,
        unsound=unsound,
        rounds=len(rounds),
        stable=stable,
        batch_size=_batch_size(x),
        fp8=DEFAULT_RECIPE if chosen == _FP8 else None,
        fp8_skipped=fp8_skipped,
    )


def _policy_of(name):
    """The policy a candidate builds its model under (FP8 runs its GEMMs
    inside mixed_bfloat16)."""
    return "mixed_bfloat16" if name == _FP8 else name


@contextlib.contextmanager
def _building(name):
    """The policy, and for the FP8 candidate the global recipe, that the
    layers created inside take."""
    with global_policy_module.policy_scope(
        _policy_of(name),
        float32_islands=global_policy_module.global_float32_islands(),
        fp8=DEFAULT_RECIPE if name == _FP8 else None,
    ):
        yield


def _fp8_layers(built):
    """The layers of `built` whose GEMMs run in FP8."""
    layers = list(built._flatten_layers(include_self=False))
    return [
        layer
        for layer in layers
        if getattr(policy_module.layer_policy(layer), "fp8", None) is not None
    ]


def _build(model, source, policy_name):
    """A fresh model under the scoped policy `policy_name`."""
    if source is None:
        built = model()
        if not isinstance(built, keras.Model):
            raise TypeError(
                "`model` must build and return a keras.Model when called "
                f"with no arguments. Received: model={model!r}, which "
                f"returned {built!r} (of type {type(built).__name__})."
            )
        return built
    own = _policy_name(source.dtype_policy)

    def clone_layer(layer):
        config = layer.get_config()
        if (
            not isinstance(layer, keras.layers.InputLayer)
            and _policy_name(layer.dtype_policy) == own
        ):
            # Without a dtype the layer takes the scoped policy.
            config.pop("dtype", None)
        return layer.__class__.from_config(config)

    try:
        return keras.models.clone_model(
            source, clone_function=clone_layer, recursive=True
        )
    except ValueError as error:
        if "only supported for Sequential" not in str(error):
            raise
        raise TypeError(
            "A model instance must be Sequential or functional to be "
            f"rebuilt under each policy; {source.name!r} is a subclassed "
            f"{type(source).__name__}. Pass a function that builds it "
            "instead: `recommend_policy(lambda: MyModel(...), x, y, ...)`."
        ) from None


def _policy_name(policy):
    return getattr(policy, "default_policy", policy).name


def _check_policy_taken(built, policy_name, source):
    compute = policy_module.Policy(policy_name).compute_dtype
    layers = list(built._flatten_layers(include_self=False)) or [built]
    if any(
        keras.backend.standardize_dtype(layer.compute_dtype) == compute
        for layer in layers
        if layer.weights
    ):
        return
    how = (
        "was rebuilt"
        if source is not None
        else "was built by the function given as `model`"
    )
    raise ValueError(
        f"The model {how} under the policy {policy_name!r}, but none of its "
        f"layers with weights computes in {compute}, so the policies cannot "
        "be compared. Received: model layers computing in "
        f"{sorted({str(layer.compute_dtype) for layer in layers})}. Let the "
        "layers take the global policy (no `dtype=` on them), and pass a "
        "function that builds the model for a subclassed one."
    )


def _base_optimizer(optimizer):
    # Loss scaling belongs to the policy: compile adds it under
    # mixed_float16, and float32 must not time it.
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def _fresh_optimizer(spec):
    if isinstance(spec, keras.optimizers.Optimizer):
        spec = _base_optimizer(spec)
        return type(spec).from_config(spec.get_config())
    return keras.optimizers.get(spec)


def _compile(built, source, loss, optimizer):
    compiled_by = source if source is not None else built
    if not getattr(compiled_by, "compiled", False):
        compiled_by = None
    if loss is None and compiled_by is not None:
        loss = compiled_by.loss
    if optimizer is None and compiled_by is not None:
        optimizer = compiled_by.optimizer
    missing = [
        name
        for name, value in (("loss", loss), ("optimizer", optimizer))
        if value is None
    ]
    if missing:
        raise ValueError(
            "Timing training steps needs a loss and an optimizer: compile the "
            f"model first, or pass {' and '.join(f'`{m}=`' for m in missing)}. "
            f"Received: {missing[0]}=None"
        )
    jit_compile = "auto"
    run_eagerly = False
    if compiled_by is not None:
        jit_compile = compiled_by.jit_compile
        run_eagerly = compiled_by.run_eagerly
    built.compile(
        optimizer=_fresh_optimizer(optimizer),
        loss=loss,
        jit_compile=jit_compile,
        run_eagerly=run_eagerly,
    )


def _copy_variables(reference, models):
    values = [keras.ops.convert_to_numpy(v) for v in reference.variables]
    for name, built in models.items():
        if built is reference:
            continue
        variables = built.variables
        shapes = [tuple(v.shape) for v in variables]
        if shapes != [value.shape for value in values]:
            raise ValueError(
                f"The model built under {name!r} has other variables than "
                "under float32, so they cannot start from the same weights. "
                f"Received: shapes {shapes} under {name!r}, "
                f"{[value.shape for value in values]} under float32."
            )
        for variable, value in zip(variables, values):
            variable.assign(value)


def _train_on_batch(built, x, y):
    return float(np.asarray(built.train_on_batch(x, y)).reshape(-1)[0])


def _steps(built, x, y):
    def run(steps):
        for _ in range(steps):
            # train_on_batch returns NumPy values: the step has finished.
            built.train_on_batch(x, y)

    return run


def _check_losses(losses, tolerance):
    reference = losses["float32"]
    if not all(math.isfinite(value) for value in reference):
        raise ValueError(
            "The float32 loss is not finite on this batch, so the 16-bit "
            f"losses have nothing to be checked against. Received: float32 "
            f"losses {reference}. Check the batch and the model's "
            "initialization."
        )
    deltas = {}
    unsound = {}
    for name in [name for name in losses if name != "float32"]:
        worst, worst_step = 0.0, 0
        for step, (value, expected) in enumerate(zip(losses[name], reference)):
            if not math.isfinite(value):
                worst, worst_step = math.inf, step
                break
            delta = abs(value - expected) / max(abs(expected), 1e-12)
            if delta > worst:
                worst, worst_step = delta, step
        deltas[name] = worst
        if math.isinf(worst):
            unsound[name] = f"loss not finite at step {worst_step + 1}"
        elif worst > tolerance:
            unsound[name] = (
                f"loss {100 * worst:.1f}% off float32's at step "
                f"{worst_step + 1} (tolerance {100 * tolerance:g}%)"
            )
    return deltas, unsound


def _batch_size(x):
    first = keras.tree.flatten(x)[0]
    return int(np.shape(first)[0])

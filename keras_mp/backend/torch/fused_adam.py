"""torch's fused Adam/AdamW kernel, skipped on the device by a flag.

For `LossScaleOptimizer(..., skip_on_device=True)` on PyTorch with Keras's
own Adam or AdamW: `torch._fused_adamw_` takes a `found_inf` tensor and
leaves weights and moments untouched when it is 1, so the skip needs no
saved copy of the state and no host read. Its arithmetic differs from
Keras's in one place: Keras divides by `sqrt(v) + epsilon` and multiplies
by `sqrt(1 - beta_2**t)`; torch divides by
`sqrt(v) / sqrt(1 - beta_2**t) + epsilon`, i.e. adds epsilon after the bias
correction. Each update therefore differs from Keras's by a relative
`epsilon * (1 - sqrt(1 - beta_2**t)) / (sqrt(v) + epsilon)` at most, plus
float32 rounding (torch's moments are computed with `lerp`). torch's fused
SGD is never used: torch 2.13 leaves its momentum buffer uninitialised
after a skipped first step.
"""

import keras

from keras_mp.backend.torch import versions


def supports(optimizer, grads, variables):
    """Whether `optimizer.apply(grads, variables)` is one fused Adam call.

    True for Keras's own PyTorch Adam and AdamW (not subclasses) with no
    gradient clipping, EMA or accumulation, float hyperparameters, every
    gradient present, and float32 variables on one device.
    """
    if keras.backend.backend() != "torch":
        return False
    cls = type(optimizer)
    if cls.__name__ not in ("Adam", "AdamW") or not cls.__module__.startswith(
        "keras.src.backend.torch.optimizers."
    ):
        return False
    if (
        optimizer.clipnorm
        or optimizer.clipvalue
        or optimizer.global_clipnorm
        or optimizer.use_ema
        or optimizer.gradient_accumulation_steps
        or optimizer.loss_scale_factor
    ):
        return False
    for name in ("beta_1", "beta_2", "epsilon"):
        if not isinstance(getattr(optimizer, name), (int, float)):
            return False
    if not variables or any(g is None for g in grads):
        return False
    devices = {v.value.device for v in variables}
    return len(devices) == 1 and all(
        keras.backend.standardize_dtype(v.value.dtype) == "float32"
        and keras.backend.standardize_dtype(g.dtype) == "float32"
        for g, v in zip(grads, variables)
    )


def update(optimizer, grads, variables, is_finite):
    """Keras's Adam/AdamW step of `variables` where `is_finite` holds.

    Weights, first and second moments (and AMSGrad's maxima) and
    `iterations` are left bit for bit where the bool scalar tensor
    `is_finite` is False; nothing is read on the host.
    """
    import torch

    device = variables[0].value.device
    found_inf = torch.logical_not(is_finite).to(device, torch.float32)
    learning_rate = keras.ops.convert_to_tensor(
        optimizer._get_current_learning_rate(), "float32"
    ).to(device)
    step = (
        keras.ops.convert_to_tensor(optimizer.iterations, "float32").to(device)
        + 1
    )
    decay = optimizer.weight_decay or 0.0
    groups = {}
    for grad, variable in zip(grads, variables):
        decayed = bool(decay) and optimizer._use_weight_decay(variable)
        groups.setdefault(decayed, []).append((grad, variable))
    for decayed, pairs in groups.items():
        indices = [optimizer._get_variable_index(v) for _, v in pairs]
        maxima = (
            [optimizer._velocity_hats[i].value for i in indices]
            if optimizer.amsgrad
            else []
        )
        torch._fused_adamw_(
            [v.value for _, v in pairs],
            [g for g, _ in pairs],
            [optimizer._momentums[i].value for i in indices],
            [optimizer._velocities[i].value for i in indices],
            maxima,
            [step] * len(pairs),
            lr=learning_rate,
            beta1=float(optimizer.beta_1),
            beta2=float(optimizer.beta_2),
            weight_decay=float(decay) if decayed else 0.0,
            eps=float(optimizer.epsilon),
            amsgrad=bool(optimizer.amsgrad),
            maximize=False,
            found_inf=found_inf,
        )
        # `_fused_adamw_` writes the weights in place without bumping their
        # version counters (torch 2.13), and `versions.reuse` keys a
        # kernel's FP8 codes on them: without the bump the next step's FP8
        # GEMMs would multiply the codes of the weights before this update.
        torch.autograd.graph.increment_version([v.value for _, v in pairs])
        versions.forget_stale([v for _, v in pairs])
    optimizer.iterations.assign_add(
        keras.ops.cast(is_finite, optimizer.iterations.dtype)
    )

"""`recommend_policy`: checks its arguments and runs one of the probes.

Imports the probes and the timing engine (for its wall-clock timer); no
module of `keras_mp.recommend` imports this one but `__init__`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from keras_mp.recommend.matmul_probe import _recommend_from_matmuls
from keras_mp.recommend.model_probe import _recommend_from_model
from keras_mp.recommend.report import PolicyRecommendation
from keras_mp.recommend.timing import _wall_timer


def recommend_policy(
    model: keras.Model | Callable[[], keras.Model] | None = None,
    x: Any = None,
    y: Any = None,
    *,
    loss: Any = None,
    optimizer: Any = None,
    margin: float = 1.25,
    budget_seconds: float = 3.0,
    loss_tolerance: float = 0.05,
    check_steps: int = 3,
    size: int | None = None,
    _timer: Callable[[], float] | None = None,
) -> PolicyRecommendation:
    """Times training under float32, mixed_bfloat16, mixed_float16; picks one.

    Whether mixed precision pays depends on the model as much as on the
    device: a CPU may run bfloat16 matmuls as fast as float32 and the
    convolutions around them ten times slower. So, given a model and a
    batch, this times real compiled training steps (`train_on_batch`) of
    that model under each policy, loss scaling included under
    mixed_float16 (`compile` adds it), and checks that the 16-bit losses
    track the float32 loss. Without a model it times compiled matmuls, the
    bulk of most training steps, as a quick probe of the device.

    Both forms alternate the candidates in rounds (rotating their order)
    and compare each one with float32 timed right next to it, so that load
    from other programs falls on both sides of a ratio; the ratio is the
    median over rounds. Rounds repeat until every comparison the choice
    rests on is clear at 90% confidence (at least 5 rounds) or about
    `budget_seconds` of timing is spent; `stable` says which. A candidate
    clearly below the margin stops being timed.

    With a model, the three policies start from the same weights (the
    model's, or those the function built under float32) and train
    `check_steps` steps on the batch first (the first one compiles). A
    16-bit policy whose loss is not finite, or differs from float32's by
    more than `loss_tolerance` (relative) at any of those steps, is
    excluded as unsound, with the reason in `unsound`.

    The choice is the fastest sound policy that beats float32 by `margin`:

    - `"mixed_bfloat16"` if it does. bfloat16 keeps float32's exponent
      range, so it needs no loss scaling; it is preferred over float16
      unless float16 is faster still by `margin`.
    - `"mixed_float16"` if it beats float32 and bfloat16 by `margin`. In
      the matmul form, only on an NVIDIA GPU of compute capability 7.0 or
      higher: elsewhere the rest of a float16 step runs on slow paths,
      which only the model form measures.
    - `"float32"` otherwise: mixed precision would not be faster here.

    On a device with FP8 tensor cores (NVIDIA GPUs of compute capability
    8.9 or higher), the model form also builds, checks and times the model
    under `set_global_policy("mixed_bfloat16", fp8=True)` (as
    `"mixed_bfloat16+fp8"`). It is chosen only if it beats float32 and the
    fastest sound 16-bit policy by `margin` and its losses track float32's
    within `loss_tolerance`; the result's `policy` is then
    `"mixed_bfloat16"` and its `fp8` the recipe. Elsewhere, or when no
    layer of the model takes FP8 under `keras_mp.fp8.DEFAULT_RULES`, FP8 is
    not timed and `fp8_skipped` (and the table) says why.

    The model form builds a copy of the model per policy and leaves the
    global policy, the model, its weights and its optimizer as it found
    them (Python's and NumPy's global random states too). A model
    *instance* must be Sequential or functional: it is cloned with
    `keras.models.clone_model` under each policy, its layers taking the
    policy except those whose dtype policy differs from the model's (a
    float32 softmax in a mixed model keeps float32), and the weights are
    copied. A layer pinned to float32 in a model built under float32
    cannot be told from the others and computes in 16 bits too; for it,
    and for subclassed models, pass a function that builds the model: it is
    called under each policy. Metrics are left out of the timed steps.

    Args:
        model: None for the matmul probe, a Sequential or functional
            `keras.Model`, or a function of no arguments returning a
            `keras.Model` built from the global policy. Defaults to `None`.
        x: With a model, one batch of inputs, as `train_on_batch` takes
            it. Its batch size is the one timed.
        y: With a model, the batch's targets.
        loss: The loss to train with. Defaults to the loss the model was
            compiled with; required for a model that is not compiled.
        optimizer: The optimizer to train with (copied per policy, from its
            config; a `LossScaleOptimizer` is unwrapped, as compile adds
            loss scaling under mixed_float16 by itself). Defaults to the
            optimizer the model was compiled with; required for a model
            that is not compiled.
        margin: How many times as fast as float32 a 16-bit policy must be
            to be chosen. Defaults to `1.25`.
        budget_seconds: Approximate seconds of timed steps (or matmuls);
            compilation, warm-up and the loss check are not included. At
            least 5 rounds are always taken. Defaults to `3.0`.
        loss_tolerance: With a model, the largest relative difference from
            the float32 loss a 16-bit policy may show over the checked
            steps. Defaults to `0.05`.
        check_steps: With a model, training steps compared with float32
            before timing. Defaults to `3`.
        size: Without a model, the side of the square matrices. Defaults
            to 1024 on CPUs and 4096 on accelerators.

    Returns:
        A `PolicyRecommendation`: `policy` (and `fp8`), `reason`,
        `speedups`, and the
        table behind them (`str()` prints it).

    Example:

    >>> keras.utils.set_random_seed(0)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> x, y = np.ones((8, 4)), np.zeros((8, 2))
    >>> result = keras_mp.recommend_policy(model, x, y, budget_seconds=0.1)
    >>> result.policy in ("float32", "mixed_bfloat16", "mixed_float16")
    True
    >>> sorted(result.step_seconds)
    ['float32', 'mixed_bfloat16', 'mixed_float16']
    >>> probe = keras_mp.recommend_policy(budget_seconds=0.1, size=64)
    >>> sorted(probe.throughput)
    ['bfloat16', 'float16', 'float32']
    """
    if not margin >= 1.0:
        raise ValueError(
            "`margin` must be at least 1: a 16-bit policy is only worth its "
            f"precision loss if it is faster. Received: margin={margin!r}"
        )
    if not budget_seconds > 0:
        raise ValueError(
            "`budget_seconds` must be positive. Received: "
            f"budget_seconds={budget_seconds!r}"
        )
    timer = _wall_timer if _timer is None else _timer
    if model is None:
        given = {"x": x, "y": y, "loss": loss, "optimizer": optimizer}
        given = [name for name, value in given.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} given without a model. Pass the model "
                "too (`recommend_policy(model, x, y)`), or nothing for the "
                f"matmul probe. Received: model=None, {given[0]}=..."
            )
        return _recommend_from_matmuls(margin, budget_seconds, size, timer)
    if not isinstance(model, keras.Model) and (
        not callable(model) or isinstance(model, keras.layers.Layer)
    ):
        raise TypeError(
            "`model` must be a keras.Model (Sequential or functional) or a "
            "function of no arguments that builds one. Received: "
            f"model={model!r} (of type {type(model).__name__}). Wrap a "
            "layer in `keras.Sequential([...])`."
        )
    if size is not None:
        raise ValueError(
            "`size` sets the matmul probe's matrices and has no meaning with "
            f"a model. Received: size={size!r}. Leave it out."
        )
    if not loss_tolerance > 0:
        raise ValueError(
            "`loss_tolerance` must be positive, e.g. 0.05 for 5%. Received: "
            f"loss_tolerance={loss_tolerance!r}"
        )
    if (
        not isinstance(check_steps, int)
        or isinstance(check_steps, bool)
        or check_steps < 1
    ):
        raise ValueError(
            "`check_steps` must be an int of at least 1. Received: "
            f"check_steps={check_steps!r}"
        )
    if x is None:
        raise ValueError(
            "With a model, `x` must be a batch of inputs (and `y` its "
            "targets), as `train_on_batch` takes them. Received: x=None"
        )
    return _recommend_from_model(
        model,
        x,
        y,
        loss=loss,
        optimizer=optimizer,
        margin=margin,
        budget_seconds=budget_seconds,
        loss_tolerance=loss_tolerance,
        check_steps=check_steps,
        timer=timer,
    )

"""recommend_policy: time training steps (or matmuls) per policy, pick one."""

import contextlib
import dataclasses
import functools
import math
import random
import statistics
import time
import warnings

import keras
import numpy as np

from keras_mp import policy as policy_module
from keras_mp.backend import devices
from keras_mp.backend import throughput as backend_throughput

_DTYPES = ("float32", "bfloat16", "float16")
_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
# Enough rounds for a 90% interval around a median (the extreme pair of 5).
_MIN_ROUNDS = 5
_MAX_ROUNDS = 50
_CONFIDENCE = 0.9
# Samples of about budget / 30 seconds: ten rounds of three fit the budget.
_SAMPLES_PER_BUDGET = 30


@dataclasses.dataclass(frozen=True)
class PolicyRecommendation:
    """What `recommend_policy` measured and chose.

    Attributes:
        policy: The policy name to pass to `keras_mp.set_global_policy`:
            `"mixed_float16"`, `"mixed_bfloat16"` or `"float32"`.
            `keras_mp.Policy("mixed_float16")` comes with a dynamic loss
            scale; the other two need none.
        throughput: With `kind="matmul"`, matmul throughput in GFLOP/s by
            dtype name (`"float32"`, `"bfloat16"`, `"float16"`); with
            `kind="model"`, training steps per second by policy name
            (`"float32"`, `"mixed_bfloat16"`, `"mixed_float16"`), from the
            median step time.
        reason: One or two sentences saying why `policy` was chosen.
        backend: The Keras backend that ran the measurements.
        device: The devices they ran on, as `"GPU 'NVIDIA H100'"`.
        notes: By dtype or policy name, how its math really ran where not
            natively in that dtype: `"upcast: ..."` (computed in float32, as
            Keras does for float16 on torch CPUs) or `"emulated: ..."`.
            Empty where every dtype ran natively.
        kind: `"matmul"` (no model given: compiled matmuls were timed) or
            `"model"` (training steps of the given model were timed).
        speedups: By the same keys as `throughput`, how many times as fast
            as float32: the median over rounds of the float32 time divided
            by this one, each pair timed back to back. Load that hits whole
            rounds cancels out of these ratios, not out of the medians of
            `step_seconds`, so the two need not divide exactly.
        step_seconds: With `kind="model"`, the median seconds of one
            training step by policy name. Empty with `kind="matmul"`.
        loss_deltas: With `kind="model"`, by 16-bit policy name, the largest
            relative difference between its loss and float32's over the
            checked steps (`0.01` is 1%; `inf` for a non-finite loss).
        unsound: With `kind="model"`, by policy name, why a policy was
            excluded as numerically unsound. Empty where none was.
        rounds: How many rounds of alternating measurements were taken.
        stable: Whether the measurements settled: every comparison the
            choice rests on was clear at 90% confidence before the budget
            ran out.
        batch_size: With `kind="model"`, the batch size timed.
    """

    policy: str
    throughput: dict
    reason: str
    backend: str
    device: str
    notes: dict = dataclasses.field(default_factory=dict)
    kind: str = "matmul"
    speedups: dict = dataclasses.field(default_factory=dict)
    step_seconds: dict = dataclasses.field(default_factory=dict)
    loss_deltas: dict = dataclasses.field(default_factory=dict)
    unsound: dict = dataclasses.field(default_factory=dict)
    rounds: int = 0
    stable: bool = True
    batch_size: int = None

    def speedup(self, name):
        """How many times as fast as float32 `name` (a dtype or policy) ran."""
        if name in self.speedups:
            return self.speedups[name]
        return self.throughput[name] / self.throughput["float32"]

    def __str__(self):
        settled = "settled" if self.stable else "not settled"
        if self.kind == "model":
            lines = [
                f"Training steps, batch of {self.batch_size} "
                f"({self.backend} on {self.device}; {self.rounds} rounds, "
                f"{settled}):",
                f"  {'policy':>14}  {'median step':>11}  {'speed-up':>8}  "
                "loss vs float32",
            ]
            for name in _POLICIES:
                delta = self.loss_deltas.get(name)
                shown = "-" if delta is None else f"{100 * delta:.2f}%"
                extra = [self.notes.get(name), self.unsound.get(name)]
                if name in self.unsound:
                    extra[1] = f"unsound: {extra[1]}"
                suffix = "".join(f" [{e}]" for e in extra if e)
                lines.append(
                    f"  {name:>14}  {1000 * self.step_seconds[name]:>8.2f} ms"
                    f"  {self.speedup(name):>7.2f}x  {shown:>15}{suffix}"
                )
        else:
            lines = [
                f"Matmul throughput ({self.backend} on {self.device}; "
                f"{self.rounds} rounds, {settled}):"
            ]
            for dtype in _DTYPES:
                note = self.notes.get(dtype)
                lines.append(
                    f"  {dtype:>8}: {self.throughput[dtype]:9.1f} GFLOP/s "
                    f"({self.speedup(dtype):.2f}x float32)"
                    + (f" [{note}]" if note else "")
                )
        lines.append(f"Recommended policy: {self.policy}. {self.reason}")
        return "\n".join(lines)


def recommend_policy(
    model=None,
    x=None,
    y=None,
    *,
    loss=None,
    optimizer=None,
    margin=1.25,
    budget_seconds=3.0,
    loss_tolerance=0.05,
    check_steps=3,
    size=None,
    _timer=None,
):
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
        A `PolicyRecommendation`: `policy`, `reason`, `speedups`, and the
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


# ------------------------------------------------------------ measurement


def _wall_timer(name, units, run):
    """Seconds `run()` takes; `name` and `units` say what it runs."""
    del name, units
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _median_interval(values, confidence=_CONFIDENCE):
    """A distribution-free interval around the median of `values`.

    The order statistics `(x_j, x_{n+1-j})` hold the true median with
    probability `1 - 2 P(Binomial(n, 1/2) < j)`; the narrowest pair with at
    least `confidence` is returned, `(-inf, inf)` when `values` are too few.
    """
    ordered = sorted(values)
    n = len(ordered)
    below, j = 0.0, 0
    while j < n // 2:
        below += math.comb(n, j) / 2.0**n
        if 1.0 - 2.0 * below < confidence:
            break
        j += 1
    if j == 0:
        return -math.inf, math.inf
    return ordered[j - 1], ordered[n - j]


def _ratios(rounds, numerator, denominator):
    """Per round, the time of `numerator` over that of `denominator`."""
    return [
        r[numerator] / r[denominator]
        for r in rounds
        if numerator in r and denominator in r
    ]


def _clear(values, margin):
    """Whether `values` are clearly at least `margin`, or clearly below it."""
    low, high = _median_interval(values)
    return low >= margin or high < margin


def _open_questions(rounds, base, candidates, margin):
    """The comparisons the choice rests on that are not clear yet.

    Each is a pair `(a, b)`: "is b at least `margin` times as fast as a".
    Every candidate is compared with `base`; two candidates that both beat
    it are compared with each other, the later one in preference order
    having to beat the earlier by `margin`.
    """
    questions = []
    winners = []
    for name in candidates:
        speedups = _ratios(rounds, base, name)
        if not _clear(speedups, margin):
            questions.append((base, name))
        if statistics.median(speedups) >= margin:
            winners.append(name)
    for i, first in enumerate(winners):
        for second in winners[i + 1 :]:
            if not _clear(_ratios(rounds, first, second), margin):
                questions.append((first, second))
    return questions


def _time_until_stable(runners, units, candidates, margin, budget, timer):
    """Rounds of alternating samples until the choice is clear.

    Args:
        runners: By name, a function `run(units)` running that many units
            (steps, matmul chains); the first name is the base (float32).
        units: By name, how many units make one sample.
        candidates: The names that can be chosen, in preference order; the
            others are timed for the table only, in the first rounds.
        margin: The speed-up a candidate needs.
        budget: Seconds of timed samples after which no round starts.
        timer: `timer(name, units, run)` runs `run()` and returns seconds.

    Returns:
        `(rounds, stable)`: a list of dicts from name to seconds per unit,
        one per round, and whether every question was answered.
    """
    names = list(runners)
    base = names[0]
    timed = list(names)
    rounds = []
    spent = 0.0
    stable = False
    while len(rounds) < _MAX_ROUNDS:
        # Rotating the order spreads drifts in load over every name alike.
        shift = len(rounds) % len(timed)
        order = timed[shift:] + timed[:shift]
        sample = {}
        for name in order:
            count = units[name]
            seconds = timer(
                name, count, functools.partial(runners[name], count)
            )
            spent += seconds
            # A clock too coarse for a sample must not divide by zero.
            sample[name] = max(seconds, 1e-9) / count
        rounds.append(sample)
        if len(rounds) < _MIN_ROUNDS:
            continue
        open_questions = _open_questions(rounds, base, candidates, margin)
        if not open_questions:
            stable = True
            break
        # Only names with an open question need more samples.
        needed = {name for question in open_questions for name in question}
        timed = [name for name in names if name in needed]
        if spent >= budget:
            break
    return rounds, stable


def _units(first_seconds, budget):
    """Units per sample so that a sample takes about budget / 30 seconds."""
    target = budget / _SAMPLES_PER_BUDGET
    return {
        name: max(1, int(round(target / max(seconds, 1e-9))))
        for name, seconds in first_seconds.items()
    }


def _medians(rounds, names):
    return {
        name: statistics.median(r[name] for r in rounds if name in r)
        for name in names
    }


def _speedups(rounds, names):
    base = names[0]
    return {
        name: statistics.median(_ratios(rounds, base, name)) for name in names
    }


def _choose(speedups, margin, candidates):
    """The chosen name among `candidates` (in preference order), or None.

    A candidate is chosen if it beats the base by `margin` and no later
    candidate beats it by `margin` again.
    """
    chosen = None
    for name in candidates:
        if speedups[name] < margin:
            continue
        if chosen is None or speedups[name] >= margin * speedups[chosen]:
            chosen = name
    return chosen


def _ratios_text(speedups, names):
    return ", ".join(f"{name} {speedups[name]:.2f}x" for name in names)


def _unsettled_text(stable, rounds, budget):
    if stable:
        return ""
    return (
        f" The timings had not settled after {len(rounds)} rounds "
        f"(budget_seconds={budget:g}); a larger budget gives a firmer answer."
    )


# ------------------------------------------------------------ matmul probe


def _recommend_from_matmuls(margin, budget_seconds, size, timer):
    details = devices.device_details()
    on_cpu = all(d["kind"] == "cpu" for d in details)
    if size is None:
        size = 1024 if on_cpu else 4096
    if not isinstance(size, int) or isinstance(size, bool) or size < 16:
        raise ValueError(
            f"`size` must be an int of at least 16. Received: size={size!r}"
        )
    # Accelerators finish one matmul in microseconds: chain several per call
    # so that dispatch overhead does not dominate the timing.
    chain = 2 if on_cpu else 8
    runners = {}
    first = {}
    for dtype in _DTYPES:
        call = backend_throughput.matmul_runner(dtype, size, chain)
        call()  # compiles
        runners[dtype] = _repeat(call)
        first[dtype] = timer(dtype, 1, call)
    float16_capable = (
        devices.compatibility_warning("mixed_float16", details) is None
    )
    candidates = ["bfloat16"] + (["float16"] if float16_capable else [])
    rounds, stable = _time_until_stable(
        runners,
        _units(first, budget_seconds),
        candidates,
        margin,
        budget_seconds,
        timer,
    )
    flops = 2.0 * size**3 * chain
    seconds = _medians(rounds, _DTYPES)
    speedups = _speedups(rounds, _DTYPES)
    chosen = _choose(speedups, margin, candidates)
    reason = _matmul_reason(chosen, speedups, margin, float16_capable)
    return PolicyRecommendation(
        policy="float32" if chosen is None else f"mixed_{chosen}",
        throughput={d: flops / seconds[d] / 1e9 for d in _DTYPES},
        reason=reason + _unsettled_text(stable, rounds, budget_seconds),
        backend=keras.backend.backend(),
        device=devices._describe(details),
        notes=backend_throughput.dtype_notes(details),
        kind="matmul",
        speedups=speedups,
        rounds=len(rounds),
        stable=stable,
    )


def _repeat(call):
    def run(units):
        for _ in range(units):
            call()

    return run


def _matmul_reason(chosen, speedups, margin, float16_capable):
    ratios = (
        f"bfloat16 {speedups['bfloat16']:.2f}x, "
        f"float16 {speedups['float16']:.2f}x float32"
    )
    float16_fast = speedups["float16"] >= margin and speedups[
        "float16"
    ] >= margin * max(speedups["bfloat16"], 1.0)
    float16_note = ""
    if float16_fast and not float16_capable:
        float16_note = (
            " float16 matmuls measured fast, but outside NVIDIA GPUs of "
            "compute capability 7.0 or higher the rest of a float16 training "
            "step runs on slow paths, so mixed_float16 is not recommended."
        )
    if chosen == "float16":
        return (
            f"float16 matmuls are the fastest ({ratios}) and the GPU runs "
            "float16 training steps natively; the policy's dynamic loss "
            "scale keeps small gradients from flushing to zero."
        )
    if chosen == "bfloat16":
        return (
            f"bfloat16 matmuls beat float32 by at least {margin:g}x "
            f"({ratios}); bfloat16 keeps float32's exponent range, so no "
            f"loss scaling is needed.{float16_note}"
        )
    return (
        f"No 16-bit dtype beats float32 by {margin:g}x here ({ratios}), so "
        f"mixed precision would not be faster.{float16_note}"
    )


# ------------------------------------------------------------ model steps


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
    with _global_state_kept():
        models = {}
        for name in _POLICIES:
            with policy_module.policy_scope(name):
                built = _build(model, source, name)
                _compile(built, source, loss, optimizer)
            models[name] = built
        for name in _POLICIES:
            if not models[name].built:
                models[name](x)
            _check_policy_taken(models[name], name, source)
        reference = models["float32"]
        if source is not None and source.built:
            reference = source
        _copy_variables(reference, models)
        losses = {
            name: [
                _train_on_batch(models[name], x, y) for _ in range(check_steps)
            ]
            for name in _POLICIES
        }
        loss_deltas, unsound = _check_losses(losses, loss_tolerance)
        runners = {name: _steps(models[name], x, y) for name in _POLICIES}
        first = {
            name: timer(name, 1, lambda name=name: runners[name](1))
            for name in _POLICIES
        }
        candidates = [name for name in _POLICIES[1:] if name not in unsound]
        rounds, stable = _time_until_stable(
            runners,
            _units(first, budget_seconds),
            candidates,
            margin,
            budget_seconds,
            timer,
        )
    step_seconds = _medians(rounds, _POLICIES)
    speedups = _speedups(rounds, _POLICIES)
    chosen = _choose(speedups, margin, candidates)
    details = devices.device_details()
    notes = {
        f"mixed_{dtype}": note
        for dtype, note in backend_throughput.dtype_notes(details).items()
    }
    return PolicyRecommendation(
        policy="float32" if chosen is None else chosen,
        throughput={name: 1.0 / s for name, s in step_seconds.items()},
        reason=_model_reason(chosen, speedups, margin, unsound, loss_tolerance)
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
    )


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
    for name in _POLICIES[1:]:
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


def _model_reason(chosen, speedups, margin, unsound, tolerance):
    ratios = _ratios_text(speedups, _POLICIES[1:])
    excluded = "".join(
        f" {name} was excluded as unsound: {why}."
        for name, why in unsound.items()
    )
    if chosen == "mixed_bfloat16":
        return (
            f"Its training steps beat float32 by at least {margin:g}x "
            f"({ratios}) and its losses track float32's within "
            f"{100 * tolerance:g}%; bfloat16 keeps float32's exponent range, "
            f"so no loss scaling is needed.{excluded}"
        )
    if chosen == "mixed_float16":
        return (
            f"Its training steps, loss scaling included, beat float32 and "
            f"mixed_bfloat16 by at least {margin:g}x ({ratios}) and its "
            f"losses track float32's within {100 * tolerance:g}%; the "
            "policy's dynamic loss scale keeps small gradients from flushing "
            f"to zero.{excluded}"
        )
    return (
        f"No sound 16-bit policy trains this model {margin:g}x as fast as "
        f"float32 here ({ratios} float32), so mixed precision would not be "
        f"faster.{excluded}"
    )

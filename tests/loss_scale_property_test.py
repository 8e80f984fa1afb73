"""`DynamicLossScale`'s state machine against a plain-Python transcription.

Hypothesis draws the parameters (powers of two and not, floors and caps
near float32's limits, hysteresis), a starting state (as a checkpoint
restores it) and a sequence of finite and non-finite steps; every step's
decision and state must be the transcription's, bit for bit, eagerly and
(TensorFlow, JAX) inside a compiled step.

The transcription is written from the class docstring, not from the code:
the scale is a float32 value, each parameter the float32 nearest it (the
state is float32, so a parameter is read as one), and every product and
quotient a float32 one.
"""

import math

import hypothesis
import keras
import numpy as np
import pytest
from hypothesis import strategies as st

import keras_mp
from keras_mp.testing import to_numpy

# Example counts: each backend runs all of this file's properties within a
# few seconds (the report of issue 35 has the measured times).
EAGER_EXAMPLES = 25
COMPILED_EXAMPLES = 6
_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126


def _f32(value):
    return np.float32(value)


class ReferenceDynamicLossScale:
    """The docstring's algorithm, step by step.

    - A non-finite step is skipped and resets the count of finite steps.
      With hysteresis `h`, only the `h`-th non-finite step in a row lowers
      the scale (then the count of them starts again); lowering makes it
      `max(scale / multiplier, min_loss_scale)`, the quotient computed as
      the float32 product `scale * (1 / multiplier)`.
    - A finite step is applied and ends a run of non-finite ones. At the
      `increment_period`-th finite step in a row the count starts again and
      the scale becomes `scale * multiplier`, unless that is not finite or
      is above `max_loss_scale`.
    """

    def __init__(self, config, num_good_steps=0, overflows_in_a_row=0):
        self.scale = _f32(config["initial_loss_scale"])
        self.multiplier = _f32(config["multiplier"])
        self.inverse_multiplier = _f32(1.0 / config["multiplier"])
        self.floor = _f32(config["min_loss_scale"])
        cap = config["max_loss_scale"]
        self.cap = None if cap is None else _f32(cap)
        self.period = config["increment_period"]
        self.hysteresis = config["hysteresis"]
        self.num_good_steps = num_good_steps
        self.overflows_in_a_row = overflows_in_a_row

    def update(self, is_finite):
        if is_finite:
            self.overflows_in_a_row = 0
            self.num_good_steps += 1
            if self.num_good_steps == self.period:
                self.num_good_steps = 0
                with np.errstate(over="ignore"):
                    grown = self.scale * self.multiplier
                if math.isfinite(grown) and (
                    self.cap is None or grown <= self.cap
                ):
                    self.scale = grown
            return True
        self.num_good_steps = 0
        self.overflows_in_a_row += 1
        if self.overflows_in_a_row == self.hysteresis:
            self.overflows_in_a_row = 0
            self.scale = max(self.scale * self.inverse_multiplier, self.floor)
        return False

    def state(self):
        return (
            float(self.scale),
            self.num_good_steps,
            self.overflows_in_a_row if self.hysteresis > 1 else None,
        )


def _powers_of_two(low, high):
    return st.integers(low, high).map(lambda k: 2.0**k)


def _any_positive(low, high):
    return st.floats(low, high, allow_nan=False, allow_infinity=False)


@st.composite
def loss_scale_cases(draw, max_steps=24, power_of_two=None):
    """`(config, num_good_steps, overflows_in_a_row, flags)`; powers of two
    or not as `power_of_two` says (None: drawn)."""
    if power_of_two is None:
        power_of_two = draw(st.booleans())
    if power_of_two:
        multiplier = draw(st.sampled_from([2.0, 4.0, 2.0**10]))
        # Near float32's largest values too, where growth gives inf.
        initial = draw(
            st.one_of(
                _powers_of_two(-100, 127), st.sampled_from([2.0**126, 2.0**127])
            )
        )
    else:
        # Down to 1 + 2**-30, which float32 reads as 1: the scale is stuck.
        multiplier = draw(
            st.one_of(
                _any_positive(1.0 + 2.0**-30, 16.0),
                st.sampled_from([1.1, 1.5, 3.0, 10.0]),
            )
        )
        initial = draw(
            st.one_of(
                _any_positive(_FLOAT32_TINY, _FLOAT32_MAX),
                _any_positive(1e37, _FLOAT32_MAX),
            )
        )
    # The floor: the initial scale itself, or below it by powers of two or
    # by any factor, down to float32's smallest normal value.
    floor = draw(
        st.one_of(
            st.just(initial),
            st.integers(1, 60).map(lambda k: initial * 2.0**-k),
            _any_positive(0.0, 1.0).map(lambda u: initial * u),
        )
    )
    floor = max(floor, _FLOAT32_TINY)
    cap = draw(
        st.one_of(
            st.none(),
            st.just(initial),
            st.integers(1, 40).map(lambda k: initial * 2.0**k),
            _any_positive(1.0, 1e6).map(lambda u: initial * u),
        )
    )
    if cap is not None:
        cap = min(cap, _FLOAT32_MAX)
    config = dict(
        initial_loss_scale=initial,
        increment_period=draw(st.integers(1, 5)),
        multiplier=multiplier,
        min_loss_scale=floor,
        max_loss_scale=cap,
        hysteresis=draw(st.integers(1, 4)),
    )
    num_good_steps = draw(st.integers(0, config["increment_period"] - 1))
    overflows = draw(st.integers(0, config["hysteresis"] - 1))
    flags = draw(st.lists(st.booleans(), min_size=1, max_size=max_steps))
    return config, num_good_steps, overflows, flags


def _start(config, num_good_steps, overflows_in_a_row):
    """A built `DynamicLossScale` in the given state, as a checkpoint
    restores it (assigned to its variables)."""
    scale = keras_mp.DynamicLossScale(**config)
    scale.build()
    scale.num_good_steps.assign(num_good_steps)
    if config["hysteresis"] > 1:
        (counter,) = [
            v for v in scale.variables if "overflows_in_a_row" in v.path
        ]
        counter.assign(overflows_in_a_row)
    return scale


def _state(values, hysteresis):
    values = [to_numpy(v) for v in values]
    scale = values[0]
    assert scale.dtype == np.float32
    return (
        float(scale),
        int(values[1]),
        int(values[2]) if hysteresis > 1 else None,
    )


def _check_invariants(state, config):
    scale = state[0]
    assert math.isfinite(scale) and scale > 0
    assert scale >= _f32(config["min_loss_scale"])
    if config["max_loss_scale"] is not None:
        assert scale <= _f32(config["max_loss_scale"])
    assert 0 <= state[1] < config["increment_period"]


@hypothesis.settings(max_examples=EAGER_EXAMPLES, **_SETTINGS)
@hypothesis.given(loss_scale_cases())
def test_update_follows_the_reference_step_by_step(case):
    config, num_good_steps, overflows, flags = case
    scale = _start(config, num_good_steps, overflows)
    reference = ReferenceDynamicLossScale(config, num_good_steps, overflows)
    for step, is_finite in enumerate(flags):
        applied = scale.update(is_finite)
        expected_applied = reference.update(is_finite)
        state = _state(scale.variables, config["hysteresis"])
        where = f"step {step} of {flags}, config {config}"
        assert bool(to_numpy(applied)) is expected_applied, where
        assert state == reference.state(), where
        _check_invariants(state, config)
        assert float(to_numpy(scale())) == state[0]


def _compiled_update(scale):
    """`scale.update` compiled: `(values, is_finite) -> (values, applied)`
    on TensorFlow (`tf.function`, XLA) and JAX (`jax.jit`, stateless)."""
    variables = scale.variables
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function(jit_compile=True)
        def update(is_finite):
            return scale.update(is_finite)

        def step(values, is_finite):
            applied = update(tf.constant(is_finite))
            return [v.value for v in variables], applied

        return step

    import jax

    @jax.jit
    def step(values, is_finite):
        mapping = list(zip(variables, values))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            applied = scale.update(is_finite)
        return [scope.get_current_value(v) for v in variables], applied

    return step


@pytest.mark.backends("tensorflow", "jax")
@hypothesis.settings(max_examples=COMPILED_EXAMPLES, **_SETTINGS)
@hypothesis.given(loss_scale_cases(max_steps=16, power_of_two=False))
def test_compiled_update_follows_the_reference(case):
    """Inside a compiled step the parameters are constants XLA may fold
    (a division by a constant becomes a product by its inverse, one ulp
    away for a multiplier that is not a power of two, the only ones
    drawn here): still bit for bit."""
    config, num_good_steps, overflows, flags = case
    scale = _start(config, num_good_steps, overflows)
    reference = ReferenceDynamicLossScale(config, num_good_steps, overflows)
    step = _compiled_update(scale)
    values = [v.value for v in scale.variables]
    for index, is_finite in enumerate(flags):
        values, applied = step(values, np.bool_(is_finite))
        expected_applied = reference.update(is_finite)
        state = _state(values, config["hysteresis"])
        where = f"step {index} of {flags}, config {config}"
        assert bool(to_numpy(applied)) is expected_applied, where
        assert state == reference.state(), where


@hypothesis.settings(max_examples=EAGER_EXAMPLES, **_SETTINGS)
@hypothesis.given(
    initial=_any_positive(1e-300, 1e300),
    floor_factor=_any_positive(1e-300, 1.0),
)
def test_every_accepted_scale_stays_positive_and_finite(initial, floor_factor):
    """A floor below float32's smallest normal (a zero scale: every gradient
    zero, silently) or an initial scale beyond its range (inf) is refused;
    an accepted scale starts finite and stops at a positive floor."""
    floor = initial * floor_factor
    try:
        scale = keras_mp.DynamicLossScale(
            initial_loss_scale=initial, min_loss_scale=floor
        )
    except ValueError as error:
        assert floor < _FLOAT32_TINY or initial > _FLOAT32_MAX, error
        assert "Received:" in str(error)
        return
    scale.build()
    assert float(to_numpy(scale())) == _f32(initial) < np.inf
    # One overflow at the floor: the scale stays there.
    scale.loss_scale.assign(_f32(floor))
    scale.update(False)
    value = float(to_numpy(scale()))
    assert value == _f32(floor) and 0 < value < np.inf

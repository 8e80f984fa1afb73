"""The timing engine: alternating rounds until the comparison is clear.

Generic over what is timed: runners by name, the first one the base. It
measures rounds of samples, medians, ratios to the base and intervals
around their medians, and chooses among candidates by a margin.
"""

import functools
import math
import statistics
import time

# Enough rounds for a 90% interval around a median (the extreme pair of 5).
_MIN_ROUNDS = 5
_MAX_ROUNDS = 50
_CONFIDENCE = 0.9
# Samples of about budget / 30 seconds: ten rounds of three fit the budget.
_SAMPLES_PER_BUDGET = 30


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


def _choose_fp8(speedups, margin, sixteen_bit, fp8):
    """Whether `fp8` beats float32 and the fastest of `sixteen_bit` (the
    sound 16-bit candidates, whether they beat float32 or not) by
    `margin`: FP8 costs precision over bfloat16, and must pay for it."""
    best = max([1.0] + [speedups[name] for name in sixteen_bit])
    return speedups[fp8] >= margin * best

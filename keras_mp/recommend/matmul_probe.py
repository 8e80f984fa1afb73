"""The matmul probe: `recommend_policy()` without a model.

Times compiled matmuls per dtype, the bulk of most training steps, as a
quick probe of the device.

Imports the timing engine, the report and `keras_mp.backend`; nothing
from the model probe or `keras_mp.recommend.api`.
"""

import keras

from keras_mp.backend import devices
from keras_mp.backend import throughput as backend_throughput
from keras_mp.recommend.report import _DTYPES
from keras_mp.recommend.report import PolicyRecommendation
from keras_mp.recommend.report import _matmul_reason
from keras_mp.recommend.report import _unsettled_text
from keras_mp.recommend.timing import _choose
from keras_mp.recommend.timing import _medians
from keras_mp.recommend.timing import _speedups
from keras_mp.recommend.timing import _time_until_stable
from keras_mp.recommend.timing import _units


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
        fp8_skipped=devices.fp8_unsupported_reason(details)
        or (
            "the matmul form times 16-bit matmuls only; pass a model "
            "(`recommend_policy(model, x, y)`) to time FP8 training steps"
        ),
    )


def _repeat(call):
    def run(units):
        for _ in range(units):
            call()

    return run

"""recommend_policy: measure matmul throughput per dtype, pick a policy."""

import dataclasses
import statistics
import time

import keras

from keras_mp.backend import devices
from keras_mp.backend import throughput as backend_throughput

_DTYPES = ("float32", "bfloat16", "float16")
_MIN_REPEATS = 3
_MAX_REPEATS = 25


@dataclasses.dataclass(frozen=True)
class PolicyRecommendation:
    """What `recommend_policy` measured and chose.

    Attributes:
        policy: The policy name to pass to `keras_mp.set_global_policy`:
            `"mixed_float16"`, `"mixed_bfloat16"` or `"float32"`.
            `keras_mp.Policy("mixed_float16")` comes with a dynamic loss
            scale; the other two need none.
        throughput: Measured matmul throughput in GFLOP/s, by dtype name
            (`"float32"`, `"bfloat16"`, `"float16"`).
        reason: One or two sentences saying why `policy` was chosen.
        backend: The Keras backend that ran the matmuls.
        device: The devices they ran on, as `"GPU 'NVIDIA H100'"`.
        notes: By dtype name, how a dtype's matmuls really ran where not
            natively as that dtype: `"upcast: ..."` (computed in float32,
            as Keras does for float16 on torch CPUs) or `"emulated: ..."`.
            Empty where every dtype ran natively.
    """

    policy: str
    throughput: dict
    reason: str
    backend: str
    device: str
    notes: dict = dataclasses.field(default_factory=dict)

    def speedup(self, dtype):
        """Throughput of `dtype` divided by that of float32."""
        return self.throughput[dtype] / self.throughput["float32"]

    def __str__(self):
        lines = [f"Matmul throughput ({self.backend} on {self.device}):"]
        for dtype in _DTYPES:
            note = self.notes.get(dtype)
            lines.append(
                f"  {dtype:>8}: {self.throughput[dtype]:9.1f} GFLOP/s "
                f"({self.speedup(dtype):.2f}x float32)"
                + (f" [{note}]" if note else "")
            )
        lines.append(f"Recommended policy: {self.policy}. {self.reason}")
        return "\n".join(lines)


def recommend_policy(margin=1.25, budget_seconds=3.0, size=None):
    """Measures float32, bfloat16 and float16 matmuls and picks a policy.

    Whether mixed precision pays depends on the device and on the backend's
    kernels for it, which no table of hardware features captures (a CPU may
    have native bfloat16 instructions that one backend uses and another does
    not). So this times what training spends most of its time on: compiled
    matmuls of a moderate size, on the device and backend of this process,
    after a warm-up, alternating the dtypes and taking the median of
    repeats, in about `budget_seconds`. The matmul timed is the one Keras
    layers run: where that is not a native matmul of the dtype (Keras
    upcasts float16 matmuls to float32 on torch CPUs; a CPU without
    bfloat16 instructions emulates bfloat16), the figure is what training
    gets and `notes` says so.

    The choice is the fastest *safe* policy:

    - `"mixed_bfloat16"` if bfloat16 beats float32 by `margin`. bfloat16
      keeps float32's exponent range, so it needs no loss scaling; it is
      preferred over float16 unless float16 is faster still by `margin`.
    - `"mixed_float16"` only if float16 beats float32 (and bfloat16) by
      `margin` *and* the device is an NVIDIA GPU of compute capability 7.0
      or higher. Elsewhere a fast float16 matmul does not make a fast float16
      training step (other ops fall back to slow paths). A float16 policy
      comes with a dynamic loss scale, which keeps small gradients from
      flushing to zero.
    - `"float32"` otherwise: mixed precision would not be faster here.

    Args:
        margin: How many times as fast as float32 a 16-bit dtype must be to
            be chosen. Defaults to `1.25`.
        budget_seconds: Approximate time for the timed repeats, compilation
            not included. A dtype whose single call takes a large part of it
            is timed once (it is clearly slow). Defaults to `3.0`.
        size: Side of the square matrices. Defaults to 1024 on CPUs and
            4096 on accelerators.

    Returns:
        A `PolicyRecommendation` with `policy`, `throughput` (GFLOP/s by
        dtype), `reason` and `notes` (dtypes that ran upcast or emulated).

    Example:

    >>> result = keras_mp.recommend_policy(budget_seconds=0.5, size=128)
    >>> result.policy in ("float32", "mixed_bfloat16", "mixed_float16")
    True
    >>> sorted(result.throughput)
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
    measured = _measure(size, chain, budget_seconds)
    policy, reason = _choose(measured, margin, details)
    return PolicyRecommendation(
        policy=policy,
        throughput=measured,
        reason=reason,
        backend=keras.backend.backend(),
        device=", ".join(f"{d['kind'].upper()} {d['name']!r}" for d in details),
        notes=backend_throughput.dtype_notes(details),
    )


def _seconds(run):
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _measure(size, chain, budget_seconds):
    """GFLOP/s by dtype: warm-up, then alternating rounds, median of each."""
    runners = {}
    samples = {}
    for dtype in _DTYPES:
        runners[dtype] = backend_throughput.matmul_runner(dtype, size, chain)
        runners[dtype]()  # compiles
        samples[dtype] = [_seconds(runners[dtype])]
    deadline = time.perf_counter() + budget_seconds
    # A dtype this slow has answered already; repeating it would spend the
    # budget on a dtype that cannot be chosen.
    slow = budget_seconds / (3 * len(_DTYPES))
    active = [d for d in _DTYPES if samples[d][0] < slow]
    # Alternating dtypes spreads a noisy neighbour's load over all of them.
    while active and len(samples[active[0]]) < _MAX_REPEATS:
        for dtype in active:
            samples[dtype].append(_seconds(runners[dtype]))
        if (
            time.perf_counter() > deadline
            and len(samples[active[0]]) >= _MIN_REPEATS
        ):
            break
    flops = 2.0 * size**3 * chain
    return {d: flops / statistics.median(samples[d]) / 1e9 for d in _DTYPES}


def _choose(measured, margin, details):
    bf16 = measured["bfloat16"] / measured["float32"]
    f16 = measured["float16"] / measured["float32"]
    ratios = f"bfloat16 {bf16:.2f}x, float16 {f16:.2f}x float32"
    float16_capable = (
        devices.compatibility_warning("mixed_float16", details) is None
    )
    if f16 >= margin and f16 >= margin * bf16:
        if float16_capable:
            return "mixed_float16", (
                f"float16 matmuls are the fastest ({ratios}) and the GPU "
                "runs float16 training steps natively; the policy's dynamic "
                "loss scale keeps small gradients from flushing to zero."
            )
        float16_note = (
            " float16 matmuls measured fast, but outside NVIDIA GPUs of "
            "compute capability 7.0 or higher the rest of a float16 training "
            "step runs on slow paths, so mixed_float16 is not recommended."
        )
    else:
        float16_note = ""
    if bf16 >= margin:
        return "mixed_bfloat16", (
            f"bfloat16 matmuls beat float32 by at least {margin:g}x "
            f"({ratios}); bfloat16 keeps float32's exponent range, so no "
            f"loss scaling is needed.{float16_note}"
        )
    return "float32", (
        f"No 16-bit dtype beats float32 by {margin:g}x here ({ratios}), so "
        f"mixed precision would not be faster.{float16_note}"
    )

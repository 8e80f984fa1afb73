"""The report: `PolicyRecommendation` and the texts of its `reason`.

Also holds the dtypes and policies compared, in the order of the table.

Imports only the standard library: nothing from keras or the rest of
`keras_mp`, and nothing from the timing engine or the probes.
"""

import dataclasses

_DTYPES = ("float32", "bfloat16", "float16")
_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


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

    def speedup(self, name: str) -> float:
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


def _ratios_text(speedups, names):
    return ", ".join(f"{name} {speedups[name]:.2f}x" for name in names)


def _unsettled_text(stable, rounds, budget):
    if stable:
        return ""
    return (
        f" The timings had not settled after {len(rounds)} rounds "
        f"(budget_seconds={budget:g}); a larger budget gives a firmer answer."
    )


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

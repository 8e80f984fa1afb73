"""The report: `PolicyRecommendation` and the texts of its `reason`.

Also holds the dtypes and policies compared, in the order of the table.
"""

import dataclasses

_DTYPES = ("float32", "bfloat16", "float16")
_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
# The FP8 candidate: mixed_bfloat16 with `keras_mp.fp8.DEFAULT_RECIPE`.
_FP8 = "mixed_bfloat16+fp8"
_FP8_SETTING = 'keras_mp.set_global_policy("mixed_bfloat16", fp8=True)'


@dataclasses.dataclass(frozen=True)
class PolicyRecommendation:
    """What `recommend_policy` measured and chose.

    Attributes:
        policy: The policy name to pass to `keras_mp.set_global_policy`:
            `"mixed_float16"`, `"mixed_bfloat16"` or `"float32"`.
            `keras_mp.Policy("mixed_float16")` comes with a dynamic loss
            scale; the other two need none.
        fp8: The FP8 recipe to pass with it
            (`set_global_policy(policy, fp8=result.fp8)`) where FP8 was
            chosen, `keras_mp.fp8.DEFAULT_RECIPE` over mixed_bfloat16;
            None otherwise.
        fp8_skipped: Why FP8 was not a candidate (no FP8 tensor cores, no
            layer that takes FP8, or the matmul form), or None where its
            training steps were timed (as `"mixed_bfloat16+fp8"` in the
            tables).
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
    fp8: object = None
    fp8_skipped: str = None

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
                f"  {'policy':>18}  {'median step':>11}  {'speed-up':>8}  "
                "loss vs float32",
            ]
            for name in self.step_seconds:
                delta = self.loss_deltas.get(name)
                shown = "-" if delta is None else f"{100 * delta:.2f}%"
                extra = [self.notes.get(name), self.unsound.get(name)]
                if name in self.unsound:
                    extra[1] = f"unsound: {extra[1]}"
                suffix = "".join(f" [{e}]" for e in extra if e)
                lines.append(
                    f"  {name:>18}  {1000 * self.step_seconds[name]:>8.2f} ms"
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
        if self.fp8_skipped:
            lines.append(f"  FP8 not a candidate: {self.fp8_skipped}.")
        chosen = self.policy + (" with FP8" if self.fp8 is not None else "")
        lines.append(f"Recommended policy: {chosen}. {self.reason}")
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


def _model_reason(
    chosen, speedups, margin, unsound, tolerance, fp8_skipped=None
):
    ratios = _ratios_text(speedups, [n for n in speedups if n != "float32"])
    excluded = "".join(
        f" {name} was excluded as unsound: {why}."
        for name, why in unsound.items()
    )
    if fp8_skipped:
        excluded += f" FP8 was not a candidate: {fp8_skipped}."
    elif chosen != _FP8 and _FP8 not in unsound:
        excluded += (
            f" FP8 ({_FP8}) did not beat float32 and the fastest sound "
            f"16-bit policy by {margin:g}x."
        )
    if chosen == _FP8:
        return (
            f"Its FP8 GEMMs (keras_mp.fp8.DEFAULT_RECIPE) beat float32 and "
            f"the fastest sound 16-bit policy by at least {margin:g}x "
            f"({ratios}) and its losses track float32's within "
            f"{100 * tolerance:g}%: call {_FP8_SETTING}.{excluded}"
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

"""`keras_mp.recommend_policy`: measured throughput and the policy it picks."""

import time

import keras
import pytest

import keras_mp
from keras_mp import recommend
from keras_mp.backend import throughput

_CPU = [
    {
        "kind": "cpu",
        "name": "Test CPU",
        "compute_capability": None,
        "native_bfloat16": True,
    }
]
_V100 = [
    {
        "kind": "gpu",
        "name": "Tesla V100",
        "compute_capability": (7, 0),
        "native_bfloat16": False,
    }
]
_A100 = [
    {
        "kind": "gpu",
        "name": "A100",
        "compute_capability": (8, 0),
        "native_bfloat16": True,
    }
]


def _throughput(float32, bfloat16, float16):
    return {"float32": float32, "bfloat16": bfloat16, "float16": float16}


def test_measures_every_dtype_and_returns_a_policy_with_a_reason():
    result = keras_mp.recommend_policy(budget_seconds=0.2, size=64)
    assert isinstance(result, keras_mp.PolicyRecommendation)
    assert result.policy in ("float32", "mixed_bfloat16", "mixed_float16")
    assert sorted(result.throughput) == ["bfloat16", "float16", "float32"]
    assert all(value > 0 for value in result.throughput.values())
    assert result.reason
    assert result.backend == keras.backend.backend()
    assert result.policy in str(result)
    assert result.speedup("float32") == 1.0


def test_bfloat16_faster_by_the_margin_gives_mixed_bfloat16():
    policy, reason = recommend._choose(_throughput(100, 300, 90), 1.25, _CPU)
    assert policy == "mixed_bfloat16"
    assert "no loss scaling" in reason


def test_bfloat16_below_the_margin_gives_float32():
    policy, reason = recommend._choose(_throughput(100, 120, 100), 1.25, _CPU)
    assert policy == "float32"
    assert "1.20x" in reason


def test_fast_float16_on_a_cpu_is_not_recommended():
    policy, reason = recommend._choose(_throughput(100, 90, 300), 1.25, _CPU)
    assert policy == "float32"
    assert "mixed_float16 is not recommended" in reason


def test_fast_float16_on_a_cpu_falls_back_to_fast_bfloat16():
    policy, _ = recommend._choose(_throughput(100, 200, 300), 1.25, _CPU)
    assert policy == "mixed_bfloat16"


def test_fast_float16_on_a_volta_gpu_gives_mixed_float16_with_loss_scaling():
    policy, reason = recommend._choose(_throughput(100, 40, 800), 1.25, _V100)
    assert policy == "mixed_float16"
    assert "loss scale" in reason
    assert keras_mp.Policy(policy).loss_scale is not None


def test_bfloat16_is_preferred_where_float16_is_not_faster_by_the_margin():
    policy, _ = recommend._choose(_throughput(100, 800, 820), 1.25, _A100)
    assert policy == "mixed_bfloat16"


def test_a_larger_margin_keeps_float32():
    measured = _throughput(100, 180, 90)
    assert recommend._choose(measured, 1.25, _CPU)[0] == "mixed_bfloat16"
    assert recommend._choose(measured, 2.0, _CPU)[0] == "float32"


def test_a_slow_dtype_is_timed_once_and_the_others_repeatedly(monkeypatch):
    calls = {"float32": 0, "bfloat16": 0, "float16": 0}
    seconds = {"float32": 0.001, "bfloat16": 0.001, "float16": 0.2}

    def fake_runner(dtype, size, chain):
        def run():
            calls[dtype] += 1
            time.sleep(seconds[dtype])

        return run

    monkeypatch.setattr(throughput, "matmul_runner", fake_runner)
    result = keras_mp.recommend_policy(budget_seconds=0.3, size=64)
    # One call compiles, one is timed; no more for the slow dtype.
    assert calls["float16"] == 2
    assert calls["float32"] >= 2 + 3
    assert result.throughput["float16"] < result.throughput["float32"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"margin": 0.9}, "margin"),
        ({"budget_seconds": 0}, "budget_seconds"),
        ({"size": 8}, "size"),
        ({"size": 100.0}, "size"),
    ],
)
def test_invalid_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        keras_mp.recommend_policy(**kwargs)


@pytest.mark.backends("torch")
def test_float16_on_a_torch_cpu_is_reported_as_upcast_to_float32():
    notes = throughput.dtype_notes(_CPU)
    assert notes["float16"].startswith("upcast:")
    assert "bfloat16" not in notes
    result = keras_mp.recommend_policy(budget_seconds=0.1, size=32)
    assert "[upcast: Keras runs float16 matmuls" in str(result)
    assert result.notes["float16"] == notes["float16"]


def test_bfloat16_on_a_cpu_without_its_instructions_is_reported_emulated():
    cpu = [dict(_CPU[0], native_bfloat16=False)]
    assert throughput.dtype_notes(cpu)["bfloat16"].startswith("emulated:")
    assert "bfloat16" not in throughput.dtype_notes(_CPU)
    assert "bfloat16" not in throughput.dtype_notes(_A100)


def test_the_table_shows_each_note_next_to_its_dtype():
    result = recommend.PolicyRecommendation(
        policy="float32",
        throughput=_throughput(10.0, 1.0, 8.0),
        reason="Because.",
        backend="torch",
        device="CPU 'Test CPU'",
        notes={"float16": "upcast: in float32"},
    )
    float16_line = next(
        line
        for line in str(result).splitlines()
        if line.strip().startswith("float16:")
    )
    assert float16_line.endswith("(0.80x float32) [upcast: in float32]")

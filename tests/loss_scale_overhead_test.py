"""The loss scaling overhead benchmark runs end to end at a tiny size."""

import importlib.util
import pathlib

import keras
import numpy as np
import pytest

BENCHMARK = (
    pathlib.Path(__file__).resolve().parent.parent
    / "benchmarks"
    / "loss_scale_overhead.py"
)


def _load_benchmark():
    spec = importlib.util.spec_from_file_location(
        "keras_mp_benchmark_loss_scale_overhead", BENCHMARK
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_prints_step_times_and_ratios_of_the_three_variants(capsys):
    benchmark = _load_benchmark()
    benchmark.main(
        [
            "--steps=2",
            "--repeats=2",
            "--warmup-steps=1",
            "--batch-size=4",
            "--features=8",
            "--hidden=8",
            "--layers=1",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    for variant in ("plain", "keras", "keras_mp"):
        assert all(float(figure) > 0 for figure in rows[variant])
    for ratio in ("keras_mp/plain", "keras_mp/keras", "keras/plain"):
        assert len(rows[ratio]) == 4
    if keras.backend.backend() == "torch":
        # Keras's LossScaleOptimizer reads its skip flag on the host, as
        # keras_mp does by default (once); the opt-in skip never does.
        assert float(rows["keras_mp-syncs"][0]) == 1.0
        assert float(rows["keras_mp_device-syncs"][0]) == 0.0
        assert float(rows["keras-syncs"][0]) > 0.0
        assert all(float(figure) > 0 for figure in rows["keras_mp_device"])
        for ratio in ("keras_mp_device/plain", "keras_mp_device/keras"):
            assert len(rows[ratio]) == 4
    else:
        assert "keras_mp-syncs" not in rows
        assert "keras_mp_device" not in rows
    # The barrier floor needs XLA: JAX always, TensorFlow on request.
    if keras.backend.backend() == "jax":
        assert all(float(figure) > 0 for figure in rows["barrier"])
        for ratio in ("keras_mp/barrier", "barrier/plain"):
            assert len(rows[ratio]) == 4
    else:
        assert "barrier" not in rows and "keras_mp/barrier" not in rows


@pytest.mark.backends("jax", "tensorflow")
def test_barrier_variant_trains_exactly_as_the_plain_step():
    # The floor variant must do the plain step's work, only later: the
    # barrier orders the update after every gradient and changes no value.
    benchmark = _load_benchmark()
    args = benchmark.parse_args(
        ["--batch-size=4", "--features=8", "--hidden=8", "--layers=2"]
        + (["--jit-compile"] if keras.backend.backend() == "tensorflow" else [])
    )
    x, y = benchmark.make_data(args, 3)
    weights = {}
    for variant in ("plain", "barrier"):
        model = benchmark.build_model(args, variant)
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        weights[variant] = model.get_weights()
    assert isinstance(
        benchmark.make_optimizer("barrier"), benchmark.BarrierAdam
    )
    for plain, barrier in zip(weights["plain"], weights["barrier"]):
        np.testing.assert_array_equal(plain, barrier)


def test_benchmark_refuses_zero_steps():
    with pytest.raises(SystemExit):
        _load_benchmark().parse_args(["--steps=0"])


@pytest.mark.backends("tensorflow")
def test_benchmark_compiles_the_tensorflow_step_with_xla_on_request(capsys):
    _load_benchmark().main(
        [
            "--steps=1",
            "--repeats=1",
            "--warmup-steps=1",
            "--batch-size=4",
            "--features=8",
            "--hidden=8",
            "--layers=1",
            "--jit-compile",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert "xla=True" in lines[0]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert all(float(figure) > 0 for figure in rows["barrier"])
    assert len(rows["keras_mp/barrier"]) == 4


@pytest.mark.backends("jax", "torch")
def test_benchmark_refuses_jit_compile_off_tensorflow():
    with pytest.raises(SystemExit):
        _load_benchmark().parse_args(["--jit-compile"])

"""`benchmarks/gpu/`: the prepared GPU run cannot rot between GPU runs.

`fp8_speed.py --smoke` runs its sections at toy sizes on the CPU, errors
re-raised: on PyTorch every section but the JAX-only HLO audit (torchao's
float8 training on the same decoder, section i, included); on JAX the
sections with JAX code of their own (GEMMs, quantize, `fp8.dot`, the HLO
audit); the decoder sections are Keras code alike on both backends, and
each of their XLA compilations costs seconds on a CPU. The GPT-2 section
runs on both (a 1-layer model, 2 steps a variant): issue 49 asks for both.
TensorFlow is not in the GPU image, so the script has no TensorFlow run.
"""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import keras
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
GPU = ROOT / "benchmarks" / "gpu"
SECTIONS = {"torch": "abcdeghi", "jax": "abcfgh"}


def _script():
    spec = importlib.util.spec_from_file_location(
        "fp8_speed", GPU / "fp8_speed.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.backends("jax", "torch")
def test_smoke_runs_every_section_and_writes_the_table(tmp_path):
    backend = keras.backend.backend()
    env = dict(os.environ, KERAS_BACKEND=backend, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )
    command = [sys.executable, str(GPU / "fp8_speed.py"), "--smoke"]
    command += ["--out", str(tmp_path), "--sections", SECTIONS[backend]]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / f"{backend}.json").read_text())
    assert result["device"].startswith("cpu")
    names = {_script().LETTERS[s] for s in SECTIONS[backend]}
    assert set(result["sections"]) == names
    for name, section in result["sections"].items():
        assert section["status"] == "ok", (name, section)
        assert section["rows"], name
    table = (tmp_path / "table.md").read_text()
    assert result["device"] in table
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + sum(
        len(s["rows"]) for s in result["sections"].values()
    )
    # Adam state: on torch the update kernels' batch path side by side.
    state = result["sections"]["state"]["rows"][0]
    expected = ["float32", "bfloat16", "float8"]
    if backend == "torch":
        expected += ["bfloat16_batch", "float8_batch"]
        assert "float8_batch_vs_kernel" in state["ratios"], state
    assert list(state["ms"]) == expected, state
    # GPT-2: a row per variant, each with a finite loss and tokens/s.
    rows = result["sections"]["gpt2"]["rows"]
    assert [list(row["ms"]) for row in rows] == [
        ["mixed_bfloat16"],
        ["fp8_tensorwise"],
        ["mxfp8"],
    ]
    for row in rows:
        assert math.isfinite(row["loss"]) and 0 < row["loss"] < 10, row
        assert row["tokens_per_s"] > 0, row
        assert row["steps"] == 2, row
        assert row["item"] in table
    assert rows[0]["fp8_layers"] == 0
    assert all(math.isfinite(row["loss_gap"]) for row in rows[1:]), rows
    assert rows[1]["fp8_layers"] == rows[2]["fp8_layers"] > 0
    # No FP8 tensor cores here: each FP8 row says its GEMMs are emulated.
    assert "emulated: no MXFP8 tensor cores" in rows[2]["note"], rows[2]
    assert "emulated: no FP8 tensor cores" in rows[1]["note"], rows[1]
    if backend == "jax":
        (row,) = result["sections"]["hlo"]["rows"]
        # Four FP8 Dense layers, three GEMMs each, before optimization.
        assert row["counts"]["fp8_dots_before_optimization"] == 12
        # The compiled step's own peak (XLA), per kind of state.
        (row,) = result["sections"]["state"]["rows"]
        peaks = row["step_peak_mib"]
        assert set(peaks) == {"float32", "bfloat16", "float8"}, peaks
        assert all(peak > 0 for peak in peaks.values()), peaks
    else:
        (row,) = result["sections"]["policies"]["rows"]
        assert row["ratios"]["lso_vs_plain"] > 0
        assert row["host_syncs_per_step"]["mixed_bfloat16"] >= 1
        # A CPU makes FP8 operands by copies; the table says which path.
        assert result["fp8_operands"] == {"path": "copy", "failed": []}
        assert "FP8 operands made by the 'copy' path" in table
        (row,) = result["sections"]["state"]["rows"]
        # Adam's two moments: 8, 4 and about 2 bytes a parameter.
        state = row["state_bytes_per_param"]
        assert 8 <= state["float32"] < 8.1, state
        assert 4 <= state["bfloat16"] < 4.1, state
        assert 2 <= state["float8"] < 2.3, state
        # Kernel launches a step, counted as the CPU tests count them: the
        # float8 state's update launches more than the bfloat16 state's.
        launches = row["launches_per_step"]
        assert 0 < launches["bfloat16"] < launches["float8"], launches
        assert "launches_per_step" in table
        (row,) = result["sections"]["decoder"]["rows"]
        launches = row["launches_per_step"]
        assert 0 < launches["bf16"] < launches["fp8_delayed"], launches
        # The same decoder as a plain PyTorch module under torchao's float8
        # training: every block's Linear converted, the head left alone
        # (as keras_mp's default rules leave it), each step timed.
        (peer,) = result["sections"]["torchao"]["rows"]
        assert set(peer["ms"]) == {"bf16", "tensorwise", "rowwise"}, peer
        assert peer["fp8_layers"] == {
            "bf16": 0,
            "tensorwise": row["fp8_layers"]["fp8_delayed"],
            "rowwise": row["fp8_layers"]["fp8_delayed"],
        }, peer
        assert peer["ratios"]["keras_mp_bf16/torch_bf16"] > 0, peer


def test_audit_counts_the_gemms_of_an_optimized_module():
    text = "\n".join(
        [
            "  %a = bf16[64,64]{1,0} custom-call(f8e4m3fn[64,32]{1,0} %x, "
            'f8e4m3fn[32,64]{0,1} %w), custom_call_target="__cublas$lt$'
            'matmul$f8"',
            "  %b = f32[64,64]{1,0} custom-call(f16[64,32]{1,0} %x, "
            'f16[32,64]{1,0} %y), custom_call_target="__cublas$gemm"',
            "  %c = f32[8,8]{1,0} dot(bf16[8,4]{1,0} %p, bf16[4,8]{1,0} %q), "
            "lhs_contracting_dims={1}, rhs_contracting_dims={0}",
            "  %t = f8e4m3fn[32,64]{1,0} transpose(f8e4m3fn[64,32]{1,0} %x), "
            "dimensions={1,0}",
            '  %n = f32[8]{0} custom-call(f32[8]{0} %z), custom_call_target="'
            'Sharding"',
        ]
    )
    counts = _script().audit(text)
    assert counts == {
        "fp8_gemm": 1,
        "f16_gemm": 1,
        "f32_output_gemm": 2,
        "bf16_output_gemm": 1,
        "other_gemm": 1,
        "f8_transpose": 1,
    }


def test_the_shell_scripts_parse():
    for name in ("run.sh", "wheelhouse.sh"):
        subprocess.run(["bash", "-n", str(GPU / name)], check=True)


def test_each_variant_notes_a_failure_and_stops_when_out_of_time():
    script = _script()
    built = []

    def build(name):
        if name == "b":
            raise RuntimeError("no device")
        built.append(name)
        return object()

    note = script.each_variant(
        ["a", "b", "c"], script.Clock(60), False, build, lambda n, m: None
    )
    assert built == ["a", "c"]
    assert note == "b failed: RuntimeError: no device"
    note = script.each_variant(
        ["a"], script.Clock(-1), False, build, lambda n, m: None
    )
    assert note == "out of time before a"
    assert built == ["a", "c"]
    with pytest.raises(RuntimeError, match="no device"):
        script.each_variant(
            ["b"], script.Clock(60), True, build, lambda n, m: None
        )

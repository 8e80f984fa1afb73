"""`benchmarks/convergence.py --smoke` (issue 49) trains its tiny decoder
on the standard library's bytes and prints a table of finite eval losses,
its data split is the same from one run to the next, and a variant name it
does not know stops it with the list of names.

JAX only, to keep CI short: the script's code is the same on every
backend, and `tests/benchmarks_test.py` leaves it to this module.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from keras_mp.testing import run_script

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "convergence.py"
_DATA = re.compile(r"data: (\d+) \.py files .* file-list sha1 ([0-9a-f]{12})")
_ROW = re.compile(
    r"^\| (\S+)(?: \(noise floor\))? \| (\d+) \| (\S+) \|", re.MULTILINE
)

pytestmark = pytest.mark.backends("jax")


@pytest.mark.slow
def test_smoke_run_prints_finite_losses_and_a_deterministic_split(tmp_path):
    out = tmp_path / "convergence"
    stdout = run_script(
        SCRIPT, "--smoke", "--out", str(out), env={"MPLBACKEND": "Agg"}
    )
    found = _ROW.findall(stdout)
    rows = {name: loss for name, _, loss in found}
    layers = {name: int(count) for name, count, _ in found}
    assert set(rows) >= {"mixed_bfloat16", "fp8_tensorwise"}, stdout
    for name, loss in rows.items():
        assert 0.0 < float(loss) < 10.0, (name, loss)
    assert layers["mixed_bfloat16"] == 0 and layers["fp8_tensorwise"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
    assert "fp8_tensorwise" in out.with_suffix(".md").read_text()
    first = _DATA.search(stdout)
    again = _DATA.search(run_script(SCRIPT, "--data-only"))
    assert first is not None and again is not None, stdout
    assert first.groups() == again.groups()
    assert int(first.group(1)) > 100


def test_an_unknown_variant_name_stops_the_script_with_the_names():
    env = dict(os.environ, PYTHONPATH=str(ROOT), KERAS_BACKEND="jax")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--variants", "mixed_bfloat16,fp9"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "unknown: ['fp9']" in result.stderr
    assert "fp8_tensorwise" in result.stderr


def test_an_fp8_variant_without_fp8_layers_meets_no_target():
    # At a size where a recipe's rules quantize no layer (block scaling at a
    # width that is no multiple of 128), its row is mixed_bfloat16's own:
    # the table says so instead of "yes".
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("convergence", SCRIPT)
    convergence = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convergence)
    args = argparse.Namespace(
        variants=["mixed_bfloat16", "fp8_block", "fp8_tensorwise"]
    )
    finals = {name: [2.5, 2.6] for name in args.variants}
    layers = {"mixed_bfloat16": 0, "fp8_block": 0, "fp8_tensorwise": 12}
    table = convergence.format_table(args, finals, layers)
    rows = {line.split(" | ")[0][2:]: line for line in table.splitlines()}
    assert rows["fp8_block"].endswith("| n/a: no FP8 layer at this size |")
    assert rows["fp8_block"].startswith("| fp8_block | 0 |")
    assert rows["fp8_tensorwise"].endswith("| ≤ 0.0100 | yes |")

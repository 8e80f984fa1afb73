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
_ROW = re.compile(r"^\| (\S+)(?: \(noise floor\))? \| (\S+) \|", re.MULTILINE)

pytestmark = pytest.mark.backends("jax")


@pytest.mark.slow
def test_smoke_run_prints_finite_losses_and_a_deterministic_split(tmp_path):
    out = tmp_path / "convergence"
    stdout = run_script(
        SCRIPT, "--smoke", "--out", str(out), env={"MPLBACKEND": "Agg"}
    )
    rows = dict(_ROW.findall(stdout))
    assert set(rows) >= {"mixed_bfloat16", "fp8_tensorwise"}, stdout
    for name, loss in rows.items():
        assert 0.0 < float(loss) < 10.0, (name, loss)
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

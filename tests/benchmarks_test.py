"""Every script in benchmarks/ runs to the end on this backend.

Each runs in a fresh interpreter, on the backend of the test session, with
the smallest flags it defines: `--quick` where it has one (the script then
picks its own tiny step counts), else `--steps 2 --repeats 1` and, where
defined, one warm-up and one check step. The flags are read from the
script's `add_argument("--...")` calls, so new scripts are picked up by the
glob; one with neither `--quick` nor `--steps` and `--repeats` fails with a
message saying so. The output must hold the comparison the benchmark exists
for: a ratio (`a/b = 1.234`, or a table row `a/b  1.234`) or a speed-up
column (`1.23x`). A script
named `*_<backend>.py` runs only on that backend.
"""

import pathlib
import re

import keras
import pytest

from keras_mp.testing import run_script
from keras_mp.testing import script_backend

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = sorted(ROOT.glob("benchmarks/*.py"))

# The smallest value of each step-count flag a benchmark may define.
_SMALLEST = {
    "--steps": "2",
    "--repeats": "1",
    "--warmup-steps": "1",
    "--check-steps": "1",
    "--float16-steps": "1",
}
_FLAG = re.compile(r"add_argument\(\s*[\"'](--[\w-]+)[\"']")
# `a/b = 1.234`, a ratio table's row `a/b   1.234   1.201`, or `1.23x`.
_RATIO = re.compile(r"\w+/\w+(?: =|\s)\s*\d+\.\d+|\d+\.\d+x\b")


def smallest_flags(script):
    """The command-line flags that make `script` run the fewest steps."""
    flags = set(_FLAG.findall(script.read_text()))
    if "--quick" in flags:
        return ["--quick"]
    if not {"--steps", "--repeats"} <= flags:
        raise AssertionError(
            f"{script.name} defines neither --quick nor both --steps and "
            f"--repeats (it defines {sorted(flags)}), so it cannot be run "
            "briefly. Add one of them to the script."
        )
    args = []
    for flag, value in _SMALLEST.items():
        if flag in flags:
            args += [flag, value]
    return args


# Scripts with their own test module, which runs them on one backend.
_OWN_TEST = {"convergence.py": "tests/convergence_smoke_test.py (JAX)"}

# Flags added on TensorFlow, where a benchmark can also compile its step
# with XLA or time another loop on request: one run checks both, with what
# it must then print.
_ON_TENSORFLOW = {
    "optimizer_state_memory.py": (["--jit-compile"], "xla=True"),
    # Its other loop, where TensorFlow's `fit` times are bimodal.
    "fp8_step_time.py": (["--loop", "train_on_batch"], "loop=train_on_batch"),
}


def test_benchmarks_are_found():
    names = {path.name for path in SCRIPTS}
    assert {"loss_scale_overhead.py", "transform_chain_overhead.py"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_benchmark_runs_with_the_smallest_flags_and_prints_a_ratio(script):
    if script.name in _OWN_TEST:
        pytest.skip(f"{script.name} runs in {_OWN_TEST[script.name]}")
    only = script_backend(script)
    if only is not None and only != keras.backend.backend():
        pytest.skip(f"{script.name} runs on the {only} backend only")
    args = smallest_flags(script)
    expected = None
    if (
        keras.backend.backend() == "tensorflow"
        and script.name in _ON_TENSORFLOW
    ):
        extra, expected = _ON_TENSORFLOW[script.name]
        args += extra
    stdout = run_script(script, *args, env={"KERAS_MP_QUICK": "1"}, timeout=300)
    assert _RATIO.search(stdout), (
        f"{script.name} {' '.join(args)} printed no ratio (`a/b = 1.234` "
        f"or `a/b  1.234`) nor speed-up (`1.23x`):\n{stdout[-4000:]}"
    )
    if expected is not None:
        assert expected in stdout, stdout[-4000:]

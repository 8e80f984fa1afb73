"""Child processes of the tests (fresh interpreters, scripts on the
active backend, frameworks hidden from them) and the machine's
description for a benchmark's header."""

import atexit
import functools
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap


def describe_machine():
    """The CPU's model name and core count, for a benchmark's header."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def run_python(code, env=None, timeout=600):
    """Runs Python code in a fresh interpreter and returns its stdout.

    Needed where state must be set before a backend is imported (JAX's host
    device count, TensorFlow's logical devices) or where a fresh process is
    the point (loading a saved model with no global policy set).

    Raises:
        AssertionError: with the child's output, if it exits non-zero.
    """
    return _run_child(["-c", textwrap.dedent(code)], env, timeout, None)


def run_triton_interpreted(code, timeout=900):
    """Runs Python code in a fresh PyTorch process under Triton's
    interpreter (`TRITON_INTERPRET=1`) and returns its stdout: how a test
    runs keras_mp's CUDA kernels on a CPU. A fresh process, as
    `TRITON_INTERPRET` is read when Triton is imported, and Triton's LLVM
    clashes with TensorFlow's in one process. The child imports the
    keras_mp this one does (its folder first on `PYTHONPATH`).

    Raises:
        AssertionError: with the child's output, if it exits non-zero.
    """
    package = pathlib.Path(__file__).resolve().parents[2]
    paths = [str(package), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {
        "TRITON_INTERPRET": "1",
        "KERAS_BACKEND": "torch",
        "PYTHONPATH": os.pathsep.join(paths),
    }
    return run_python(code, env=env, timeout=timeout)


def run_script(path, *args, env=None, timeout=600):
    """Runs a script (a guide, an example, a benchmark) on the active backend.

    The child runs from the repository root with the same `KERAS_BACKEND`,
    the repository on `PYTHONPATH` and `env` on top. On a backend other
    than TensorFlow, TensorFlow cannot be imported there (as on most
    machines of JAX and PyTorch users): Keras would import it, 2 s a script.

    Returns:
        The child's stdout.

    Raises:
        AssertionError: with the child's output, if it exits non-zero.
    """
    import keras

    path = pathlib.Path(path).resolve()
    root = path.parent.parent
    backend = keras.backend.backend()
    paths = [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    if backend != "tensorflow":
        paths.insert(0, without_modules("tensorflow"))
    full_env = {"KERAS_BACKEND": backend, "PYTHONPATH": os.pathsep.join(paths)}
    full_env.update(env or {})
    return _run_child([str(path), *args], full_env, timeout, root)


_HIDDEN_MODULE = """\
# Stands in for {name} in a child process that keras_mp.testing runs as on a
# machine without it: `run_script` runs guides, examples and benchmarks on
# JAX and PyTorch without TensorFlow, where most users of those backends
# are (TensorFlow is installed for the suite's TensorFlow run, and Keras
# imports it whenever it can: 2 s of every script); the tests of imports
# hide the other backends' frameworks.
raise ImportError(
    "{name} is hidden from this process by keras_mp.testing, to run as on "
    "a machine without it."
)
"""


@functools.cache
def without_modules(*names):
    """A folder whose modules `names` (e.g. `"tensorflow"`) fail to import
    with an ImportError: put it first on a child process's `PYTHONPATH`
    (`run_python`'s `env`) to run as on a machine without them. Made once
    per process for each `names` (and removed at exit)."""
    folder = tempfile.mkdtemp(prefix="keras_mp_without_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    for name in names:
        text = _HIDDEN_MODULE.format(name=name)
        pathlib.Path(folder, f"{name}.py").write_text(text)
    return folder


_BACKENDS = ("tensorflow", "jax", "torch", "numpy", "openvino")


def script_backend(path):
    """The backend a script is for (`*_jax.py`, ...), or None for any."""
    stem = pathlib.Path(path).stem
    for backend in _BACKENDS:
        if stem.endswith(f"_{backend}"):
            return backend
    return None


def _run_child(argv, env, timeout, cwd):
    full_env = dict(os.environ)
    full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    full_env.update(env or {})
    result = subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, (
        f"{' '.join(argv[:1] if argv[0] == '-c' else argv)} exited "
        f"{result.returncode}\nstdout:\n{result.stdout[-4000:]}\n"
        f"stderr:\n{result.stderr[-6000:]}"
    )
    return result.stdout

"""Runs the guides and keeps what they print and plot, for the docs site.

Each `guides/*.py` runs in a fresh interpreter from the repository root, on
one Keras backend (JAX unless `--backend` says otherwise), with matplotlib's
Agg backend and, where the guide takes `--plot`, its PNG written next to its
output. Per guide, `guides/_rendered/<name>/` then holds `output.txt` (the
guide's stdout), `stderr.txt`, the PNG and `run.json` (the command, the
mode, the backend, the seconds it took, the versions). `guides/site_tools/
hooks.py` turns them into the site's guide pages at `mkdocs build` time.

A guide runs in full (its default step counts) unless it is in `QUICK`,
where it runs with `KERAS_MP_QUICK=1` (a few steps, as `tests/guides_test.py`
runs every guide): those take minutes in full on a 2-core CPU, too long for
every CI run. `--full` runs every guide in full, `--quick` every guide quick.

    python guides/site_tools/render_guides.py            # 8 CPU-minutes
    python guides/site_tools/render_guides.py --full     # the full guides
    python guides/site_tools/render_guides.py fp8_training  # one guide
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
GUIDES = ROOT / "guides"
RENDERED = GUIDES / "_rendered"

# Guides that run with KERAS_MP_QUICK=1 by default (see the docstring).
QUICK = frozenset({"fp8_training", "precision_and_memory"})

# A JAX or PyTorch run imports no TensorFlow (as on most of their users'
# machines): Keras would import it whenever it can, 2 s a guide.
_NO_TENSORFLOW = "raise ImportError('TensorFlow is hidden from this guide')\n"


def _versions():
    versions = {"python": platform.python_version()}
    for name in ("keras", "jax", "tensorflow", "torch", "numpy"):
        try:
            from importlib import metadata

            versions[name] = metadata.version(name)
        except Exception:  # noqa: BLE001 (not installed)
            continue
    return versions


def _children_cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def render(guide, backend, quick, timeout):
    """Runs one guide; returns its `run.json` record."""
    out = RENDERED / guide.stem
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    args = [str(guide.relative_to(ROOT))]
    if "--plot" in guide.read_text():
        args += ["--plot", str(out / f"{guide.stem}.png")]
    env = dict(os.environ)
    env.update(
        KERAS_BACKEND=backend,
        MPLBACKEND="Agg",
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
        ),
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.pop("KERAS_MP_QUICK", None)
    if quick:
        env["KERAS_MP_QUICK"] = "1"
    with tempfile.TemporaryDirectory() as hidden:
        if backend != "tensorflow":
            pathlib.Path(hidden, "tensorflow.py").write_text(_NO_TENSORFLOW)
            env["PYTHONPATH"] = os.pathsep.join([hidden, env["PYTHONPATH"]])
        load = os.getloadavg()[0]
        start = time.perf_counter()
        cpu_before = _children_cpu_seconds()
        result = subprocess.run(
            [sys.executable, *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        seconds = time.perf_counter() - start
        cpu_seconds = _children_cpu_seconds() - cpu_before
    (out / "output.txt").write_text(result.stdout)
    (out / "stderr.txt").write_text(result.stderr)
    if result.returncode != 0:
        raise SystemExit(
            f"{guide.name} exited {result.returncode} on {backend}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    command = " ".join(["python", *args[:1]])
    if quick:
        command = f"KERAS_MP_QUICK=1 {command}"
    record = {
        "guide": guide.name,
        "command": f"KERAS_BACKEND={backend} {command}",
        "backend": backend,
        "quick": quick,
        "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu_seconds, 1),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "load_average": round(load, 1),
        "versions": _versions(),
        "plots": sorted(p.name for p in out.glob("*.png")),
    }
    (out / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("guides", nargs="*", help="names (default: all)")
    parser.add_argument("--backend", default="jax")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true", help="no guide quick")
    mode.add_argument("--quick", action="store_true", help="every guide quick")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    guides = sorted(GUIDES.glob("*.py"))
    if args.guides:
        wanted = {name.removesuffix(".py") for name in args.guides}
        unknown = wanted - {g.stem for g in guides}
        if unknown:
            raise SystemExit(
                f"Unknown guides: {sorted(unknown)}. Expected names from "
                f"{[g.stem for g in guides]}."
            )
        guides = [g for g in guides if g.stem in wanted]
    total = time.perf_counter()
    for guide in guides:
        quick = args.quick or (not args.full and guide.stem in QUICK)
        record = render(guide, args.backend, quick, args.timeout)
        mode_name = "quick" if quick else "full"
        print(
            f"{guide.name:34s} {mode_name:5s} {record['seconds']:6.1f} s "
            f"({record['cpu_seconds']:6.1f} s CPU)  "
            f"{', '.join(record['plots']) or '(no plot)'}",
            flush=True,
        )
    print(
        f"rendered {len(guides)} guides in {time.perf_counter() - total:.0f} s"
    )


if __name__ == "__main__":
    main()

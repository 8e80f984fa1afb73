#!/usr/bin/env bash
# Builds the wheelhouse `run.sh` installs from on a GPU machine with no
# package index: keras (the version of this environment) and every wheel it
# needs, for CPython 3.12 on x86-64 Linux (the GPU image's Python), plus
# this package's own wheel, and keras-hub (this environment's version) with
# the two of its requirements its GPT-2 imports, regex and tokenizers: the
# others (tensorflow-text, which brings TensorFlow, kagglehub, sentencepiece)
# are left out, as keras_hub imports without them. Run it here, from
# anywhere, with network access:
#
#     bash benchmarks/gpu/wheelhouse.sh          # writes <repo>/.whl/
#
# `.whl/` is git-ignored; pass it to the GPU run as a carried path. About
# 33 MB (numpy's wheel is 16 MB of it, keras-hub's three 6 MB; `run.sh`
# installs only what the image lacks).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WHEELS="${WHEELS:-$ROOT/.whl}"
PYTHON="${PYTHON:-python}"
PY_VERSION="${PY_VERSION:-3.12}"
KERAS_VERSION="$("$PYTHON" -c 'import keras; print(keras.__version__)')"
# keras-hub and the two it needs, at this environment's versions.
HUB_PINS="$("$PYTHON" -c 'import importlib.metadata as m
print(" ".join(f"{n}=={m.version(n)}" for n in ("keras-hub", "regex", "tokenizers")))')"
mkdir -p "$WHEELS"
rm -f "$WHEELS"/keras_mp-*.whl
download() {
  "$PYTHON" -m pip download --quiet --dest "$WHEELS" --only-binary=:all: \
    --python-version "$PY_VERSION" --implementation cp \
    --abi "cp${PY_VERSION/./}" --abi abi3 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any "$@"
}
download "keras==$KERAS_VERSION"
# shellcheck disable=SC2086
download --no-deps $HUB_PINS
# torchao, section i's PyTorch peer, at this environment's version (CI's
# constraint); pure Python for float8 training, without dependencies.
TORCHAO_PIN="$("$PYTHON" -c 'import importlib.metadata as m
print("torchao==" + m.version("torchao"))')"
download --no-deps "$TORCHAO_PIN"
"$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation \
  --wheel-dir "$WHEELS" "$ROOT"
ls -l "$WHEELS"
du -sh "$WHEELS"

#!/usr/bin/env bash
# The one prepared GPU run of issue 32 (at most 9.5 minutes, set-up
# included: run it with the device tool's timeout_s=600).
#
# On a GPU machine whose image has PyTorch and JAX but no Keras and no
# package index, from the repository root, with the wheelhouse of
# `wheelhouse.sh` carried in `.whl/`:
#
#     bash benchmarks/gpu/run.sh            # results in $OUT (default ./gpu_out)
#     SMOKE=1 bash benchmarks/gpu/run.sh    # toy sizes, any machine
#
# 1. Installs what the image lacks from `.whl/` (`pip install --no-index
#    --find-links`, into a temporary folder put on PYTHONPATH): keras, its
#    dependencies, keras-hub (the GPT-2 section's model) and keras_mp's
#    own wheel. Writes `$OUT/env.txt`: the device, its driver and the
#    versions measured.
# 2. Runs `fp8_speed.py` once per backend (torch, then jax), each in one
#    process with its own time budget; a section out of time is skipped
#    and says so. `timeout` stops a process that overruns its budget by
#    SLACK seconds: the JSON written after each section survives.
# 3. Writes `$OUT/<backend>.json`, `$OUT/<backend>.log` and `$OUT/table.md`
#    (one markdown table with the device's name), and prints the table.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu_out}"
WHEELS="${WHEELS:-$ROOT/.whl}"
PYTHON="${PYTHON:-python3}"
# Seconds of sections per backend; `timeout` allows SLACK more (imports,
# the one measurement a section finishes after its time is up). The
# defaults end within 9.5 minutes, set-up included, on an H100.
TORCH_BUDGET="${TORCH_BUDGET:-190}"
JAX_BUDGET="${JAX_BUDGET:-300}"
SLACK="${SLACK:-30}"
# Letters of the sections per backend (fp8_speed.py --sections); set
# empty (TORCH_SECTIONS=), that backend is not run.
# The GPT-2 section (h) takes a fifth of each budget, and what the others
# leave (fp8_speed.py's WEIGHTS says how it was sized): the budgets stay.
# Section i (torchao's float8 training on the same decoder, PyTorch only)
# runs right after the decoders: run 5's torch sections used 55 s of 190.
TORCH_SECTIONS="${TORCH_SECTIONS-abcdefghi}"
JAX_SECTIONS="${JAX_SECTIONS-abcdefgh}"
# XLA autotunes each GEMM shape over dozens of Triton kernels: on the
# H100, 10 s per 8192^3 GEMM and minutes for an FP8 decoder step, which
# used up the JAX budget before its first decoder. cuBLAS(Lt) serves every
# GEMM instead, bf16 and FP8 alike (as PyTorch's), its algorithm still
# autotuned: the four decoders compiled in 41 s on an H200. Add
# `--xla_gpu_autotune_level=0` for cuBLAS's heuristics alone (an FP8 GEMM
# 1.76x bf16's on the H100, where the autotuned ones measured 1.8 to 2).
JAX_XLA_FLAGS="${JAX_XLA_FLAGS---xla_gpu_enable_triton_gemm=false}"
mkdir -p "$OUT"
START=$SECONDS

SITE="$(mktemp -d /tmp/keras_mp_site.XXXXXX)"
# Only the distributions the image lacks: the image's numpy and ml_dtypes
# (which its JAX and PyTorch were built against) stay as they are.
MISSING="$("$PYTHON" - "$WHEELS" <<'PY'
import importlib.metadata as metadata
import pathlib
import sys

missing = []
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name = wheel.name.split("-")[0]
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        missing.append(str(wheel))
print(" ".join(missing))
PY
)"
if [ -n "$MISSING" ]; then
  # shellcheck disable=SC2086
  "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" \
    --no-deps --target "$SITE" $MISSING || exit 1
fi
# The checkout first: its keras_mp is the one measured (the wheel proves
# the package installs; a stale one cannot shadow the source).
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export TF_CPP_MIN_LOG_LEVEL=2
KERAS_BACKEND=torch "$PYTHON" -c 'import keras, keras_mp; print("keras", keras.__version__, "keras_mp from", keras_mp.__file__)'
echo "install: $((SECONDS - START)) s"
# What ran: the device, its driver and the versions measured.
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
    --format=csv 2>&1
  "$PYTHON" -m pip list 2>/dev/null |
    grep -i -E '^(torch|jax|jaxlib|jax-cuda|triton|numpy|ml.dtypes|keras|keras.hub|optree) '
  nproc
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

for triple in "torch:$TORCH_BUDGET:$TORCH_SECTIONS" \
  "jax:$JAX_BUDGET:$JAX_SECTIONS"; do
  IFS=: read -r backend budget sections <<<"$triple"
  [ -n "$sections" ] || continue
  echo "== $backend (budget $budget s, sections $sections)"
  flags="${XLA_FLAGS:-}"
  [ "$backend" = jax ] && flags="$flags $JAX_XLA_FLAGS"
  KERAS_BACKEND="$backend" XLA_FLAGS="$flags" \
    timeout "$((budget + SLACK))" "$PYTHON" benchmarks/gpu/fp8_speed.py \
    --out "$OUT" --budget "$budget" --sections "$sections" ${SMOKE:+--smoke} \
    >"$OUT/$backend.log" 2>&1
  echo "$backend exit $? after $((SECONDS - START)) s"
  grep -E '^\[|^# ' "$OUT/$backend.log"
done
"$PYTHON" benchmarks/gpu/fp8_speed.py --table "$OUT"
echo "total: $((SECONDS - START)) s"

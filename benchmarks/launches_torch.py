"""Kernel launches per PyTorch training step, per FP8 recipe and state dtype.

On an H200 an eager PyTorch step pays about 20 us of host time per kernel
launch (`shared/research/torch_gpu_overheads.md`), so the launches of a
step are what issue 46's speed targets come down to, and a CPU can count
them: `keras_mp.testing.count_torch_launches` counts the ATen operations
that queue a kernel (views and allocations left out) and the Triton
launches of one `train_on_batch`, after two warm-up steps.

The model is issue 46's: a keras-hub `GPT2CausalLM` of 2 layers, width 256
(12 FP8 GEMM layers where a recipe is on, 36 trainable variables), under
mixed_bfloat16 with Keras's Adam. Printed per variant: the launches of a
step, the views, the ratio to the bf16 step's launches, and the launches
added per FP8 layer (FP8 variants) or per trainable variable (state
dtypes) over the bf16 step; then the bytes held between steps beyond the
variables (`keras_mp.testing.held_torch_bytes`) and those one step saves
for its backward (`saved_activation_bytes`), issue 46 item 5:

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 python benchmarks/launches_torch.py

On a CPU, keras_mp's PyTorch code takes the CUDA device's branches only
where it does not choose by the device (FP8 tensors, `_scaled_mm` and the
Triton kernels are CUDA's alone), so the counts are the CPU path's.
"""

# ruff: noqa: E402 (the variable below must be set before TensorFlow loads)
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse

import keras
import numpy as np

import keras_mp
from keras_mp.testing import count_torch_launches
from keras_mp.testing import held_torch_bytes
from keras_mp.testing import saved_activation_bytes

VARIANTS = {
    "bf16": (None, None),
    "fp8 current": (True, None),
    "fp8 delayed": (keras_mp.fp8.Recipe(scaling="delayed"), None),
    "fp8 rowwise": (keras_mp.fp8.Recipe(granularity="rowwise"), None),
    "bf16 state": (None, "bfloat16"),
    "float8 state": (None, "float8"),
}
VOCAB, SEQUENCE, BATCH = 512, 64, 8


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--steps", type=int, default=3, help="counted steps per variant"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="warm-up rounds of two steps before counting",
    )
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--gpu-codes",
        action="store_true",
        help="FP8 layers keep FP8 codes and multiply them with torch's "
        "`_scaled_mm`, as on a CUDA device (a CPU's default keeps float32 "
        "values on the FP8 grid, 4 bytes an element, for its bfloat16 "
        "matmul)",
    )
    parser.add_argument(
        "--triton",
        action="store_true",
        help="with --gpu-codes, the FP8 operands and scales made by "
        "keras_mp's Triton kernels, as on a CUDA device, run by Triton's "
        "interpreter (needs triton, and TRITON_INTERPRET=1 set before the "
        "process starts; each kernel counts as the one launch it is on a "
        "GPU)",
    )
    args = parser.parse_args(argv)
    if args.triton and not (
        args.gpu_codes and os.environ.get("TRITON_INTERPRET") == "1"
    ):
        parser.error(
            "--triton runs the CUDA kernels under Triton's interpreter: "
            "pass --gpu-codes too and set TRITON_INTERPRET=1, e.g. "
            "`TRITON_INTERPRET=1 python benchmarks/launches_torch.py "
            "--gpu-codes --triton`"
        )
    for name in ("steps", "repeats", "width", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.width % 4:
        parser.error(f"--width must be a multiple of 4; received {args.width}")
    return args


def build(args, fp8, state_dtype):
    import keras_hub

    keras.utils.set_random_seed(0)
    with keras_mp.policy_scope("mixed_bfloat16", fp8=fp8):
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCAB,
            num_layers=args.layers,
            num_heads=4,
            hidden_dim=args.width,
            intermediate_dim=4 * args.width,
            max_sequence_length=SEQUENCE,
        )
        model = keras_hub.models.GPT2CausalLM(
            backbone=backbone, preprocessor=None
        )
    optimizer = keras.optimizers.Adam(1e-4)
    if state_dtype is not None:
        optimizer = keras_mp.OptimizerWrapper(
            optimizer, state_dtype=state_dtype
        )
    model.compile(
        optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def fp8_layers(model):
    return sum(
        1
        for layer in model._flatten_layers()
        if getattr(getattr(layer, "dtype_policy", None), "fp8", None)
    )


def count(args, fp8, state_dtype):
    model = build(args, fp8, state_dtype)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (BATCH, SEQUENCE + 1))
    x = {
        "token_ids": tokens[:, :-1],
        "padding_mask": np.ones((BATCH, SEQUENCE), bool),
    }
    y = tokens[:, 1:]
    for _ in range(2 * args.repeats):
        model.train_on_batch(x, y)
    counts = []
    for _ in range(args.steps):
        with count_torch_launches() as counted:
            model.train_on_batch(x, y)
        counts.append(counted)
    launches = {c.launches for c in counts}
    if len(launches) != 1:
        raise RuntimeError(
            f"the steps counted {sorted(launches)} launches: a step should "
            "count the same as the one before it"
        )
    memory = (
        held_torch_bytes(model, model.optimizer),
        saved_activation_bytes(model, x, y, model.loss),
    )
    return counts[0], fp8_layers(model), len(model.trainable_variables), memory


def main(argv=None):
    args = parse_args(argv)
    if keras.backend.backend() != "torch":
        raise SystemExit(
            "launches_torch.py counts PyTorch's kernel launches; run it "
            "with KERAS_BACKEND=torch"
        )
    if args.gpu_codes:
        from keras_mp.backend import fp8 as backend_fp8

        backend_fp8.SCALED_MM_ON_CPU = True
    if args.triton:
        from keras_mp.backend.torch import fp8_operands

        fp8_operands.FORCED = "triton"
    print(
        f"keras-hub GPT2CausalLM: {args.layers} layers, width {args.width}, "
        f"batch {BATCH}x{SEQUENCE}, mixed_bfloat16, Adam; "
        f"one train_on_batch after {2 * args.repeats} warm-up steps; "
        + (
            "FP8 codes and _scaled_mm (--gpu-codes)"
            + (", Triton's kernels (--triton)" if args.triton else "")
            if args.gpu_codes
            else "a CPU's FP8 path"
        )
    )
    rows = {}
    for name, (fp8, state_dtype) in VARIANTS.items():
        rows[name] = count(args, fp8, state_dtype)
    memory = {name: row[3] for name, row in rows.items()}
    rows = {name: row[:3] for name, row in rows.items()}
    base = rows["bf16"][0].launches
    print(
        f"{'variant':<14}{'launches':>10}{'views':>8}{'triton':>8}"
        "  launches / bf16's        added"
    )
    for name, (counted, layers, variables) in rows.items():
        added = counted.launches - base
        if name == "bf16":
            per = ""
        elif name.startswith("fp8"):
            per = f"{added / max(layers, 1):+.0f} per FP8 layer ({layers})"
        else:
            per = f"{added / variables:+.0f} per variable ({variables})"
        print(
            f"{name:<14}{counted.launches:>10}{counted.views:>8}"
            f"{sum(counted.triton.values()):>8}"
            f"  {name.replace(' ', '_')}/bf16 = {counted.launches / base:.3f}   {per}"
        )
    print(
        "\nBytes held between steps beyond the model's and the optimizer's "
        "variables (Keras's gradients left in `.grad`, keras_mp's caches), "
        "and saved by one step for its backward:"
    )
    print(
        f"{'variant':<14}{'held':>12}{'vs bf16':>10}{'saved':>12}{'vs bf16':>10}"
    )
    held_base, saved_base = memory["bf16"]
    for name, (held, saved) in memory.items():
        print(
            f"{name:<14}{held:>12,}{held - held_base:>+10,}"
            f"{saved:>12,}{saved / saved_base:>10.3f}"
        )
    print("\nThe busiest ATen operations of each step:")
    for name, (counted, _, _) in rows.items():
        top = ", ".join(f"{op[6:]} {n}" for op, n in counted.ops.most_common(6))
        print(f"  {name:<14}{top}")


if __name__ == "__main__":
    main()

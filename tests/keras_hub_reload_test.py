"""keras-hub tasks reload with their keras_mp optimizer (issue 48, item 1).

A keras-hub `Task` overrides `compile()`, so Keras's `load_model` does not
call it: the task kept the default optimizer its constructor compiled, and
the saved optimizer's variables loaded into it only where their layout
happened to match. Each test here trains a tiny task built from config
(`GPT2CausalLM`, `BertTextClassifier`; no download), saves it, loads it in
a fresh process with only `import keras_mp`, trains on, and compares every
weight and optimizer variable, bit for bit, with a run that never stopped.

Cheap by design (CI's budget is nearly used): this process trains each
variant, saves it and trains on (the reference); one child process per
backend loads every file and trains on, and sends its arrays back in an
`.npz`.
"""

import json
import os
import re

import keras
import keras_hub
import numpy as np
import pytest

import keras_mp
from keras_mp.testing import run_python

VOCAB, SEQ, SAMPLES, BATCH = 32, 8, 12, 4  # 3 steps an epoch


# One tiny backbone shape for both tasks.
_BACKBONE = dict(
    vocabulary_size=VOCAB,
    num_layers=1,
    num_heads=2,
    hidden_dim=16,
    intermediate_dim=32,
    dropout=0.0,
    max_sequence_length=SEQ,
)


def _gpt2(dtype=None):
    backbone = keras_hub.models.GPT2Backbone(**_BACKBONE, dtype=dtype)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _bert(dtype=None):
    backbone = keras_hub.models.BertBackbone(**_BACKBONE, dtype=dtype)
    return keras_hub.models.BertTextClassifier(
        backbone=backbone, num_classes=2, preprocessor=None, dropout=0.0
    )


def _data():
    """Both tasks' inputs and targets, as flat NumPy arrays by name."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (SAMPLES, SEQ + 1)).astype("int32")
    return {
        "token_ids": tokens[:, :-1],
        "next_tokens": tokens[:, 1:],
        "segment_ids": np.zeros((SAMPLES, SEQ), "int32"),
        "padding_mask": np.ones((SAMPLES, SEQ), "bool"),
        "labels": (tokens[:, 0] % 2).astype("int32"),
    }


def _inputs(task, data):
    if task == "gpt2":
        keys = ("token_ids", "padding_mask")
        return {k: data[k] for k in keys}, data["next_tokens"]
    keys = ("token_ids", "segment_ids", "padding_mask")
    return {k: data[k] for k in keys}, data["labels"]


_LOSS_SCALED_POLICY = (
    "mixed_bfloat16" if keras.backend.backend() == "jax" else "mixed_float16"
)

# Each variant: its task, the global policy (a name or Policy, and
# `set_global_policy`'s keywords), the backbone's own dtype, and the
# optimizer `compile` is given. Under an FP8 recipe `compile` wraps it in a
# skipping LossScaleOptimizer of scale 1, under mixed_float16 in a dynamic
# one. Several features share a variant: each compile costs seconds.
VARIANTS = {
    # The run, with a stateful transform chain (an average and a
    # seed) and gradient accumulation: 3 steps an epoch, so the file is
    # saved in the middle of a window.
    "gpt2-float8_state-transforms-accumulation": (
        "gpt2",
        ("mixed_bfloat16", {"fp8": True}),
        None,
        lambda: keras_mp.OptimizerWrapper(
            keras.optimizers.Adam(1e-3, gradient_accumulation_steps=2),
            state_dtype="float8",
            transform_gradients=[
                keras_mp.transforms.AdaptiveClipByGlobalNorm(),
                keras_mp.transforms.GaussianNoise(stddev=1e-4, seed=1),
            ],
        ),
    ),
    "bert-bfloat16_state-master_weights": (
        "bert",
        (None, {}),
        "bfloat16",
        lambda: keras_mp.OptimizerWrapper(
            keras.optimizers.Adam(1e-3),
            state_dtype="bfloat16",
            master_weights=True,
        ),
    ),
    # A dynamic loss scale, with a short increment period: the scale grows
    # during the run. bfloat16 on JAX: XLA's CPU compiler refuses keras-hub's
    # float16 GEMMs ("The precision 'F16_F16_F32' is not supported by
    # dot_general on CPU").
    "bert-loss_scale": (
        "bert",
        (
            keras_mp.Policy(
                _LOSS_SCALED_POLICY,
                loss_scale=keras_mp.DynamicLossScale(
                    2.0**10, increment_period=2
                ),
            ),
            {},
        ),
        None,
        lambda: keras.optimizers.Adam(1e-3),
    ),
}

TASKS = {"gpt2": _gpt2, "bert": _bert}


def _bits(variable):
    """A variable's raw bytes, with its dtype and shape: equal bits only."""
    value = np.ascontiguousarray(keras.ops.convert_to_numpy(variable.value))
    return value.reshape(-1).view(np.uint8), f"{value.dtype}{value.shape}"


def _state(model):
    """`key -> raw bytes` of every weight, then every optimizer variable,
    and `key -> dtype, shape and name`: the name without its scopes (on
    TensorFlow a slot built by the first step has its optimizer's scope,
    one built on load has not) nor a number (`adam_2`: another process
    numbers them apart)."""
    arrays, kinds = {}, {}
    pairs = [
        ("weight", model.weights),
        ("optimizer", model.optimizer.variables),
    ]
    for prefix, variables in pairs:
        for i, variable in enumerate(variables):
            key = f"{prefix}{i}"
            arrays[key], kind = _bits(variable)
            name = re.sub(r"_[0-9]+", "", variable.path.split("/")[-1])
            kinds[key] = f"{kind} {name}"
    return arrays, kinds


def _describe(optimizer):
    names = []
    while optimizer is not None:
        names.append(type(optimizer).__name__)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return "/".join(names)


def _fit(model, task, data, **kwargs):
    x, y = _inputs(task, data)
    model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, **kwargs
    )


def _build(name):
    """The variant's task, built and compiled under its policy."""
    task, (policy, keywords), dtype, optimizer = VARIANTS[name]
    keras_mp.set_global_policy(policy, **keywords)
    try:
        keras.utils.set_random_seed(0)
        model = TASKS[task](dtype)
        model.compile(optimizer=optimizer())
    finally:
        keras_mp.set_global_policy(None)
    return model


# The preemption callbacks, each on one variant. `ModelCheckpoint` writes
# its `.keras` file with `model.save`, and a resumed run reads it with
# `load_model`. `BackupAndRestore` writes a `.weights.h5` file, which a
# fresh run of the same script loads into the model it builds and
# compiles: on the cheapest variant, as it costs the child one more
# compile.
_CHECKPOINT_VARIANT = "gpt2-float8_state-transforms-accumulation"
_BACKUP_VARIANT = "bert-loss_scale"


def _train_and_save(name, data, root):
    """Trains one epoch, saves `root/<name>.keras`, trains one more (the
    uninterrupted run), and returns its state and optimizer."""
    task = VARIANTS[name][0]
    path = os.path.join(root, f"{name}.keras")
    model = _build(name)
    callbacks = []
    if name == _BACKUP_VARIANT:
        backup = os.path.join(root, "backup")
        callbacks.append(
            keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)
        )
    if name == _CHECKPOINT_VARIANT:
        callbacks.append(keras.callbacks.ModelCheckpoint(path))
    _fit(model, task, data, callbacks=callbacks)
    if name != _CHECKPOINT_VARIANT:
        model.save(path)
    _fit(model, task, data)
    state, kinds = _state(model)
    return state, kinds, _describe(model.optimizer)


# Runs in a fresh process with `import keras_mp` (and this module, for its
# helpers): each file loaded and trained for the second epoch; then the
# backup's variant built anew and resumed by `BackupAndRestore`. The state
# goes back as raw bytes.
_CHILD = """
import json
import sys

import keras
import numpy as np

import keras_mp  # noqa: F401

sys.path.insert(0, {tests!r})
import keras_hub_reload_test as t

root = {root!r}
data = dict(np.load(f"{{root}}/data.npz"))
arrays, kinds, optimizers = {{}}, {{}}, {{}}


def record(name, model):
    state, kind = t._state(model)
    arrays.update({{f"{{name}}:{{k}}": v for k, v in state.items()}})
    kinds.update({{f"{{name}}:{{k}}": v for k, v in kind.items()}})
    optimizers[name] = t._describe(model.optimizer)


for name, (task, *_) in t.VARIANTS.items():
    model = keras.saving.load_model(f"{{root}}/{{name}}.keras")
    t._fit(model, task, data)
    record(name, model)
name = t._BACKUP_VARIANT
model = t._build(name)
x, y = t._inputs(t.VARIANTS[name][0], data)
backup = keras.callbacks.BackupAndRestore(f"{{root}}/backup")
model.fit(
    x, y, batch_size=t.BATCH, epochs=2, shuffle=False, verbose=0,
    callbacks=[backup],
)
record("backup:" + name, model)
np.savez(f"{{root}}/resumed.npz", **arrays)
print(json.dumps({{"kinds": kinds, "optimizers": optimizers}}))
"""


def _tagged(name, mapping):
    return {f"{name}:{key}": value for key, value in mapping.items()}


@pytest.mark.slow
def test_keras_hub_tasks_resume_bit_identical_after_reload(tmp_path):
    """`load_model` (from `model.save` and from `ModelCheckpoint`) and
    `BackupAndRestore`, each in a fresh process: the weights and every
    optimizer variable after the next epoch equal the uninterrupted run's
    bit for bit, for every variant."""
    data = _data()
    np.savez(tmp_path / "data.npz", **data)
    expected, expected_kinds, expected_optimizers = {}, {}, {}
    for name in VARIANTS:
        state, kinds, optimizer = _train_and_save(name, data, str(tmp_path))
        for tag in [name] + ["backup:" + name] * (name == _BACKUP_VARIANT):
            expected.update(_tagged(tag, state))
            expected_kinds.update(_tagged(tag, kinds))
            expected_optimizers[tag] = optimizer
    child = _CHILD.format(tests=os.path.dirname(__file__), root=str(tmp_path))
    out = json.loads(run_python(child).strip().splitlines()[-1])
    resumed = dict(np.load(tmp_path / "resumed.npz"))
    # Per variant, every way it differs from the uninterrupted run: the
    # optimizer (and its wrappers) it came back with, then its variables'
    # dtypes, shapes and names, then their bits.
    problems = {}
    for tag, optimizer in expected_optimizers.items():
        if out["optimizers"].get(tag) != optimizer:
            problems.setdefault(tag, []).append(
                f"optimizer {out['optimizers'].get(tag)} != {optimizer}"
            )
    for key, kind in expected_kinds.items():
        tag = key.rsplit(":", 1)[0]
        if out["kinds"].get(key) != kind:
            problems.setdefault(tag, []).append(
                f"{out['kinds'].get(key)} != {kind}"
            )
        elif not np.array_equal(resumed[key], expected[key]):
            problems.setdefault(tag, []).append(f"bits of {kind}")
    assert not problems, {tag: found[:4] for tag, found in problems.items()}

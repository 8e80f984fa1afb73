"""Several processes, one skip decision: the engines users scale out to.

Two processes on 127.0.0.1 train one model, each on its half of every
global batch, and a NaN reaches the rows of one process only:

- JAX: `keras.distribution.initialize` joins the processes (CPU collectives
  over gloo, jax's default on CPU), `DataParallel` spans both processes'
  devices and `fit` trains; each process feeds its own rows
  (`auto_shard_dataset=False`).
- PyTorch: a gloo process group and a Keras model wrapped in
  `torch.nn.parallel.DistributedDataParallel`, trained with the loop of
  Keras's DDP guide (`model(x)`, `backward()`, then the optimizer), here
  `scale_loss` -> `backward()` -> `apply`. Also gradient accumulation under
  DDP's `no_sync`, and float16 all-reduce.

Every process must skip the NaN step (weights and optimizer slots unchanged
bit for bit), the processes must hold identical weights, and these must
match one process trained on the global batch. Each pair of processes runs
once per module and saves what it saw; the tests assert on it.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import assert_close

# A pair of processes training a tiny model; generous for a loaded 2-core
# CI machine (a pair takes about 15 s there). A hung collective can never
# block CI: both processes are killed after it.
TIMEOUT = 180

# Under pytest-xdist the module's tests share one worker, so its
# module-scoped children run once.
pytestmark = pytest.mark.xdist_group("multiprocess")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Shared by every process: data, model, optimizer and saving results.
_COMMON = textwrap.dedent(
    """
    import json
    import os

    import numpy as np

    OUT = os.environ["KERAS_MP_TEST_OUT"]
    RANK = int(os.environ["KERAS_MP_TEST_RANK"])
    results = {}
    arrays = {}

    rng = np.random.RandomState(0)
    # Two global batches of 16 rows; process r holds rows 8r to 8r+7 of each.
    x = rng.randn(32, 4).astype("float32")
    y = rng.randn(32, 1).astype("float32")
    # Row 15 is in process 1's half of the first global batch.
    poisoned = y.copy()
    poisoned[15] = np.nan


    def local_rows(batch):
        start = 16 * batch + 8 * RANK
        return slice(start, start + 8)


    def make_model():
        import keras

        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(8, activation="tanh", name="hidden"),
                keras.layers.Dense(1, name="out"),
            ]
        )


    def make_optimizer(**kwargs):
        import keras
        import keras_mp

        inner_kwargs = kwargs.pop("inner_kwargs", {})
        # PyTorch's two skips (decided on the host by default, or on the
        # device); the other backends accept the flag and ignore it.
        kwargs.setdefault(
            "skip_on_device",
            os.environ.get("KERAS_MP_TEST_SKIP_ON_DEVICE") == "1",
        )
        return keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9, **inner_kwargs),
            loss_scale=keras_mp.DynamicLossScale(2**10),
            **kwargs,
        )


    def to_numpy(value):
        import keras

        return np.asarray(keras.ops.convert_to_numpy(value))


    def state(model, optimizer):
        # Weights, then every inner optimizer variable (momentum slots).
        variables = model.weights + optimizer.inner_optimizer.variables
        return [to_numpy(v.value) for v in variables]


    def counters(optimizer):
        return {
            "loss_scale": float(to_numpy(optimizer.loss_scale())),
            "skipped_steps": int(to_numpy(optimizer.skipped_steps)),
            "iterations": int(to_numpy(optimizer.iterations)),
        }


    def save(key, values):
        for i, value in enumerate(values):
            arrays[f"{key}__{i}"] = np.asarray(value)


    def finish():
        np.savez(os.path.join(OUT, "arrays.npz"), **arrays)
        with open(os.path.join(OUT, "results.json"), "w") as f:
            json.dump(results, f)
    """
)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_if_running(process):
    if process.poll() is None:
        process.kill()
    process.wait()


def _run_processes(code, directory, env):
    """Runs `code` in two processes (ranks 0 and 1) and loads their results.

    Both are killed when one fails (the other would wait on its collectives
    forever) or when `TIMEOUT` passes.

    Returns:
        One `(results, arrays)` pair per rank.
    """
    base_env = {
        key: value
        for key, value in os.environ.items()
        if "proxy" not in key.lower()  # loopback only
    }
    directories = [os.path.join(directory, f"rank{r}") for r in range(2)]
    processes = []
    with contextlib.ExitStack() as stack:
        for rank, out in enumerate(directories):
            os.mkdir(out)
            log = stack.enter_context(open(os.path.join(out, "log.txt"), "w"))
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-c", _COMMON + textwrap.dedent(code)],
                    env={
                        **base_env,
                        "TF_CPP_MIN_LOG_LEVEL": "3",
                        **env,
                        "KERAS_MP_TEST_RANK": str(rank),
                        "KERAS_MP_TEST_OUT": out,
                    },
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            stack.callback(_kill_if_running, processes[-1])
        deadline = time.monotonic() + TIMEOUT
        while any(p.poll() is None for p in processes):
            if time.monotonic() > deadline or any(p.poll() for p in processes):
                break
            time.sleep(0.2)
    logs = []
    for out in directories:
        with open(os.path.join(out, "log.txt")) as log:
            logs.append(log.read())
    codes = [p.returncode for p in processes]
    assert codes == [0, 0], (
        f"exit codes {codes} (negative: killed after {TIMEOUT} s or after "
        "the other process failed)\n"
        + "\n".join(
            f"--- rank {r}:\n{log[-4000:]}" for r, log in enumerate(logs)
        )
    )
    loaded = []
    for out in directories:
        with open(os.path.join(out, "results.json")) as f:
            results = json.load(f)
        with np.load(os.path.join(out, "arrays.npz")) as saved:
            loaded.append((results, {key: saved[key] for key in saved.files}))
    return loaded


def _group(arrays, key):
    count = len([k for k in arrays if k.startswith(f"{key}__")])
    assert count, f"nothing saved under {key!r}"
    return [arrays[f"{key}__{i}"] for i in range(count)]


def _assert_all_bitwise_equal(actual, expected, msg):
    assert len(actual) == len(expected), msg
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_bitwise_equal(a, e, msg=f"{msg} [{i}]")


def _assert_processes_identical(ranks, key):
    (_, arrays_0), (_, arrays_1) = ranks
    _assert_all_bitwise_equal(
        _group(arrays_1, key), _group(arrays_0, key), f"processes differ: {key}"
    )


def _assert_skipped(results, arrays, prefix):
    """The NaN step left every variable as it was and counted one skip."""
    _assert_all_bitwise_equal(
        _group(arrays, f"{prefix}_skipped"),
        _group(arrays, f"{prefix}_before"),
        f"{prefix}: the skipped step changed a variable",
    )
    before = results[f"{prefix}_counters_before"]
    assert results[f"{prefix}_counters_skipped"] == {
        "loss_scale": before["loss_scale"] / 2,
        "skipped_steps": before["skipped_steps"] + 1,
        "iterations": before["iterations"],
    }


def _assert_close_to_one_process(ranks, key, reference_key):
    for _, arrays in ranks:
        for actual, expected in zip(
            _group(arrays, key), _group(arrays, reference_key), strict=True
        ):
            assert_close(actual, expected)


# --------------------------------------------------------------------------
# JAX: two processes joined by keras.distribution.initialize, DataParallel.

_JAX = """
import jax

import keras

import keras_mp

# Before any JAX computation: joins the two processes (jax.distributed).
keras.distribution.initialize(
    job_addresses=os.environ["KERAS_MP_TEST_ADDRESS"],
    num_processes=2,
    process_id=RANK,
)
results["process_count"] = jax.process_count()
results["device_count"] = jax.device_count()
results["collectives"] = jax.config.jax_cpu_collectives_implementation

# Each process passes only its own rows to `fit`: Keras assembles the
# global batch from them (auto-sharding would need a tf.data.Dataset).
keras.distribution.set_distribution(
    keras.distribution.DataParallel(
        devices=jax.devices(), auto_shard_dataset=False
    )
)


def records(optimizer):
    # Paths without the model's name, which differs between the two models.
    return [
        [r.path.split("/", 1)[1], r.count, r.first_step]
        for r in optimizer.overflow_report()
    ]


printed = []
model = make_model()
optimizer = make_optimizer(track_overflow=True)
model.compile(optimizer, "mean_squared_error")
report = keras_mp.callbacks.OverflowReport(top=4, print_fn=printed.append)


def fit(labels):
    rows = local_rows(0)
    model.fit(
        x[rows],
        labels[rows],
        batch_size=8,  # per process: a global batch of 16
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[report],
    )


fit(y)
save("fit_before", state(model, optimizer))
results["fit_counters_before"] = counters(optimizer)
fit(poisoned)
save("fit_skipped", state(model, optimizer))
results["fit_counters_skipped"] = counters(optimizer)
fit(y)
save("fit_applied", state(model, optimizer))
results["overflow_counts"] = to_numpy(optimizer._overflow_counts).tolist()
results["overflow_first_steps"] = to_numpy(
    optimizer._overflow_first_steps
).tolist()
results["overflow_report"] = str(optimizer.overflow_report())
results["overflow_records"] = records(optimizer)
results["overflow_report_callback"] = printed

# One process on the global batch, the same three steps.
keras.distribution.set_distribution(None)
model = make_model()
optimizer = make_optimizer(track_overflow=True)
model.compile(optimizer, "mean_squared_error")
for labels in (y, poisoned, y):
    model.fit(x[:16], labels[:16], batch_size=16, shuffle=False, verbose=0)
save("one_process", state(model, optimizer))
results["one_process_records"] = records(optimizer)
finish()
"""


@pytest.fixture(scope="module")
def jax_ranks(tmp_path_factory):
    return _run_processes(
        _JAX,
        str(tmp_path_factory.mktemp("jax")),
        {
            "KERAS_BACKEND": "jax",
            "JAX_PLATFORMS": "cpu",
            # One CPU device per process: the devices of the mesh are the
            # processes.
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
            "KERAS_MP_TEST_ADDRESS": f"127.0.0.1:{_free_port()}",
        },
    )


@pytest.mark.backends("jax")
@pytest.mark.slow
def test_jax_processes_skip_together_and_match_one_process(jax_ranks):
    for results, arrays in jax_ranks:
        assert results["process_count"] == 2
        assert results["device_count"] == 2
        assert results["collectives"] == "gloo"
        _assert_skipped(results, arrays, "fit")
    for key in ("fit_before", "fit_skipped", "fit_applied"):
        _assert_processes_identical(jax_ranks, key)
    _assert_close_to_one_process(jax_ranks, "fit_applied", "one_process")


@pytest.mark.backends("jax")
@pytest.mark.slow
def test_jax_processes_agree_on_overflow_counters_and_report(jax_ranks):
    (results_0, _), (results_1, _) = jax_ranks
    for results in (results_0, results_1):
        # Steps 0 and 2 were finite; step 1 overflowed for every variable.
        assert results["overflow_counts"] == [1, 1, 1, 1]
        assert results["overflow_first_steps"] == [1, 1, 1, 1]
        assert results["overflow_records"] == results["one_process_records"]
        (printed,) = results["overflow_report_callback"]
        assert "1 step(s) skipped" in printed
        assert "hidden/kernel" in printed
    for key in ("overflow_report", "overflow_report_callback"):
        assert results_0[key] == results_1[key], key


# --------------------------------------------------------------------------
# PyTorch: a gloo process group and DistributedDataParallel.

# Every torch child joins the two-process gloo group first.
_TORCH_GROUP = """
import torch.distributed as dist

dist.init_process_group(
    "gloo",
    init_method=os.environ["KERAS_MP_TEST_INIT_METHOD"],
    rank=RANK,
    world_size=2,
)
"""

_TORCH = (
    _TORCH_GROUP
    + """
import contextlib

import keras
import torch
from keras import ops
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import keras_mp


def ddp_step(ddp_model, model, optimizer, rows, labels, micro_steps=1):
    # The loop of Keras's DDP guide, with loss scaling: forward through the
    # DDP model, backward (DDP all-reduces the gradients), then `apply`.
    variables = model.trainable_variables
    ddp_model.zero_grad()
    y_pred = ddp_model(torch.as_tensor(x[rows]))
    loss = ops.mean(ops.square(y_pred - torch.as_tensor(labels[rows])))
    optimizer.scale_loss(loss / micro_steps).backward()
    with torch.no_grad():
        optimizer.apply([v.value.grad for v in variables], variables)


def one_process_step(model, optimizer, rows, labels, micro_steps=1):
    # The same step on one process, for the global batch's rows.
    variables = model.trainable_variables
    model.zero_grad()
    loss = ops.mean(
        ops.square(model(torch.as_tensor(x[rows])) - torch.as_tensor(labels[rows]))
    )
    optimizer.scale_loss(loss / micro_steps).backward()
    with torch.no_grad():
        optimizer.apply([v.value.grad for v in variables], variables)


def skip_then_apply(prefix, model, optimizer, step):
    # `step(labels)` trains on the first global batch.
    step(y)
    save(f"{prefix}_before", state(model, optimizer))
    results[f"{prefix}_counters_before"] = counters(optimizer)
    step(poisoned)
    save(f"{prefix}_skipped", state(model, optimizer))
    results[f"{prefix}_counters_skipped"] = counters(optimizer)
    step(y)
    save(f"{prefix}_applied", state(model, optimizer))


# 1. DDP, one step per batch.
model = make_model()
ddp_model = DistributedDataParallel(model)
optimizer = make_optimizer()
skip_then_apply(
    "ddp",
    model,
    optimizer,
    lambda labels: ddp_step(ddp_model, model, optimizer, local_rows(0), labels),
)

# 2. Gradient accumulation in the DDP gradients, torch's `no_sync` recipe:
# the first micro-step's gradients stay in each process, the last
# micro-step's backward all-reduces the sum of both; one `apply` per window.
model = make_model()
ddp_model = DistributedDataParallel(model)
optimizer = make_optimizer()


def no_sync_window(labels):
    variables = model.trainable_variables
    ddp_model.zero_grad()
    for batch in (0, 1):
        sync = contextlib.nullcontext() if batch else ddp_model.no_sync()
        with sync:
            rows = local_rows(batch)
            y_pred = ddp_model(torch.as_tensor(x[rows]))
            loss = ops.mean(ops.square(y_pred - torch.as_tensor(labels[rows])))
            optimizer.scale_loss(loss / 2).backward()
    with torch.no_grad():
        optimizer.apply([v.value.grad for v in variables], variables)


skip_then_apply("no_sync", model, optimizer, no_sync_window)

# 3. Keras's `gradient_accumulation_steps` under `no_sync`: the first
# micro-step's gradients (NaN in process 1 only) are accumulated by each
# process's inner optimizer, the last micro-step's are all-reduced.
model = make_model()
ddp_model = DistributedDataParallel(model)
optimizer = make_optimizer(inner_kwargs={"gradient_accumulation_steps": 2})
optimizer.build(model.trainable_variables)
save("accumulation_before", state(model, optimizer))
results["accumulation_counters_before"] = counters(optimizer)
with ddp_model.no_sync():
    ddp_step(ddp_model, model, optimizer, local_rows(0), poisoned)
ddp_step(ddp_model, model, optimizer, local_rows(1), poisoned)
save("accumulation_skipped", state(model, optimizer))
results["accumulation_counters_skipped"] = counters(optimizer)
# Then a finite window the same way: each process's accumulator holds its
# own first micro-step, until they are averaged at the last one.
with ddp_model.no_sync():
    ddp_step(ddp_model, model, optimizer, local_rows(0), y)
ddp_step(ddp_model, model, optimizer, local_rows(1), y)
save("accumulation_applied", state(model, optimizer))

# 4. float16 all-reduce: keras_mp's flag, then DDP's compression hook.
model = make_model()
ddp_model = DistributedDataParallel(model)
optimizer = make_optimizer(aggregate_in_float16=True)
optimizer.build(model.trainable_variables)
save("float16_flag_before", state(model, optimizer))
try:
    ddp_step(ddp_model, model, optimizer, local_rows(0), y)
except ValueError as error:
    results["aggregate_in_float16_error"] = str(error)
save("float16_flag", state(model, optimizer))

model = make_model()
ddp_model = DistributedDataParallel(model)
ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
optimizer = make_optimizer()
skip_then_apply(
    "fp16_hook",
    model,
    optimizer,
    lambda labels: ddp_step(ddp_model, model, optimizer, local_rows(0), labels),
)
dist.destroy_process_group()

# One process on the global batches, the same steps.
model = make_model()
optimizer = make_optimizer()
for labels in (y, poisoned, y):
    one_process_step(model, optimizer, slice(0, 16), labels)
save("one_process", state(model, optimizer))

model = make_model()
optimizer = make_optimizer()
for labels in (y, poisoned, y):
    model.zero_grad()
    variables = model.trainable_variables
    for rows in (slice(0, 16), slice(16, 32)):
        loss = ops.mean(
            ops.square(
                model(torch.as_tensor(x[rows])) - torch.as_tensor(labels[rows])
            )
        )
        optimizer.scale_loss(loss / 2).backward()
    with torch.no_grad():
        optimizer.apply([v.value.grad for v in variables], variables)
save("one_process_window", state(model, optimizer))

# Keras's accumulation on one process: the poisoned window, then the finite
# one, each micro-step on its global batch.
model = make_model()
optimizer = make_optimizer(inner_kwargs={"gradient_accumulation_steps": 2})
for labels in (poisoned, y):
    for rows in (slice(0, 16), slice(16, 32)):
        one_process_step(model, optimizer, rows, labels)
save("one_process_accumulation", state(model, optimizer))
finish()
"""
)


def _torch_env(**extra):
    """The environment of a pair of torch children: one OpenMP thread, a
    fresh port for their gloo group."""
    return {
        "KERAS_BACKEND": "torch",
        "OMP_NUM_THREADS": "1",
        "KERAS_MP_TEST_INIT_METHOD": f"tcp://127.0.0.1:{_free_port()}",
        **extra,
    }


@pytest.fixture(scope="module", params=["host", "device"])
def torch_ranks(request, tmp_path_factory):
    # Each pair of processes trains with the skip decided on the host (the
    # default: the flag MAX-reduced, then read) and on the device.
    return _run_processes(
        _TORCH,
        str(tmp_path_factory.mktemp("torch")),
        _torch_env(
            KERAS_MP_TEST_SKIP_ON_DEVICE=str(int(request.param == "device"))
        ),
    )


@pytest.mark.backends("torch")
@pytest.mark.slow
def test_ddp_processes_skip_together_and_match_one_process(torch_ranks):
    for results, arrays in torch_ranks:
        # Process 0's own gradients were finite: it skipped because DDP's
        # all-reduced ones were not.
        _assert_skipped(results, arrays, "ddp")
    for key in ("ddp_before", "ddp_skipped", "ddp_applied"):
        _assert_processes_identical(torch_ranks, key)
    _assert_close_to_one_process(torch_ranks, "ddp_applied", "one_process")


@pytest.mark.backends("torch")
@pytest.mark.slow
def test_ddp_no_sync_accumulation_in_grads_skips_together(torch_ranks):
    for results, arrays in torch_ranks:
        _assert_skipped(results, arrays, "no_sync")
    for key in ("no_sync_before", "no_sync_skipped", "no_sync_applied"):
        _assert_processes_identical(torch_ranks, key)
    _assert_close_to_one_process(
        torch_ranks, "no_sync_applied", "one_process_window"
    )


@pytest.mark.backends("torch")
@pytest.mark.slow
def test_keras_accumulation_under_no_sync_discards_the_window_everywhere(
    torch_ranks,
):
    # Process 0 saw only finite local gradients in the window; the finite
    # flag, reduced with MAX across processes, makes it discard the window
    # with process 1.
    for results, arrays in torch_ranks:
        _assert_skipped(results, arrays, "accumulation")
    _assert_processes_identical(torch_ranks, "accumulation_skipped")


@pytest.mark.backends("torch")
@pytest.mark.slow
def test_keras_accumulation_under_no_sync_applies_the_global_window(
    torch_ranks,
):
    # Each process accumulated only its own first micro-step: without the
    # average at the window's end, the processes applied different updates.
    _assert_processes_identical(torch_ranks, "accumulation_applied")
    _assert_close_to_one_process(
        torch_ranks, "accumulation_applied", "one_process_accumulation"
    )


@pytest.mark.backends("torch")
@pytest.mark.slow
def test_aggregate_in_float16_under_ddp_raises_and_names_the_hook(
    torch_ranks,
):
    for results, arrays in torch_ranks:
        # DDP all-reduces in backward(), before the optimizer: the flag
        # cannot make that sum float16, so it must not pass silently.
        message = results.get("aggregate_in_float16_error")
        assert message is not None, "aggregate_in_float16=True was accepted"
        assert "Received: aggregate_in_float16=True" in message
        assert "fp16_compress_hook" in message
        # The step raised before updating anything.
        _assert_all_bitwise_equal(
            _group(arrays, "float16_flag"),
            _group(arrays, "float16_flag_before"),
            "the refused step changed a variable",
        )


@pytest.mark.backends("torch")
@pytest.mark.slow
def test_ddp_float16_compression_hook_skips_together_within_tolerance(
    torch_ranks,
):
    for results, arrays in torch_ranks:
        _assert_skipped(results, arrays, "fp16_hook")
    for key in ("fp16_hook_skipped", "fp16_hook_applied"):
        _assert_processes_identical(torch_ranks, key)
    # float16 keeps 11 significant bits: the all-reduced gradients are
    # rounded to that, then the update is float32 again.
    for _, arrays in torch_ranks:
        hooked = _group(arrays, "fp16_hook_applied")
        exact = _group(arrays, "ddp_applied")
        for a, e in zip(hooked, exact, strict=True):
            assert_close(a, e, dtype="float16")
        assert any(a.tobytes() != e.tobytes() for a, e in zip(hooked, exact))


# PyTorch: delayed FP8 scaling under DistributedDataParallel (issue 22,
# item 6). DDP averages every gradient, the carriers' too: each one-hot
# amax bin becomes 1/2, still present, so both processes fold the global
# batch's amax; the largest inputs are all in process 1's rows. The loss
# is each process's mean, as in Keras's DDP guide.
_TORCH_DELAYED = (
    _TORCH_GROUP
    + """
import keras
import torch
from keras import ops
from torch.nn.parallel import DistributedDataParallel

import keras_mp
from keras_mp import fp8
from keras_mp import fp8_layers

data = np.random.RandomState(1).randn(32, 16).astype("float32")
data[8:16] *= 100
data[24:32] *= 100
targets = np.random.RandomState(2).randn(32, 16).astype("float32")
recipe = fp8.Recipe(scaling="delayed", amax_history=4)


def fp8_model():
    keras.utils.set_random_seed(0)
    policy = keras_mp.Policy("float32", fp8=recipe)
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(16, name="up", dtype=policy),
            keras.layers.Dense(16, name="out", dtype=policy),
        ]
    )


def train(call, model, rows_of):
    optimizer = keras.optimizers.SGD(0.01)
    variables = model.trainable_variables
    for step in range(4):
        rows = rows_of(step % 2)
        model.zero_grad()
        prediction = call(torch.as_tensor(data[rows]))
        loss = ops.mean(ops.square(prediction - torch.as_tensor(targets[rows])))
        loss.backward()
        with torch.no_grad():
            optimizer.apply([v.value.grad for v in variables], variables)
    return [
        to_numpy(v.value)
        for v in fp8_layers.delayed_state(model.get_layer("up")).values()
    ]


model = fp8_model()
save("ddp_delayed", train(DistributedDataParallel(model), model, local_rows))
model = fp8_model()
save("one_delayed", train(model, model, lambda b: slice(16 * b, 16 * b + 16)))
finish()
"""
)


@pytest.mark.backends("torch")
@pytest.mark.slow
def test_ddp_processes_hold_one_processs_delayed_fp8_state(tmp_path):
    ranks = _run_processes(
        _TORCH_DELAYED,
        str(tmp_path),
        _torch_env(),
    )
    _assert_processes_identical(ranks, "ddp_delayed")
    for _, arrays in ranks:
        history, steps, scale = _group(arrays, "ddp_delayed")
        one_history, one_steps, one_scale = _group(arrays, "one_delayed")
        assert steps == one_steps == 3
        assert 2.0**8 <= one_history[0, 0] < 2.0**9  # 100x a normal's amax
        # The input and the kernel: one process's, bit for bit. Each
        # process's output gradient is its own half-batch mean's, twice
        # the global mean's (DDP averages the weight gradients): its
        # history and scale are one process's times 2, exactly.
        assert_bitwise_equal(history[:2], one_history[:2])
        assert_bitwise_equal(scale[:2], one_scale[:2])
        assert_bitwise_equal(history[2], one_history[2] * 2)
        assert_bitwise_equal(scale[2], one_scale[2] * 2)

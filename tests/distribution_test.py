"""Distributed training: one skip decision for every replica, gradients
aggregated once before the finite check and clipping, float16 all-reduce.

Each backend's checks run in fresh interpreters (device counts must be set
before TensorFlow or JAX initializes): TensorFlow with two logical CPU
devices under MirroredStrategy, plus two worker processes on localhost under
MultiWorkerMirroredStrategy; JAX with two host devices under
keras.distribution. A module-scoped fixture runs one child per group of
checks and saves what it saw; the tests below assert on it.

A NaN reaches one replica only: on TensorFlow a loss multiplied by NaN on
replica 1 (`replica_id_in_sync_group`); on JAX NaN labels in the rows of the
global batch that the data layout puts on device 1.
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
from keras_mp.testing import run_python

# Under pytest-xdist the module's tests share one worker, so its
# module-scoped children run once.
pytestmark = pytest.mark.xdist_group("distribution")

# Largest relative difference (to the largest weight of each tensor) between
# weights trained with a float16 and with a float32 all-reduce of the
# scaled gradients, a few steps in. float16 keeps 11 significant bits
# (relative rounding 2**-11, about 5e-4); the loss scale keeps the scaled
# gradients in float16's normal range, so the error stays at that rounding.
FLOAT16_ALL_REDUCE_TOLERANCE = 1e-3

# A child that trains a tiny model; generous for a loaded 2-core CI machine.
CHILD_TIMEOUT = 240


def _load(directory):
    with open(os.path.join(directory, "results.json")) as f:
        results = json.load(f)
    with np.load(os.path.join(directory, "arrays.npz")) as arrays:
        return results, {key: arrays[key] for key in arrays.files}


def _run_child(code, tmp_path_factory, name, backend, env=None):
    directory = str(tmp_path_factory.mktemp(name))
    out = run_python(
        _COMMON + textwrap.dedent(code),
        env={
            "KERAS_BACKEND": backend,
            "KERAS_MP_TEST_OUT": directory,
            **(env or {}),
        },
        timeout=CHILD_TIMEOUT,
    )
    print(out)
    return _load(directory)


# Shared by every child: the data, the model, the optimizer, saving results.
_COMMON = textwrap.dedent(
    """
    import json
    import os

    import numpy as np

    OUT = os.environ["KERAS_MP_TEST_OUT"]
    results = {}
    arrays = {}

    rng = np.random.RandomState(0)
    x = rng.randn(16, 4).astype("float32")
    y = rng.randn(16, 1).astype("float32")


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

        # The clipping is active (the gradient norm is well above 0.05), so
        # a run that clipped each replica's gradients before summing them
        # would differ from the one-replica run.
        kwargs.setdefault(
            "transform_gradients", [("clip_by_global_norm", {"max_norm": 0.05})]
        )
        return keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9),
            loss_scale=keras_mp.DynamicLossScale(2**10),
            **kwargs,
        )


    def save(key, values):
        for i, value in enumerate(values):
            arrays[f"{key}__{i}"] = np.asarray(value)


    def finish():
        np.savez(os.path.join(OUT, "arrays.npz"), **arrays)
        with open(os.path.join(OUT, "results.json"), "w") as f:
            json.dump(results, f)
    """
)


def _group(arrays, key):
    count = len([k for k in arrays if k.startswith(f"{key}__")])
    return [arrays[f"{key}__{i}"] for i in range(count)]


def _assert_all_bitwise_equal(actual, expected, msg):
    assert len(actual) == len(expected), msg
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_bitwise_equal(a, e, msg=f"{msg} [{i}]")


def _assert_replicas_identical(per_replica, msg):
    # Each array stacks the replicas' copies of one variable along axis 0.
    for i, stacked in enumerate(per_replica):
        assert stacked.shape[0] >= 1
        for copy in stacked[1:]:
            assert_bitwise_equal(copy, stacked[0], msg=f"{msg} [{i}]")


def _max_relative_difference(actual, expected):
    return max(
        float(np.max(np.abs(a - e)) / np.max(np.abs(e)))
        for a, e in zip(actual, expected)
    )


# --------------------------------------------------------------------------
# TensorFlow: MirroredStrategy over two logical CPU devices, with `fit`.

_TF_DEVICES = """
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)
"""

# Helpers of every TensorFlow child, run once its devices are configured.
_TF_HELPERS = """
import keras
import tensorflow as tf

import keras_mp

# The loss of the replica whose id this holds is NaN, so only that
# replica's gradients are NaN before the all-reduce; -1 poisons none.
poisoned_replica = tf.Variable(-1, trainable=False)


def loss_fn(y_true, y_pred):
    # No replica context while Keras builds the loss symbolically.
    context = tf.distribute.get_replica_context()
    replica_id = 0 if context is None else context.replica_id_in_sync_group
    poisoned = tf.equal(poisoned_replica, tf.cast(replica_id, "int32"))
    loss = keras.losses.mean_squared_error(y_true, y_pred)
    return loss * tf.where(poisoned, float("nan"), 1.0)


def per_replica(variables):
    # One array per variable, its replicas' copies stacked along axis 0.
    def copies(variable):
        value = variable.value
        components = getattr(value, "values", (value,))
        return np.stack([c.numpy() for c in components])

    return [copies(v) for v in variables]


def weights(model):
    return [keras.ops.convert_to_numpy(w) for w in model.weights]


def state(model, optimizer):
    return per_replica(model.weights + optimizer.inner_optimizer.variables)


def first_replica(variable):
    return per_replica([variable])[0][0]


def counters(optimizer):
    return {
        "loss_scale": float(first_replica(optimizer.loss_scale.loss_scale)),
        "skipped_steps": int(first_replica(optimizer.skipped_steps)),
        "iterations": int(first_replica(optimizer.iterations)),
    }


def skip_then_apply(prefix, model, optimizer, one_step, replica=1):
    # A step with a NaN on one replica only, then a finite one.
    save(f"{prefix}_before", state(model, optimizer))
    results[f"{prefix}_counters_before"] = counters(optimizer)
    poisoned_replica.assign(replica)
    one_step()
    save(f"{prefix}_skipped", state(model, optimizer))
    results[f"{prefix}_counters_skipped"] = counters(optimizer)
    poisoned_replica.assign(-1)
    one_step()
    save(f"{prefix}_applied", state(model, optimizer))


def custom_loop(strategy, style):
    # `style`: "minimize" (RFC 234), or "keras": scale_loss, the tape's
    # gradients of the scaled loss, apply_gradients (Keras 3).
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer()
        optimizer.build(model.trainable_variables)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    options = tf.data.Options()
    # Each worker of a multi-worker strategy takes its share of every batch.
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    batch = next(
        iter(strategy.experimental_distribute_dataset(dataset.with_options(options)))
    )

    def replica_step(xb, yb):
        variables = model.trainable_variables
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(yb, model(xb, training=True))) / 16.0
            if style == "keras":
                scaled = optimizer.scale_loss(loss)
        if style == "keras":
            grads = tape.gradient(scaled, variables)
            optimizer.apply_gradients(zip(grads, variables))
        else:
            optimizer.minimize(loss, variables, tape=tape)
        return loss

    @tf.function
    def train_step(xb, yb):
        per_replica_loss = strategy.run(replica_step, args=(xb, yb))
        return strategy.reduce("SUM", per_replica_loss, axis=None)

    train_step(*batch)
    skip_then_apply(style, model, optimizer, lambda: train_step(*batch))
    return model
"""

_TF_FIT = """
from tensorflow.python.distribute import distribute_lib

# Every replica-context all-reduce: the dtypes of the values it sums.
all_reduces = []
_all_reduce = distribute_lib.ReplicaContext.all_reduce


def recording_all_reduce(self, reduce_op, value, options=None):
    all_reduces.append([v.dtype.name for v in tf.nest.flatten(value)])
    return _all_reduce(self, reduce_op, value, options)


distribute_lib.ReplicaContext.all_reduce = recording_all_reduce


def fit(strategy, **optimizer_kwargs):
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer(**optimizer_kwargs)
        model.compile(optimizer, loss_fn, jit_compile=False)
    start = len(all_reduces)
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    return model, optimizer, history.history["loss"], all_reduces[start:]


two = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
model, _, results["one_replica_loss"], _ = fit(tf.distribute.get_strategy())
save("one_replica", weights(model))

model, optimizer, loss, all_reduces_of_fit = fit(two)
results["two_replica_loss"] = loss
results["two_replica_all_reduces"] = all_reduces_of_fit
save("two_replica", weights(model))
results["two_replicas"] = two.num_replicas_in_sync
skip_then_apply(
    "fit",
    model,
    optimizer,
    lambda: model.fit(x, y, batch_size=16, epochs=1, verbose=0),
)

# bfloat16 momentum, stochastically rounded (its rounding is an XLA-compiled
# function called from the step, once per replica).
model, optimizer, _, _ = fit(two, state_dtype="bfloat16")
results["fit_bf16_slot_dtypes"] = sorted(
    {v.dtype for v in optimizer.inner_optimizer.variables if v.ndim}
)
skip_then_apply(
    "fit_bf16",
    model,
    optimizer,
    lambda: model.fit(x, y, batch_size=16, epochs=1, verbose=0),
)


def clip_each_replica_then_sum(grads_and_vars):
    # The order of Keras 3's TensorFlow optimizers, as a control: the
    # gradients here are scaled, so the clip norm is scaled too.
    grads = [g for g, _ in grads_and_vars]
    scale = tf.convert_to_tensor(control_optimizer.loss_scale())
    clipped, _ = tf.clip_by_global_norm(grads, 0.05 * scale)
    summed = tf.distribute.get_replica_context().all_reduce("SUM", clipped)
    return list(zip(summed, [v for _, v in grads_and_vars]))


with two.scope():
    control = make_model()
    control_optimizer = make_optimizer(
        transform_gradients=None, aggregate_gradients=clip_each_replica_then_sum
    )
    control.compile(control_optimizer, loss_fn, jit_compile=False)
control.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
save("clipped_per_replica", weights(control))

model, _, _, all_reduces_of_fit = fit(two, aggregate_in_float16=True)
results["float16_all_reduces"] = all_reduces_of_fit
save("float16_all_reduce", weights(model))
finish()
"""


_TF_OVERFLOW = """
two = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with two.scope():
    model = make_model()
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        loss_scale=keras_mp.DynamicLossScale(
            2**10, min_loss_scale=2**9, hysteresis=2, on_min_scale="raise"
        ),
        track_overflow=True,
    )
    optimizer.build(model.trainable_variables)
optimizer.check_min_scale()  # the baseline: no step yet


def replica_step(xb, yb):
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(loss_fn(yb, model(xb, training=True))) / 16.0
        scaled = optimizer.scale_loss(loss)
    grads = tape.gradient(scaled, variables)
    optimizer.apply_gradients(zip(grads, variables))


@tf.function
def train_step(xb, yb):
    two.run(replica_step, args=(xb, yb))


dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
batch = next(iter(two.experimental_distribute_dataset(dataset)))
results["scales"] = []
# NaN on replica 1 at steps 1, 3 and 4.
for poisoned in (-1, 1, -1, 1, 1):
    poisoned_replica.assign(poisoned)
    train_step(*batch)
    results["scales"].append(counters(optimizer)["loss_scale"])
results["counters"] = counters(optimizer)
results["counts"] = per_replica([optimizer._overflow_counts])[0].tolist()
results["first_steps"] = per_replica(
    [optimizer._overflow_first_steps]
)[0].tolist()
results["report"] = [list(r) for r in optimizer.overflow_report()]
try:
    optimizer.check_min_scale()
except FloatingPointError as error:
    results["on_min_scale_error"] = str(error)
finish()
"""


@pytest.fixture(scope="module")
def tf_overflow_results(tmp_path_factory):
    return _run_child(
        _TF_DEVICES + _TF_HELPERS + _TF_OVERFLOW,
        tmp_path_factory,
        "tf_overflow",
        "tensorflow",
    )


@pytest.mark.backends("tensorflow")
def test_overflow_counts_hysteresis_and_min_scale_for_two_replicas(
    tf_overflow_results,
):
    results, _ = tf_overflow_results
    # hysteresis=2: the isolated overflow at step 1 keeps the scale; the two
    # in a row at steps 3 and 4 halve it once.
    assert results["scales"] == [1024.0, 1024.0, 1024.0, 1024.0, 512.0]
    assert results["counters"]["skipped_steps"] == 3
    assert results["counters"]["iterations"] == 2
    # Every variable's gradient was NaN after the all-reduce, 3 times (not
    # 6: counted once for both replicas), first at step 1; both replicas'
    # copies of the counters agree.
    for replica_counts in results["counts"]:
        assert replica_counts == [3, 3, 3, 3]
    for replica_first in results["first_steps"]:
        assert replica_first == [1, 1, 1, 1]
    assert [record[2:] for record in results["report"]] == [[3, 1]] * 4
    # The scale reached its floor (2**9) with overflows continuing:
    # on_min_scale="raise" raises, naming the worst variables.
    assert "min_loss_scale=512" in results["on_min_scale_error"]
    assert "hidden/kernel (3x)" in results["on_min_scale_error"]


@pytest.fixture(scope="module")
def tf_fit_results(tmp_path_factory):
    return _run_child(
        _TF_DEVICES + _TF_HELPERS + _TF_FIT,
        tmp_path_factory,
        "tf_fit",
        "tensorflow",
    )


@pytest.mark.backends("tensorflow")
def test_nan_on_one_replica_makes_every_replica_skip_in_fit(tf_fit_results):
    results, arrays = tf_fit_results
    assert results["two_replicas"] == 2
    _assert_skipped_on_every_replica(results, arrays, "fit")


def _assert_skipped_on_every_replica(results, arrays, prefix, replicated=True):
    """Checks a NaN step then a finite one, as `skip_then_apply` saved them.

    Each saved array stacks one variable's copies (or shards, where
    `replicated` is False) on every device along axis 0: the model weights,
    then every inner optimizer variable.
    """
    before = _group(arrays, f"{prefix}_before")
    skipped = _group(arrays, f"{prefix}_skipped")
    applied = _group(arrays, f"{prefix}_applied")
    _assert_all_bitwise_equal(
        skipped, before, "skipped step changed a variable"
    )
    if replicated:
        _assert_replicas_identical(skipped, "replicas differ after the skip")
        _assert_replicas_identical(applied, "replicas differ after the update")
    assert any(a.tobytes() != s.tobytes() for a, s in zip(applied, skipped)), (
        "the finite step after the skipped one did not train"
    )
    counters_before = results[f"{prefix}_counters_before"]
    counters_skipped = results[f"{prefix}_counters_skipped"]
    assert counters_skipped["loss_scale"] == counters_before["loss_scale"] / 2
    assert (
        counters_skipped["skipped_steps"]
        == counters_before["skipped_steps"] + 1
    )
    assert counters_skipped["iterations"] == counters_before["iterations"]


@pytest.mark.backends("tensorflow")
def test_bfloat16_state_skips_and_stays_identical_on_every_replica_in_fit(
    tf_fit_results,
):
    results, arrays = tf_fit_results
    assert results["fit_bf16_slot_dtypes"] == ["bfloat16"]
    _assert_skipped_on_every_replica(results, arrays, "fit_bf16")


@pytest.mark.backends("tensorflow")
def test_two_replicas_match_one_replica_on_the_same_global_batch_in_fit(
    tf_fit_results,
):
    results, arrays = tf_fit_results
    assert_close(
        np.concatenate([w.ravel() for w in _group(arrays, "two_replica")]),
        np.concatenate([w.ravel() for w in _group(arrays, "one_replica")]),
    )
    # The reported loss is the global batch's mean, not the sum over replicas.
    assert_close(results["two_replica_loss"], results["one_replica_loss"])


@pytest.mark.backends("tensorflow")
def test_gradients_are_all_reduced_once_before_the_finite_check_and_clipping(
    tf_fit_results,
):
    results, arrays = tf_fit_results
    # One trace of the train step: one all-reduce per replica, of all four
    # gradients; the inner Keras optimizer does not sum them again.
    assert results["two_replica_all_reduces"] == [["float32"] * 4] * 2
    # Clipping each replica's gradients before the sum (Keras 3's order)
    # moves the weights away from the one-replica run; clipping after the
    # sum, as checked above, does not.
    clipped_per_replica = _group(arrays, "clipped_per_replica")
    one_replica = _group(arrays, "one_replica")
    assert _max_relative_difference(clipped_per_replica, one_replica) > 1e-3


@pytest.mark.backends("tensorflow")
def test_float16_all_reduce_stays_within_tolerance_of_float32_on_tensorflow(
    tf_fit_results,
):
    results, arrays = tf_fit_results
    assert results["float16_all_reduces"] == [["float16"] * 4] * 2
    difference = _max_relative_difference(
        _group(arrays, "float16_all_reduce"), _group(arrays, "two_replica")
    )
    print(f"float16 all-reduce: max relative difference {difference:.2e}")
    assert 0 < difference < FLOAT16_ALL_REDUCE_TOLERANCE


# --------------------------------------------------------------------------
# TensorFlow: custom loops with `strategy.run`, and `jit_compile=True`.

_TF_LOOPS = """
two = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
custom_loop(two, "minimize")

# MirroredStrategy avoids `merge_call` in replica context only under XLA on
# GPUs; this path (where Keras's own LossScaleOptimizer raises,
# keras-team/keras#21366) is forced here on CPU devices. The same strategy
# is reused: a second one would reuse its collective keys, and TensorFlow
# would mix up the two strategies' all-reduces.
two.extended._use_merge_call = lambda: False
custom_loop(two, "keras")

# XLA cannot compile TensorFlow's cross-device collectives on CPU, whatever
# the optimizer, so the compiled step runs on one replica of a strategy.
one = tf.distribute.MirroredStrategy(["/cpu:0"])
with one.scope():
    model = make_model()
    optimizer = make_optimizer()
    model.compile(optimizer, loss_fn, jit_compile=True)
model.fit(x, y, batch_size=16, epochs=1, verbose=0)
results["jit_compile"] = model.jit_compile
skip_then_apply(
    "jit",
    model,
    optimizer,
    lambda: model.fit(x, y, batch_size=16, epochs=1, verbose=0),
    replica=0,
)
finish()
"""


@pytest.fixture(scope="module")
def tf_loop_results(tmp_path_factory):
    return _run_child(
        _TF_DEVICES + _TF_HELPERS + _TF_LOOPS,
        tmp_path_factory,
        "tf_loops",
        "tensorflow",
    )


@pytest.mark.backends("tensorflow")
def test_nan_on_one_replica_makes_every_replica_skip_in_a_strategy_run_loop(
    tf_loop_results,
):
    results, arrays = tf_loop_results
    _assert_skipped_on_every_replica(results, arrays, "minimize")


@pytest.mark.backends("tensorflow")
def test_replica_context_without_merge_call_applies_and_skips_like_with_it(
    tf_loop_results,
):
    results, arrays = tf_loop_results
    _assert_skipped_on_every_replica(results, arrays, "keras")
    # Same model, data and steps as the merge_call loop: same weights.
    for a, b in zip(
        _group(arrays, "keras_applied"), _group(arrays, "minimize_applied")
    ):
        assert_close(a, b)


@pytest.mark.backends("tensorflow")
def test_jit_compiled_fit_under_mirrored_strategy_skips_nonfinite_steps(
    tf_loop_results,
):
    results, arrays = tf_loop_results
    assert results["jit_compile"] is True
    _assert_skipped_on_every_replica(results, arrays, "jit")


# --------------------------------------------------------------------------
# TensorFlow: MultiWorkerMirroredStrategy, two worker processes on localhost.

# The strategy comes first: collective ops must be configured before
# TensorFlow initializes. `fit` is not used: with several workers, Keras
# 3.15's TensorFlow trainer fails before the first step (its symbolic build
# calls `strategy.reduce` on a tuple of per-replica batches).
_TF_MULTI_WORKER = """
import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()
"""

_TF_WORKER = """
results["replicas"] = strategy.num_replicas_in_sync
model = custom_loop(strategy, "minimize")
save("weights", weights(model))
finish()
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tensorflow_worker_env(directories):
    cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in directories]}

    def worker_env(index):
        task = {"type": "worker", "index": index}
        return {
            "KERAS_BACKEND": "tensorflow",
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "TF_CONFIG": json.dumps({"cluster": cluster, "task": task}),
        }

    return worker_env


def _run_workers(code, directories, worker_env=None):
    """Runs one worker process per directory; all are killed on failure.

    Args:
        worker_env: Callable from a worker's index to the environment
            variables it gets on top of this process's (proxies removed).
            Defaults to a MultiWorkerMirroredStrategy cluster on localhost.

    Returns:
        Each worker's output (stdout and stderr).
    """
    worker_env = worker_env or _tensorflow_worker_env(directories)
    env = {
        key: value
        for key, value in os.environ.items()
        if "proxy" not in key.lower()  # loopback only
    }
    log_paths = [os.path.join(d, "log.txt") for d in directories]
    processes = []
    with contextlib.ExitStack() as stack:
        for index, (directory, log_path) in enumerate(
            zip(directories, log_paths)
        ):
            log = stack.enter_context(open(log_path, "w"))
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-c", code],
                    env={
                        **env,
                        **worker_env(index),
                        "KERAS_MP_TEST_OUT": directory,
                    },
                    cwd=os.path.dirname(os.path.dirname(__file__)),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            stack.callback(_kill_if_running, processes[-1])
        deadline = time.monotonic() + CHILD_TIMEOUT
        # A worker that fails leaves the others waiting on its collectives.
        while any(p.poll() is None for p in processes):
            if time.monotonic() > deadline or any(p.poll() for p in processes):
                break
            time.sleep(0.2)
    outputs = []
    for log_path in log_paths:
        with open(log_path) as log:
            outputs.append(log.read())
    codes = [process.returncode for process in processes]
    assert codes == [0] * len(processes), (
        f"worker exit codes {codes} (negative: killed after {CHILD_TIMEOUT} s "
        "or after another worker failed)\n"
        + "\n".join(
            f"--- worker {i}:\n{output[-4000:]}"
            for i, output in enumerate(outputs)
        )
    )
    return outputs


def _kill_if_running(process):
    if process.poll() is None:
        process.kill()
    process.wait()


@pytest.mark.backends("tensorflow")
def test_multi_worker_workers_skip_together_and_end_with_identical_weights(
    tmp_path,
):
    directories = [str(tmp_path / f"worker{i}") for i in range(2)]
    for directory in directories:
        os.mkdir(directory)
    code = _COMMON + textwrap.dedent(
        _TF_MULTI_WORKER + _TF_HELPERS + _TF_WORKER
    )
    _run_workers(code, directories)
    (results_0, arrays_0), (results_1, arrays_1) = map(_load, directories)
    assert results_0["replicas"] == results_1["replicas"] == 2
    for results, arrays in ((results_0, arrays_0), (results_1, arrays_1)):
        # Worker 1's replica is the one with the NaN.
        _assert_skipped_on_every_replica(results, arrays, "minimize")
    for key in ("minimize_skipped", "minimize_applied", "weights"):
        _assert_all_bitwise_equal(
            _group(arrays_1, key),
            _group(arrays_0, key),
            f"workers differ: {key}",
        )


# --------------------------------------------------------------------------
# JAX: keras.distribution over two host devices, inside the jitted `fit` step.

_JAX = """
import jax
import keras

import keras_mp

assert jax.device_count() == 2, jax.devices()


def per_device(variables):
    # One array per variable, its copies (or shards) on each device stacked
    # along axis 0, in device order.
    def copies(variable):
        shards = variable.value.addressable_shards
        shards = sorted(shards, key=lambda shard: shard.device.id)
        return np.stack([np.asarray(shard.data) for shard in shards])

    return [copies(v) for v in variables]


def weights(model):
    return [np.asarray(v.value) for v in model.weights]


def counters(optimizer):
    return {
        "loss_scale": float(np.asarray(optimizer.loss_scale.loss_scale.value)),
        "skipped_steps": int(np.asarray(optimizer.skipped_steps.value)),
        "iterations": int(np.asarray(optimizer.iterations.value)),
    }


def fit(**optimizer_kwargs):
    model = make_model()
    optimizer = make_optimizer(**optimizer_kwargs)
    model.compile(optimizer, "mean_squared_error")
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    return model, optimizer, history.history["loss"]


def rows_on_device(distribution, device_id):
    # The rows of the global batch that the data layout puts on a device.
    sharding = distribution.get_data_layout(y.shape).backend_layout
    return sorted(
        row
        for device, index in sharding.devices_indices_map(y.shape).items()
        if device.id == device_id
        for row in range(len(y))[index[0]]
    )


def skip_then_apply(prefix, model, optimizer, poisoned_rows):
    # A step with NaN labels in `poisoned_rows` only, then a finite one.
    def state():
        return per_device(model.weights + optimizer.inner_optimizer.variables)

    poisoned = y.copy()
    poisoned[poisoned_rows] = np.nan
    save(f"{prefix}_before", state())
    results[f"{prefix}_counters_before"] = counters(optimizer)
    model.fit(x, poisoned, batch_size=16, epochs=1, verbose=0)
    save(f"{prefix}_skipped", state())
    results[f"{prefix}_counters_skipped"] = counters(optimizer)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    save(f"{prefix}_applied", state())


model, _, results["one_device_loss"] = fit()
save("one_device", weights(model))

data_parallel = keras.distribution.DataParallel(devices=jax.devices())
keras.distribution.set_distribution(data_parallel)
results["rows_on_device_1"] = rows_on_device(data_parallel, 1)
model, optimizer, results["data_parallel_loss"] = fit()
save("data_parallel", weights(model))
skip_then_apply("data_parallel", model, optimizer, results["rows_on_device_1"])

# Overflow provenance under DataParallel: NaN labels on device 1 only, at
# the second of three steps.
model, optimizer, _ = fit(track_overflow=True)
poisoned = y.copy()
poisoned[results["rows_on_device_1"]] = np.nan
model.fit(x, poisoned, batch_size=16, epochs=1, verbose=0)
model.fit(x, y, batch_size=16, epochs=1, verbose=0)
results["tracked_counters"] = counters(optimizer)
results["tracked_report"] = [list(r) for r in optimizer.overflow_report()]

model, _, _ = fit(aggregate_in_float16=True)
save("float16_aggregation", weights(model))

mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], jax.devices())
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*hidden/kernel"] = (None, "model")
layout_map[".*hidden/bias"] = ("model",)
model_parallel = keras.distribution.ModelParallel(
    layout_map=layout_map, batch_dim_name="batch"
)
keras.distribution.set_distribution(model_parallel)
model, optimizer, results["model_parallel_loss"] = fit()
save("model_parallel", weights(model))
hidden_kernel = model.get_layer("hidden").kernel
results["hidden_kernel_shard_shapes"] = [
    list(shard.data.shape) for shard in hidden_kernel.value.addressable_shards
]
# Every device holds every row here: the whole batch is poisoned.
skip_then_apply("model_parallel", model, optimizer, list(range(len(y))))


# Optimizer state that keras_mp creates for the sharded kernel and bias
# (float32 masters of a bfloat16 model, the Adam slots built on them,
# Lookahead's slow weights, a transform's per-variable state), in bytes
# per device.
class Momentum(keras_mp.transforms.Transform):
    def build(self, var_list):
        self.momenta = [
            self.add_variable_from_reference(v, "momentum") for v in var_list
        ]

    def call(self, grads_and_vars):
        for momentum, (grad, _) in zip(self.momenta, grads_and_vars):
            momentum.assign(0.9 * momentum.value + grad)
        return grads_and_vars


keras_mp.set_global_policy("bfloat16")
model = make_model()
optimizer = keras_mp.optimizers.Lookahead(
    keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(0.01),
        master_weights=True,
        transform_gradients=[Momentum()],
    )
)
model.compile(optimizer, "mean_squared_error")
model.fit(x, y, batch_size=16, epochs=1, verbose=0)
# The transform's state follows the variables' order: the hidden layer's
# kernel and bias come first.
state = [
    v
    for v in optimizer.variables
    if "hidden" in v.path or v.name in ("momentum_0", "momentum_1")
]
bytes_per_device = {}
for variable in state:
    for shard in variable.value.addressable_shards:
        bytes_per_device[shard.device.id] = (
            bytes_per_device.get(shard.device.id, 0) + shard.data.nbytes
        )
results["model_parallel_state_paths"] = sorted(v.path for v in state)
results["model_parallel_state_bytes_per_device"] = [
    bytes_per_device[i] for i in sorted(bytes_per_device)
]
results["model_parallel_state_bytes"] = sum(
    int(np.prod(v.shape)) * np.dtype(str(v.dtype)).itemsize for v in state
)

# Adam's state as float8 codes (issue 34) under ModelParallel: the codes
# take the sharded kernel's layout, the block scales stay whole; training
# is one device's, a NaN step is skipped on every device.
keras_mp.set_global_policy(None)


def float8_fit():
    model = make_model()
    optimizer = keras_mp.LossScaleOptimizer(
        keras_mp.OptimizerWrapper(
            keras.optimizers.Adam(0.01), state_dtype="float8"
        ),
        loss_scale=keras_mp.DynamicLossScale(2**10),
    )
    model.compile(optimizer, "mean_squared_error")
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    return model, optimizer


keras.distribution.set_distribution(None)
model, _ = float8_fit()
save("float8_one_device", weights(model))
keras.distribution.set_distribution(model_parallel)
model, optimizer = float8_fit()
save("float8_model_parallel", weights(model))
results["float8_state_shards"] = {
    v.path.split("hidden_", 1)[1]: [
        [str(v.dtype)] + list(shard.data.shape)
        for shard in v.value.addressable_shards
    ]
    for v in optimizer.variables
    if "hidden_kernel_" in v.path
}
skip_then_apply("float8_model_parallel", model, optimizer, list(range(len(y))))
finish()
"""


@pytest.fixture(scope="module")
def jax_results(tmp_path_factory):
    return _run_child(
        _JAX,
        tmp_path_factory,
        "jax",
        "jax",
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
    )


@pytest.mark.backends("jax")
def test_nan_in_the_rows_on_device_1_makes_every_device_skip_in_data_parallel(
    jax_results,
):
    results, arrays = jax_results
    assert results["rows_on_device_1"] == list(range(8, 16))
    _assert_skipped_on_every_replica(results, arrays, "data_parallel")


@pytest.mark.backends("jax")
def test_overflow_counts_are_one_decision_for_every_device_in_data_parallel(
    jax_results,
):
    results, _ = jax_results
    # fit() trained 3 finite steps (0-2); step 3 had NaN on device 1.
    assert results["tracked_counters"]["skipped_steps"] == 1
    assert results["tracked_counters"]["iterations"] == 4
    assert [record[2:] for record in results["tracked_report"]] == [[1, 3]] * 4


@pytest.mark.backends("jax")
def test_data_parallel_matches_one_device_on_the_same_global_batch(jax_results):
    results, arrays = jax_results
    assert_close(
        np.concatenate([w.ravel() for w in _group(arrays, "data_parallel")]),
        np.concatenate([w.ravel() for w in _group(arrays, "one_device")]),
    )
    assert_close(results["data_parallel_loss"], results["one_device_loss"])


@pytest.mark.backends("jax")
def test_float16_aggregation_stays_within_tolerance_of_float32_on_jax(
    jax_results,
):
    # Inside a jitted step the cross-device sum is part of the sharded
    # backward pass, in the compute dtype; `aggregate_in_float16` rounds the
    # summed scaled gradients to float16, at the same cost as on TensorFlow.
    _, arrays = jax_results
    difference = _max_relative_difference(
        _group(arrays, "float16_aggregation"), _group(arrays, "data_parallel")
    )
    print(f"float16 aggregation: max relative difference {difference:.2e}")
    assert 0 < difference < FLOAT16_ALL_REDUCE_TOLERANCE


@pytest.mark.backends("jax")
def test_model_parallel_sharded_kernel_trains_like_one_device_and_skips_nan(
    jax_results,
):
    results, arrays = jax_results
    assert results["hidden_kernel_shard_shapes"] == [[4, 4], [4, 4]]
    assert_close(
        np.concatenate([w.ravel() for w in _group(arrays, "model_parallel")]),
        np.concatenate([w.ravel() for w in _group(arrays, "one_device")]),
    )
    assert_close(results["model_parallel_loss"], results["one_device_loss"])
    _assert_skipped_on_every_replica(
        results, arrays, "model_parallel", replicated=False
    )


@pytest.mark.backends("jax")
def test_state_keras_mp_creates_is_sharded_like_its_model_variable(
    jax_results,
):
    # Masters, their Adam slots, Lookahead's slow weights and a transform's
    # state for the (None, "model") kernel and ("model",) bias: each device
    # holds half, not a whole copy.
    results, _ = jax_results
    paths = results["model_parallel_state_paths"]
    for part in ("_master", "master_momentum", "master_velocity", "slow"):
        assert any(part in path for path in paths), (part, paths)
    assert sum("momentum_" in path for path in paths) == 2, paths
    total = results["model_parallel_state_bytes"]
    per_device = results["model_parallel_state_bytes_per_device"]
    print(
        f"state for the sharded layer: {total} bytes, {per_device} per device"
    )
    assert per_device == [total // 2, total // 2]


@pytest.mark.backends("jax")
def test_float8_state_follows_a_sharded_kernel_and_trains_like_one_device(
    jax_results,
):
    """`state_dtype="float8"` under ModelParallel: each moment's uint8
    codes are sharded like the (None, "model") kernel, their float32 block
    scales (one block of 128 here) are whole on each device; the weights
    match one device's, and a NaN step leaves codes and scales bit for bit
    on every device."""
    results, arrays = jax_results
    shards = results["float8_state_shards"]
    for moment in ("momentum", "velocity"):
        assert shards[f"kernel_{moment}"] == [["uint8", 4, 4]] * 2, shards
        assert shards[f"kernel_{moment}_scale"] == [["float32", 1]] * 2
    assert_close(
        np.concatenate(
            [w.ravel() for w in _group(arrays, "float8_model_parallel")]
        ),
        np.concatenate(
            [w.ravel() for w in _group(arrays, "float8_one_device")]
        ),
    )
    _assert_skipped_on_every_replica(
        results, arrays, "float8_model_parallel", replicated=False
    )


# --------------------------------------------------------------------------
# PyTorch: Keras has no distribution API for torch. A torch.distributed
# process group (gloo, two processes on 127.0.0.1) and an
# `aggregate_gradients=` callable that all-reduces the gradients make the
# optimizer's finite check see the same summed gradients in every process.

_TORCH_WORKER = """
import keras
import torch
import torch.distributed as dist
from keras import ops

rank = int(os.environ["RANK"])
world_size = int(os.environ["WORLD_SIZE"])
dist.init_process_group(
    "gloo",
    init_method=os.environ["KERAS_MP_TEST_INIT_METHOD"],
    rank=rank,
    world_size=world_size,
)


def all_reduce_mean(grads_and_vars):
    for grad, _ in grads_and_vars:
        if grad is not None:
            dist.all_reduce(grad)
            grad.div_(world_size)
    return grads_and_vars


model = make_model()
optimizer = make_optimizer(aggregate_gradients=all_reduce_mean)
variables = model.trainable_variables
rows = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)


def step(labels):
    model.zero_grad()
    y_pred = model(torch.as_tensor(x[rows]))
    loss = ops.mean(ops.square(y_pred - torch.as_tensor(labels[rows])))
    optimizer.scale_loss(loss).backward()
    with torch.no_grad():
        optimizer.apply([v.value.grad for v in variables], variables)


def state():
    return [
        ops.convert_to_numpy(v.value)
        for v in model.weights + optimizer.inner_optimizer.variables
    ]


def counters():
    return {
        "loss_scale": float(ops.convert_to_numpy(optimizer.loss_scale())),
        "skipped_steps": int(ops.convert_to_numpy(optimizer.skipped_steps)),
        "iterations": int(ops.convert_to_numpy(optimizer.iterations)),
    }


step(y)
save("before", state())
results["counters_before"] = counters()
poisoned = y.copy()
# Only process 1's rows hold a NaN.
poisoned[len(y) - 1] = np.nan
step(poisoned)
save("skipped", state())
results["counters_skipped"] = counters()
step(y)
save("applied", state())
results["counters_applied"] = counters()
dist.destroy_process_group()
finish()
"""


@pytest.mark.backends("torch")
@pytest.mark.slow
def test_torch_gloo_processes_skip_together_and_end_with_identical_weights(
    tmp_path,
):
    directories = [str(tmp_path / f"process{i}") for i in range(2)]
    for directory in directories:
        os.mkdir(directory)
    init_method = f"tcp://127.0.0.1:{_free_port()}"

    def worker_env(index):
        return {
            "KERAS_BACKEND": "torch",
            "OMP_NUM_THREADS": "1",
            "RANK": str(index),
            "WORLD_SIZE": "2",
            "KERAS_MP_TEST_INIT_METHOD": init_method,
        }

    _run_workers(_COMMON + _TORCH_WORKER, directories, worker_env)
    (results_0, arrays_0), (results_1, arrays_1) = map(_load, directories)
    for results, arrays in ((results_0, arrays_0), (results_1, arrays_1)):
        assert results["counters_before"] == {
            "loss_scale": 1024.0,
            "skipped_steps": 0,
            "iterations": 1,
        }
        # Process 0's own gradients were finite: it skipped because the
        # all-reduced ones were not.
        assert results["counters_skipped"] == {
            "loss_scale": 512.0,
            "skipped_steps": 1,
            "iterations": 1,
        }
        assert results["counters_applied"]["iterations"] == 2
        _assert_all_bitwise_equal(
            _group(arrays, "skipped"),
            _group(arrays, "before"),
            "the skipped step changed a variable",
        )
    for key in ("before", "skipped", "applied"):
        _assert_all_bitwise_equal(
            _group(arrays_1, key),
            _group(arrays_0, key),
            f"processes differ: {key}",
        )


_TF_FIT_IN_SCOPE = """
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)
import keras
import numpy as np

import keras_mp

x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
    keras_mp.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    history = model.fit(x, x[:, :4], batch_size=16, epochs=2, verbose=0)
print("RESULT", history.history["loss_scale"], history.history["skipped_steps"])
"""


@pytest.mark.backends("tensorflow")
@pytest.mark.slow
def test_fit_inside_the_strategy_scope_logs_the_loss_scale():
    # The loss-scale logger reads the optimizer's variables between steps;
    # a MirroredVariable read inside the scope once raised there.
    out = run_python(_TF_FIT_IN_SCOPE, env={"KERAS_BACKEND": "tensorflow"})
    line = [row for row in out.splitlines() if row.startswith("RESULT")][-1]
    assert line == "RESULT [32768.0, 32768.0] [0, 0]", line

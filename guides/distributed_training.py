"""Guide: loss-scaled training on several devices.

Data parallelism runs the same step on several devices, each on its share
of the global batch, and sums the gradients across them before the update.
With a dynamic loss scale that sum has to come first: one device's overflow
must make *every* device skip the step and lower the scale, or the copies of
the model drift apart. keras_mp's `LossScaleOptimizer` sums the gradients
once, in its `aggregate_gradients` stage, then checks them, unscales them,
clips or otherwise transforms them, and applies them: every replica sees the
same summed gradients and takes the same decision. The loop (or `fit`) does
not change; the strategy or distribution comes from TensorFlow or Keras.
The section that runs is chosen by the backend:

- TensorFlow: `tf.distribute.MirroredStrategy` (the devices of one
  machine) with `fit` and with a custom loop under `strategy.run`, then
  `tf.distribute.MultiWorkerMirroredStrategy` with two worker processes on
  this machine, each started with its own `TF_CONFIG`.
- JAX: `keras.distribution.DataParallel` (the batch split across devices),
  then `keras.distribution.ModelParallel` (a Dense kernel split across
  devices), both with `fit`; then two processes on this machine joined by
  `keras.distribution.initialize` (CPU collectives over gloo), training
  under one `DataParallel` with `fit`.
- PyTorch: Keras has no distribution API for torch. Two processes on this
  machine join a `torch.distributed` process group (gloo, 127.0.0.1). Each
  trains on its half of every batch: first passing `aggregate_gradients=`
  a callable that all-reduces the gradients, then a Keras model wrapped in
  `torch.nn.parallel.DistributedDataParallel` with the loop of Keras's DDP
  guide, then gradient accumulation under DDP's `no_sync`.

On a machine without accelerators the CPU is split into two devices, so
every section runs anywhere. Each ends with one batch that is NaN on one
device only, and shows that every device skipped it.

    python guides/distributed_training.py            # TensorFlow section
    KERAS_BACKEND=jax python guides/distributed_training.py
    KERAS_BACKEND=torch python guides/distributed_training.py
    python guides/distributed_training.py --quick    # a few steps (CI)

The guide starts its worker processes itself. On several machines, start
one per machine (or per accelerator) with its index and the address of
process 0; by hand on this machine, for a free port (here 12355):

    KERAS_BACKEND=jax python guides/distributed_training.py \
        --worker 0 --coordinator 127.0.0.1:12355 &
    KERAS_BACKEND=jax python guides/distributed_training.py \
        --worker 1 --coordinator 127.0.0.1:12355

and the same with `KERAS_BACKEND=torch` (the PyTorch processes). The
TensorFlow workers take a `TF_CONFIG` instead (see `start_workers`).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import warnings

# Device counts are fixed when a backend starts. For JAX, ask for two host
# devices before Keras imports it (GPUs and TPUs, where present, are used
# instead: the flag only splits the CPU).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mp  # noqa: E402

GLOBAL_BATCH_SIZE = 32


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("KERAS_MP_QUICK") == "1",
        help="a few steps only, for CI (also KERAS_MP_QUICK=1)",
    )
    parser.add_argument(
        "--worker",
        type=int,
        default=None,
        help="run as this MultiWorkerMirroredStrategy worker, JAX process "
        "or torch process (set by the guide itself when it starts them)",
    )
    parser.add_argument(
        "--coordinator",
        default=None,
        help="HOST:PORT of process 0, for the JAX and torch processes",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 4
    return args


# ## What every section shares
#
# A mixed_float16 policy (float16 math, float32 weights), a small regression
# model with float32 outputs, and synthetic data. The policy is set before
# the model is built; on a CPU the hardware check warns that float16 is slow
# there, which does not matter for a guide.


def set_policy():
    # The check runs when the first mixed layer is built: filtered for
    # the whole script, not only around set_global_policy.
    warnings.filterwarnings("ignore", "Mixed precision compatibility")
    keras_mp.set_global_policy("mixed_float16")


def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="relu", name="hidden"),
            keras.layers.Dense(1, name="head"),
            keras.layers.Activation("linear", dtype="float32"),
        ]
    )


def make_data(steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * GLOBAL_BATCH_SIZE, 16)).astype("float32")
    y = (x[:, :4].sum(axis=1, keepdims=True) + 0.1).astype("float32")
    return x, y


def to_float(value):
    return float(keras.ops.convert_to_numpy(value))


def report(name, optimizer, loss, loss_kind):
    print(
        f"  {name}: {loss_kind} loss {loss:.4f}, loss scale "
        f"{to_float(optimizer.loss_scale.loss_scale)}, applied steps "
        f"{int(to_float(optimizer.iterations))}, skipped steps "
        f"{int(to_float(optimizer.skipped_steps))}"
    )


# ## TensorFlow: MirroredStrategy
#
# Everything that creates variables (the model, the optimizer, `compile`)
# goes under `strategy.scope()`, so each variable is mirrored on every
# device. `fit` then splits each global batch across the replicas.
#
# `aggregate_in_float16=True` sums the *scaled* gradients across replicas in
# float16 (half the traffic) and unscales them in float32 afterwards (RFC
# 293); the loss scale keeps them in float16's range, and a sum that
# overflows is caught by the finite check like any other overflow.
#
# `jit_compile=False`: XLA cannot compile TensorFlow's cross-device
# collectives on CPUs, so this guide compiles without it (the same holds for
# any Keras optimizer).


def split_cpu_for_tensorflow():
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )


def mirrored_fit(strategy, steps):
    with strategy.scope():
        model = make_model()
        optimizer = keras_mp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-3), aggregate_in_float16=True
        )
        model.compile(optimizer, "mean_squared_error", jit_compile=False)
    x, y = make_data(steps)
    history = model.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, verbose=0)
    # The loss in the logs is the global batch's mean, as on one device.
    report("fit", optimizer, history.history["loss"][-1], "last-epoch mean")


# ## TensorFlow: a custom loop under `strategy.run`
#
# The replica step computes its share of the loss (summed over its rows,
# divided by the *global* batch size, so that the sum across replicas is
# the global mean) and calls `optimizer.minimize`. All the distributed work
# is inside the optimizer: one all-reduce of the scaled gradients, then the
# finite check, unscaling and update, the same on every replica. The same
# function runs under MultiWorkerMirroredStrategy below.
#
# `poisoned_replica` makes one replica's loss NaN: a stand-in for a float16
# overflow on one device only.


def custom_loop(strategy, steps):
    import tensorflow as tf

    with strategy.scope():
        model = make_model()
        optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
        optimizer.build(model.trainable_variables)
    poisoned_replica = tf.Variable(-1)
    x, y = make_data(steps)

    def dataset_fn(context):
        # Each input pipeline (one per worker) reads its own shard.
        batch_size = context.get_per_replica_batch_size(GLOBAL_BATCH_SIZE)
        return (
            tf.data.Dataset.from_tensor_slices((x, y))
            .shard(context.num_input_pipelines, context.input_pipeline_id)
            .batch(batch_size)
            .repeat()
        )

    batches = iter(strategy.distribute_datasets_from_function(dataset_fn))

    def replica_step(x, y):
        replica_id = (
            tf.distribute.get_replica_context().replica_id_in_sync_group
        )
        poisoned = tf.equal(poisoned_replica, replica_id)
        with tf.GradientTape() as tape:
            errors = keras.losses.mean_squared_error(y, model(x, training=True))
            loss = tf.reduce_sum(errors) / GLOBAL_BATCH_SIZE
            loss = loss * tf.where(poisoned, float("nan"), 1.0)
        optimizer.minimize(loss, model.trainable_variables, tape=tape)
        return loss

    @tf.function
    def train_step(batch):
        losses = strategy.run(replica_step, args=batch)
        return strategy.reduce("SUM", losses, axis=None)

    for _ in range(steps):
        loss = train_step(next(batches))
    report("custom loop", optimizer, float(loss), "last-step")

    weights = [keras.ops.convert_to_numpy(w) for w in model.weights]
    poisoned_replica.assign(strategy.num_replicas_in_sync - 1)
    train_step(next(batches))
    unchanged = all(
        np.array_equal(keras.ops.convert_to_numpy(w), before)
        for w, before in zip(model.weights, weights)
    )
    print(
        f"  NaN on replica {strategy.num_replicas_in_sync - 1} only: every "
        f"replica skipped the step (weights unchanged: {unchanged}), loss "
        f"scale now {to_float(optimizer.loss_scale.loss_scale)}"
    )
    return model


# ## TensorFlow: MultiWorkerMirroredStrategy
#
# Each worker is a process (usually one per machine) running the same
# script with a `TF_CONFIG` naming every worker and its own index; the
# strategy must be created before TensorFlow runs anything else. Here the
# guide starts two workers on this machine (loopback addresses and free
# ports) and checks that they end with identical weights.
#
# The workers run the custom loop: with several workers, Keras 3.15's
# TensorFlow `fit` fails before its first step (its symbolic build calls
# `strategy.reduce` on a tuple of per-replica batches), whatever the
# optimizer.


def run_worker(index, steps):
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    set_policy()
    model = custom_loop(strategy, steps)
    checksum = sum(
        float(np.sum(keras.ops.convert_to_numpy(w))) for w in model.weights
    )
    print(json.dumps({"worker": index, "checksum": checksum}))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(steps, num_workers=2):
    cluster = {
        "worker": [f"127.0.0.1:{free_port()}" for _ in range(num_workers)]
    }
    processes = []
    for index in range(num_workers):
        task = {"type": "worker", "index": index}
        env = dict(
            os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": task})
        )
        command = [sys.executable, __file__, "--worker", str(index)]
        processes.append(
            subprocess.Popen(
                [*command, "--steps", str(steps)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return processes


def wait_for_workers(processes, timeout=240):
    outputs = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=timeout)
            if process.returncode != 0:
                raise RuntimeError(f"A worker failed:\n{stderr[-3000:]}")
            outputs.append(stdout)
    finally:
        # A worker left alone would wait for the others forever.
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    checksums = []
    for output in outputs:
        # gloo's own connection messages left out.
        *lines, result = [
            line
            for line in output.rstrip().splitlines()
            if not line.startswith("[Gloo]")
        ]
        # The last line is the worker's result, sent as JSON.
        result = json.loads(result)
        checksums.append(result["checksum"])
        print(f"  worker {result['worker']}:")
        print("\n".join("  " + line for line in lines))
    print(
        f"  the {len(outputs)} workers end with identical weights (sum of "
        f"all weights {checksums[0]:.6f}): {len(set(checksums)) == 1}"
    )


def run_tensorflow(steps):
    import tensorflow as tf

    # The workers take a while to start and connect: they go first, and
    # the MirroredStrategy sections run meanwhile.
    workers = start_workers(steps)
    split_cpu_for_tensorflow()
    set_policy()
    strategy = tf.distribute.MirroredStrategy()
    print(f"MirroredStrategy over {strategy.num_replicas_in_sync} devices:")
    mirrored_fit(strategy, steps)
    custom_loop(strategy, steps)
    print("MultiWorkerMirroredStrategy, two workers on this machine:")
    wait_for_workers(workers)


# ## JAX: keras.distribution
#
# A distribution set with `keras.distribution.set_distribution` places every
# variable created afterwards, and `fit` shards each batch along the
# `"batch"` axis of the device mesh. Inside the jitted step the gradients of
# the global loss are already summed across devices (XLA inserts the
# all-reduce in the backward pass, in the compute dtype: float16 under this
# policy), so the optimizer's finite check, unscaling and update see the
# same gradients on every device, and one device's NaN makes all of them
# skip the step.


def jax_fit(name, steps, poisoned_rows):
    model = make_model()
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer, "mean_squared_error")
    x, y = make_data(steps)
    history = model.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, verbose=0)
    report(name, optimizer, history.history["loss"][-1], "last-epoch mean")

    weights = [keras.ops.convert_to_numpy(w) for w in model.weights]
    x, y = make_data(1)
    y[poisoned_rows] = np.nan
    model.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, verbose=0)
    unchanged = all(
        np.array_equal(keras.ops.convert_to_numpy(w), before)
        for w, before in zip(model.weights, weights)
    )
    print(
        f"  NaN labels in rows {poisoned_rows[0]}-{poisoned_rows[-1]}: every "
        f"device skipped the step (weights unchanged: {unchanged}), loss "
        f"scale now {to_float(optimizer.loss_scale.loss_scale)}"
    )
    return model


def rows_on_last_device(distribution):
    # The rows of a global batch that the data layout puts on the last
    # device.
    shape = (GLOBAL_BATCH_SIZE, 1)
    sharding = distribution.get_data_layout(shape).backend_layout
    last = distribution.device_mesh.devices.flatten()[-1]
    index = sharding.devices_indices_map(shape)[last]
    return list(range(GLOBAL_BATCH_SIZE)[index[0]])


# ## JAX: several processes
#
# Each process (usually one per machine) calls
# `keras.distribution.initialize` before JAX runs anything, with the address
# of process 0, the number of processes and its own index; `jax.devices()`
# then lists every process's devices, and a `DataParallel` over them spans
# the processes. On CPUs the processes' collectives run over gloo, the
# default of `jax_cpu_collectives_implementation` in jax 0.10 (where it is
# not, set `JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo` before JAX starts).
#
# Each process passes only its own rows to `fit` (`auto_shard_dataset=False`:
# with auto-sharding, Keras wants a `tf.data.Dataset` to shard), and Keras
# assembles the global batch. The jitted step sums the gradients across
# processes, so one process's NaN makes every process skip.


def run_jax_process(rank, steps, coordinator):
    import jax

    keras.distribution.initialize(
        job_addresses=coordinator, num_processes=2, process_id=rank
    )
    set_policy()
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(
            devices=jax.devices(), auto_shard_dataset=False
        )
    )
    model = make_model()
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer, "mean_squared_error")
    x, y = make_data(steps + 1)
    local = [local_batch(x, y, step, rank) for step in range(steps + 1)]
    x_local = np.concatenate([batch[0] for batch in local])
    y_local = np.concatenate([batch[1] for batch in local])
    half = GLOBAL_BATCH_SIZE // 2
    history = model.fit(
        x_local[:-half], y_local[:-half], batch_size=half, verbose=0
    )
    report(
        f"process {rank}",
        optimizer,
        history.history["loss"][-1],
        "last-epoch mean",
    )
    weights = [keras.ops.convert_to_numpy(w) for w in model.weights]
    if rank == 1:
        y_local[-half] = np.nan  # the last batch is NaN in process 1 only
    model.fit(x_local[-half:], y_local[-half:], batch_size=half, verbose=0)
    unchanged = all(
        np.array_equal(keras.ops.convert_to_numpy(w), before)
        for w, before in zip(model.weights, weights)
    )
    print(
        f"  NaN in process 1's rows: process {rank} skipped the step "
        f"(weights unchanged: {unchanged}), loss scale now "
        f"{to_float(optimizer.loss_scale.loss_scale)}"
    )
    checksum = sum(
        float(np.sum(keras.ops.convert_to_numpy(w))) for w in model.weights
    )
    print(json.dumps({"worker": rank, "checksum": checksum}))


def run_jax(steps):
    import jax

    # The processes take a while to start: they go first. One CPU device
    # each, so that the two are the mesh's devices.
    processes = start_processes(
        steps, {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    )
    set_policy()
    devices = jax.devices()

    data_parallel = keras.distribution.DataParallel(devices=devices)
    keras.distribution.set_distribution(data_parallel)
    print(f"DataParallel over {len(devices)} devices:")
    # NaN labels in the rows of the last device only.
    jax_fit("fit", steps, rows_on_last_device(data_parallel))

    # ModelParallel: a LayoutMap says how to split each variable, matched by
    # its path. Here the hidden kernel's columns (and its bias) are split
    # along the "model" axis; other variables are replicated.
    mesh = keras.distribution.DeviceMesh(
        (1, len(devices)), ["batch", "model"], devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*hidden/kernel"] = (None, "model")
    layout_map[".*hidden/bias"] = ("model",)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    print(
        f"ModelParallel, the hidden kernel split over {len(devices)} devices:"
    )
    # Every device holds every row of the batch here, so all rows are NaN.
    model = jax_fit("fit", steps, list(range(GLOBAL_BATCH_SIZE)))
    kernel = model.get_layer("hidden").kernel.value
    shapes = [tuple(shard.data.shape) for shard in kernel.addressable_shards]
    print(f"  hidden kernel {tuple(kernel.shape)}, shards {shapes}")
    print("DataParallel over two processes on this machine:")
    wait_for_workers(processes)


# ## PyTorch: torch.distributed and `aggregate_gradients=`
#
# The optimizer's stage 4, `aggregate_gradients`, takes a callable: here one
# that sums each gradient over the process group with
# `torch.distributed.all_reduce` and divides by the number of processes (the
# mean, as DistributedDataParallel computes it). Everything after it, the
# finite check included, then sees the same gradients in every process, so
# one process's NaN makes every process skip the step and lower its scale,
# and the copies of the model stay identical. Each process starts from the
# same seed, so the weights start identical too. On GPUs, use the "nccl"
# backend and one process per GPU; the all-reduce then runs on the device,
# and the step waits for the host only for its one read of the finite flag
# (none with `skip_on_device=True`).


def all_reduce_mean(grads_and_vars):
    import torch.distributed as dist

    world_size = dist.get_world_size()
    for grad, _ in grads_and_vars:
        if grad is not None:
            dist.all_reduce(grad)
            grad.div_(world_size)
    return grads_and_vars


def run_torch_process(rank, steps, coordinator):
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{coordinator}",
        rank=rank,
        world_size=2,
    )
    set_policy()
    model = make_model()
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(1e-3), aggregate_gradients=all_reduce_mean
    )
    loss_fn = keras.losses.MeanSquaredError()
    variables = model.trainable_variables
    half = GLOBAL_BATCH_SIZE // 2

    def train_step(x, y):
        model.zero_grad()
        loss = loss_fn(y, model(x, training=True))
        optimizer.scale_loss(loss).backward()
        with torch.no_grad():
            optimizer.apply([v.value.grad for v in variables], variables)
        return loss

    x, y = make_data(steps + 1)
    for step in range(steps + 1):
        rows = slice(
            step * GLOBAL_BATCH_SIZE + rank * half,
            step * GLOBAL_BATCH_SIZE + (rank + 1) * half,
        )
        x_step, y_step = x[rows], y[rows].copy()
        if step == steps and rank == 1:
            # The last batch is NaN in process 1 only.
            y_step[0] = np.nan
        loss = train_step(torch.as_tensor(x_step), torch.as_tensor(y_step))
    report(
        f"aggregate_gradients=, process {rank}",
        optimizer,
        to_float(loss),
        "last-step",
    )
    models = [model, ddp_train(rank, steps), no_sync_train(rank, steps)]
    checksum = sum(
        float(np.sum(keras.ops.convert_to_numpy(w)))
        for trained in models
        for w in trained.weights
    )
    dist.destroy_process_group()
    print(json.dumps({"worker": rank, "checksum": checksum}))


# ## PyTorch: DistributedDataParallel
#
# The loop of Keras's guide "Multi-GPU distributed training with PyTorch":
# the Keras model (a `torch.nn.Module` on this backend) is wrapped in
# `DistributedDataParallel`, called on the batch, and `backward()` makes
# DDP all-reduce (average) the gradients; the optimizer then sees the same
# gradients in every process. With a keras_mp `LossScaleOptimizer` the loop
# only gains `scale_loss` before `backward()` and calls `apply` with the
# scaled gradients (no `aggregate_gradients=` needed: DDP aggregated them).
# On GPUs pass `device_ids=[rank]` to DDP and use "nccl".
#
# For a float16 all-reduce, register DDP's compression hook,
# `ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)`
# (from `torch.distributed.algorithms.ddp_comm_hooks`): DDP all-reduces in
# backward, before the optimizer, so `aggregate_in_float16=True` cannot
# change that sum and raises a ValueError that says so.


def local_batch(x, y, step, rank):
    half = GLOBAL_BATCH_SIZE // 2
    start = step * GLOBAL_BATCH_SIZE + rank * half
    return x[start : start + half], y[start : start + half].copy()


def ddp_train(rank, steps):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = make_model()
    ddp_model = DistributedDataParallel(model)
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    loss_fn = keras.losses.MeanSquaredError()
    variables = model.trainable_variables
    x, y = make_data(steps + 1)
    for step in range(steps + 1):
        x_step, y_step = local_batch(x, y, step, rank)
        if step == steps and rank == 1:
            y_step[0] = np.nan  # the last batch is NaN in process 1 only
        ddp_model.zero_grad()
        loss = loss_fn(
            torch.as_tensor(y_step), ddp_model(torch.as_tensor(x_step))
        )
        optimizer.scale_loss(loss).backward()  # DDP all-reduces here
        with torch.no_grad():
            optimizer.apply([v.value.grad for v in variables], variables)
    report(f"DDP, process {rank}", optimizer, to_float(loss), "last-step")
    return model


# ## PyTorch: gradient accumulation under DDP's `no_sync`
#
# To update once per several micro-batches without an all-reduce per
# micro-batch, torch's recipe keeps the gradients in the parameters'
# `.grad`: the micro-batches before the last run under `ddp_model.no_sync()`
# (no all-reduce, each process's `.grad` holds its own sum), the last one's
# `backward()` all-reduces the whole window's sum, and `apply` runs once per
# window. A NaN in any micro-batch of any process reaches that sum, so
# every process skips the window.
#
# An inner optimizer with Keras's `gradient_accumulation_steps` (under a
# keras_mp LossScaleOptimizer) works too, with `apply` at every
# micro-step: its accumulators hold each process's own micro-gradients
# under `no_sync`, so keras_mp reduces the window's finite flag with MAX
# across processes (a non-finite micro-step anywhere discards the window
# everywhere) and averages the accumulators across processes before the
# window's update (one all-reduce per window), so every process applies the
# global window. Accumulating in `.grad`, as here, needs neither.


def no_sync_train(rank, steps, micro_batches=2):
    import contextlib

    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = make_model()
    ddp_model = DistributedDataParallel(model)
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    loss_fn = keras.losses.MeanSquaredError()
    variables = model.trainable_variables
    x, y = make_data((steps + 1) * micro_batches)
    for window in range(steps + 1):
        ddp_model.zero_grad()
        for micro in range(micro_batches):
            x_step, y_step = local_batch(
                x, y, window * micro_batches + micro, rank
            )
            if window == steps and micro == 0 and rank == 1:
                y_step[0] = np.nan  # the first micro-batch of process 1
            last = micro == micro_batches - 1
            with contextlib.nullcontext() if last else ddp_model.no_sync():
                loss = loss_fn(
                    torch.as_tensor(y_step), ddp_model(torch.as_tensor(x_step))
                )
                optimizer.scale_loss(loss / micro_batches).backward()
        with torch.no_grad():
            optimizer.apply([v.value.grad for v in variables], variables)
    report(
        f"no_sync, process {rank}",
        optimizer,
        to_float(loss),
        "last-micro-batch",
    )
    return model


def start_processes(steps, env=None):
    # Processes of one job: the same script with its index and process 0's
    # address.
    coordinator = f"127.0.0.1:{free_port()}"
    return [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(rank)]
            + ["--steps", str(steps), "--coordinator", coordinator],
            env=dict(os.environ, **(env or {})),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]


def run_torch(steps):
    print("torch.distributed (gloo), two processes on this machine:")
    wait_for_workers(start_processes(steps))


def main(argv=None):
    args = parse_args(argv)
    backend = keras.backend.backend()
    if args.worker is not None:
        if backend == "torch":
            run_torch_process(args.worker, args.steps, args.coordinator)
        elif backend == "jax":
            run_jax_process(args.worker, args.steps, args.coordinator)
        else:
            run_worker(args.worker, args.steps)
        return
    if backend == "tensorflow":
        run_tensorflow(args.steps)
    elif backend == "jax":
        run_jax(args.steps)
    elif backend == "torch":
        run_torch(args.steps)
    else:
        print(
            "This guide has TensorFlow, JAX and PyTorch sections, not "
            f"{backend}."
        )


if __name__ == "__main__":
    main()

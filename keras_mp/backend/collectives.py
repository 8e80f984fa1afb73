"""Collectives that `keras.ops` cannot express.

Imports nothing from keras_mp.

Across PyTorch processes (`torch.distributed`): the finite flag of a step,
reduced so that every process decides alike (`all_processes_finite`), the
gradient accumulators averaged at a window's end
(`average_across_processes_where`), and the check that
`aggregate_in_float16` can take effect (`check_float16_aggregation`).

Collective keys of tf.distribute strategies:

Every `MirroredStrategy` of a process numbers its collectives from the same
group key and instance key 100, and TensorFlow's collective runtime remembers
the dtype of each (group, instance) pair for the life of the process. A second
strategy whose first all-reduce has another dtype than the first strategy's
(a float16 all-reduce after a float32 one, as `aggregate_in_float16` gives)
then fails with "Collective instance 100 expected type 0 and data_type 1 but
got type 0 and data_type 19". Giving each strategy keras_mp trains under its
own group key keeps their collectives apart, as TensorFlow's own tests do
with `_collective_key_base`.
"""

import itertools
import threading
import weakref

import keras

# Spacing of TensorFlow's own tests (strategy_combinations.py).
_GROUP_KEY_SPACING = 100000

_seen = weakref.WeakSet()
_lock = threading.Lock()
_next_offset = itertools.count(1)


def use_distinct_collective_keys():
    """Gives the active MirroredStrategy a group key of its own, once.

    A no-op outside TensorFlow, outside a strategy, and for strategies other
    than a `MirroredStrategy` whose all-reduces use collective ops (workers of
    a MultiWorkerMirroredStrategy must agree on keys, so they are left as
    TensorFlow numbered them).
    """
    if keras.backend.backend() != "tensorflow":
        return
    import tensorflow as tf

    if not tf.distribute.has_strategy():
        return
    strategy = tf.distribute.get_strategy()
    if type(strategy) is not tf.distribute.MirroredStrategy:
        return
    with _lock:
        if strategy in _seen:
            return
        _seen.add(strategy)
        _renumber(strategy.extended)


def _renumber(extended):
    # `_collective_ops`, `_cross_device_ops`, `_collective_keys` and
    # `_collective_key_base` are MirroredExtended's (tensorflow 2.16 - 2.21).
    from tensorflow.python.distribute import cross_device_ops
    from tensorflow.python.distribute import cross_device_utils

    collective_ops = getattr(extended, "_collective_ops", None)
    if type(collective_ops) is not cross_device_ops.CollectiveAllReduce:
        return
    keys = cross_device_utils.CollectiveKeys(
        group_key_start=1
        + extended._collective_key_base
        + _GROUP_KEY_SPACING * next(_next_offset)
    )
    renumbered = cross_device_ops.CollectiveAllReduce(
        devices=collective_ops._devices,
        group_size=collective_ops._group_size,
        options=collective_ops._options,
        collective_keys=keys,
    )
    if extended._cross_device_ops is collective_ops:
        extended._cross_device_ops = renumbered
    extended._collective_ops = renumbered
    extended._collective_keys = keys


def _torch_world_size():
    """Processes in torch's default process group (1 when there is none)."""
    if keras.backend.backend() != "torch":
        return 1
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def all_processes_finite(is_finite):
    """Whether `is_finite` holds in every torch.distributed process.

    Under DistributedDataParallel's `no_sync`, each process accumulates its
    own local gradients until the last micro-step of a window, so a NaN in
    one process's rows makes only its own flag False. Reduced with MAX (of
    "not finite"), as torch's `ShardedGradScaler` reduces `found_inf`, the
    flag is the same in every process and they all discard the window
    together. One scalar all-reduce, queued on the device like the
    gradients' (no host read); every process must make the same calls.

    Args:
        is_finite: A bool scalar tensor of this process.

    Returns:
        The flag of every process; `is_finite` itself outside PyTorch or
        without a process group of several processes.
    """
    if _torch_world_size() == 1:
        return is_finite
    import torch
    import torch.distributed as dist

    # gloo has no MAX for bool tensors; int32 it has.
    not_finite = torch.logical_not(is_finite).to(torch.int32)
    dist.all_reduce(not_finite, op=dist.ReduceOp.MAX)
    return not_finite == 0


def average_across_processes_where(condition, variables):
    """Averages `variables` across torch.distributed processes if
    `condition` holds.

    For the gradient accumulators of Keras's `gradient_accumulation_steps`
    under DistributedDataParallel: inside `no_sync` each process adds only
    its own micro-gradients, so at the window's last micro-step the
    processes hold different sums and would apply different updates.
    DistributedDataParallel averages gradients, so the average of the
    accumulators is the global window's (and a no-op, across processes that
    already agree, when every micro-step was synced). One all-reduce of all
    accumulators, at the last micro-step only: `condition` is read on the
    host, as PyTorch's eager step may (DESIGN.md: "The skip decision and
    the host"), and only with a process group of several processes.

    Args:
        condition: A bool scalar tensor, the same in every process.
        variables: Keras variables (one all-reduce per dtype).
    """
    world_size = _torch_world_size()
    if world_size == 1 or not variables or not bool(condition):
        return
    import torch
    import torch.distributed as dist

    by_dtype = {}
    for variable in variables:
        by_dtype.setdefault(variable.value.dtype, []).append(variable)
    for group in by_dtype.values():
        values = [v.value for v in group]
        flat = torch.cat([value.reshape(-1) for value in values])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(world_size)
        parts = torch.split(flat, [value.numel() for value in values])
        for variable, part in zip(group, parts):
            variable.assign(part.view_as(variable.value))


def check_float16_aggregation(has_aggregate_gradients_fn):
    """Refuses `aggregate_in_float16=True` where it would do nothing.

    On PyTorch keras_mp sums no gradients across processes itself: under
    DistributedDataParallel they are all-reduced in `backward()`, in their
    own dtype, before the optimizer sees them. Only an `aggregate_gradients`
    callable (which then receives float16 gradients) or DDP's own
    compression hook can make that sum float16.

    Args:
        has_aggregate_gradients_fn: Whether the optimizer was given an
            `aggregate_gradients` callable.

    Raises:
        ValueError: on PyTorch with several processes and no callable.
    """
    world_size = _torch_world_size()
    if world_size == 1 or has_aggregate_gradients_fn:
        return
    raise ValueError(
        "`aggregate_in_float16=True` all-reduces scaled gradients in "
        "float16, but on PyTorch keras_mp does not all-reduce them: "
        "DistributedDataParallel does, in `backward()`, in float32, before "
        "the optimizer sees them. Received: aggregate_in_float16=True with "
        f"a torch.distributed process group of {world_size} processes and "
        "no `aggregate_gradients` callable. For a float16 all-reduce under "
        "DDP, leave aggregate_in_float16=False and register DDP's hook: "
        "`ddp_model.register_comm_hook(None, torch.distributed.algorithms."
        "ddp_comm_hooks.default_hooks.fp16_compress_hook)`. Or pass "
        "`aggregate_gradients=` a callable that all-reduces the gradients "
        "(it then receives them in float16)."
    )

"""Collective keys of tf.distribute strategies: what `keras.ops` cannot express.

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

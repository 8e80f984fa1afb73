"""Optimizer state in a dtype of its own: what `keras.ops` cannot express.

How a Keras optimizer's update is routed (through `update_step`, or torch's
fused update in `torch/fused_state_update.py`) and compiled with XLA on
TensorFlow.
"""

import keras

from keras_mp import _keras_internals


def route_updates_through_update_step(optimizer, fused_update=None):
    """Makes `optimizer` update its slots with `update_step` and `assign`.

    On PyTorch, Keras's built-in optimizers update all slots at once with
    `torch._foreach_*` calls, which never go through the optimizer's
    `assign`/`assign_add`/`assign_sub`; low-precision state needs every slot
    store to pass there (read upcast, compute float32, store rounded). This
    shadows, on this instance only, `_backend_update_step` with the one the
    class would have without the bulk path (`update_step` per variable,
    after any work of its own, as Nadam's). Other backends already go
    through `update_step`; nothing is changed there.

    `fused_update`, a `FusedStateUpdate`, runs instead where it can (it
    returns whether it did): the same update, bit for bit, in far fewer
    and cheaper PyTorch calls.
    """
    if keras.backend.backend() != "torch":
        return
    parallel = _keras_internals.torch_parallel_optimizer_class()
    if not isinstance(optimizer, parallel):
        return
    import torch

    generic = super(parallel, optimizer)._backend_update_step

    def _backend_update_step(grads, trainable_variables, learning_rate):
        with torch.no_grad():
            if fused_update is not None and fused_update(
                grads, trainable_variables, learning_rate
            ):
                return
            generic(grads, trainable_variables, learning_rate)

    optimizer.__dict__["_backend_update_step"] = _backend_update_step


def compiled_elementwise(fn):
    """`fn`, compiled into fused kernels where the step would otherwise run
    each of its elementwise operations as a pass over memory of its own.

    TensorFlow without XLA (Keras's default on CPUs and in `run_eagerly`)
    runs one kernel per operation; there `fn` becomes an XLA-compiled
    `tf.function` (inlined where the step is already compiled with XLA).
    JAX and `jit_compile` steps already fuse, and eager PyTorch has no
    compiler it could count on (`torch/fused_state_update.py` replaces the
    per-variable path instead): `fn` is returned as it is. `fn` must be a
    module-level function of tensors only; one compiled version is kept
    per function.
    """
    if keras.backend.backend() != "tensorflow":
        return fn
    compiled = _compiled.get(fn)
    if compiled is None:
        import tensorflow as tf

        compiled = tf.function(fn, jit_compile=True, autograph=False)
        _compiled[fn] = compiled
    return compiled


# Per function: its XLA-compiled `tf.function` (see `compiled_elementwise`).
_compiled = {}


def compile_update_with_xla(optimizer):
    """Makes `optimizer` update its variables in one XLA-compiled function.

    TensorFlow only, and only outside `tf.distribute` strategies (whose
    updates go through `merge_call`, which an XLA function cannot hold).
    Without XLA (Keras's default on CPUs) every operation of an update is
    a kernel of its own, and 16-bit slots add several casts per slot,
    each a pass over it; compiled, the casts, the float32 math and the
    rounded store of each slot fuse into a few loops. This shadows, on this
    instance only, `_backend_update_step` with a `tf.function(jit_compile=
    True)` of it, one per list of variables (compiled once, at the first
    step), for Keras's built-in optimizers only (the exact classes: a
    subclass keeps the uncompiled update). Inside a step already compiled
    with XLA it is inlined. Other
    backends already fuse (JAX) or have their own fused update (PyTorch,
    `FusedStateUpdate`): nothing is changed there.
    """
    if keras.backend.backend() != "tensorflow":
        return
    if type(optimizer) not in _xla_safe_optimizer_classes():
        # A subclass or a user's optimizer may use operations XLA cannot
        # compile, and the error would come only when a step runs.
        return
    import tensorflow as tf

    original = optimizer._backend_update_step
    compiled = {}

    def _backend_update_step(grads, trainable_variables, learning_rate):
        if tf.distribute.has_strategy():
            return original(grads, trainable_variables, learning_rate)
        variables = list(trainable_variables)
        key = tuple(id(v) for v in variables)
        update = compiled.get(key)
        if update is None:

            def update_all(grads, learning_rate):
                original(grads, variables, learning_rate)

            update = tf.function(update_all, jit_compile=True, autograph=False)
            compiled[key] = update
        update(list(grads), tf.convert_to_tensor(learning_rate))

    optimizer.__dict__["_backend_update_step"] = _backend_update_step


def _xla_safe_optimizer_classes():
    """Keras's built-in optimizers, which Keras itself compiles with XLA."""
    names = (
        "Adadelta",
        "Adafactor",
        "Adagrad",
        "Adam",
        "Adamax",
        "AdamW",
        "Ftrl",
        "Lamb",
        "Lion",
        "Nadam",
        "RMSprop",
        "SGD",
    )
    return {getattr(keras.optimizers, name) for name in names}

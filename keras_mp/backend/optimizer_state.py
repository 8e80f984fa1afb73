"""Optimizer state in a dtype of its own: what `keras.ops` cannot express."""

import keras

from keras_mp import _keras_internals


def route_updates_through_update_step(optimizer):
    """Makes `optimizer` update its slots with `update_step` and `assign`.

    On PyTorch, Keras's built-in optimizers update all slots at once with
    `torch._foreach_*` calls, which never go through the optimizer's
    `assign`/`assign_add`/`assign_sub`; low-precision state needs every slot
    store to pass there (read upcast, compute float32, store rounded). This
    shadows, on this instance only, `_backend_update_step` with the one the
    class would have without the bulk path (`update_step` per variable,
    after any work of its own, as Nadam's). Other backends already go
    through `update_step`; nothing is changed there.
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
            generic(grads, trainable_variables, learning_rate)

    optimizer.__dict__["_backend_update_step"] = _backend_update_step

"""Gradients and cross-replica aggregation: what `keras.ops` cannot express.

Imports nothing from keras_mp.
"""

import collections
import functools
import threading

import keras


def _backend():
    return keras.backend.backend()


def compute_gradients(loss, variables, tape=None):
    """Gradients of `loss` with respect to `variables`, one per variable.

    Args:
        loss: A scalar tensor (TensorFlow, with `tape`) or a zero-argument
            callable returning the loss (any backend). On JAX and PyTorch
            the loss must be a callable: gradients are taken by re-running it.
        variables: A list of Keras variables.
        tape: A `tf.GradientTape` that recorded `loss` (TensorFlow only).

    Returns:
        A list of gradients (None where `loss` does not depend on a variable).
    """
    backend = _backend()
    if backend == "tensorflow":
        return _tensorflow_gradients(loss, variables, tape)
    if tape is not None:
        raise ValueError(
            "`tape` is a TensorFlow GradientTape and only works with the "
            f"TensorFlow backend. Received: tape={tape!r} with the {backend} "
            "backend. Pass the loss as a zero-argument callable instead."
        )
    if not callable(loss):
        raise TypeError(
            f"On the {backend} backend the loss must be a zero-argument "
            "callable, so that its gradients can be computed. Received: "
            f"loss={loss!r}. Pass `lambda: compute_loss(...)` instead."
        )
    if backend == "jax":
        return _jax_gradients(loss, variables)
    if backend == "torch":
        return _torch_gradients(loss, variables)
    raise ValueError(f"Unsupported Keras backend: {backend!r}")


def _tensorflow_gradients(loss, variables, tape):
    import tensorflow as tf

    if callable(loss):
        with tf.GradientTape() as tape:
            tape.watch([v.value for v in variables])
            loss = loss()
    elif tape is None:
        raise ValueError(
            "A tensor loss needs the `tf.GradientTape` that recorded it. "
            "Received: tape=None. Pass `tape=tape`, or pass the loss as a "
            "zero-argument callable."
        )
    return tape.gradient(loss, [v.value for v in variables])


def _jax_gradients(loss_fn, variables):
    import jax

    def loss_of(values):
        mapping = list(zip(variables, values))
        with keras.StatelessScope(state_mapping=mapping):
            return loss_fn()

    values = [v.value for v in variables]
    return list(jax.grad(loss_of)(values))


def _torch_gradients(loss_fn, variables):
    import torch

    loss = loss_fn()
    values = [v.value for v in variables]
    grads = torch.autograd.grad(loss, values, allow_unused=True)
    return list(grads)


def _replica_context_of_several():
    """The tf.distribute replica context when running in one with several
    replicas, else None (another backend, no strategy, cross-replica
    context, or a single replica)."""
    if _backend() != "tensorflow":
        return None
    import tensorflow as tf

    if (
        not tf.distribute.has_strategy()
        or tf.distribute.in_cross_replica_context()
    ):
        return None
    replica_context = tf.distribute.get_replica_context()
    if replica_context.num_replicas_in_sync == 1:
        return None
    return replica_context


def all_reduce_sum(grads):
    """Sums gradients across replicas when running under tf.distribute.

    Outside a replica context (one device, or JAX where sharded gradients
    are already global inside `jax.jit`) the gradients are returned as is.
    """
    replica_context = _replica_context_of_several()
    present = [g for g in grads if g is not None]
    if replica_context is None or not present:
        return grads
    import tensorflow as tf

    reduced = iter(
        replica_context.all_reduce(tf.distribute.ReduceOp.SUM, present)
    )
    return [None if g is None else next(reduced) for g in grads]


def all_reduce_max(values):
    """Elementwise maximum across replicas under tf.distribute.

    For the values a variable overwrites itself with (Keras's float8 amax
    histories and scales), where the largest replica's covers them all.
    `tf.distribute.ReduceOp` has no MAX: each replica gathers all values
    and takes their maximum. Elsewhere the values are returned as they are
    (JAX's are global inside `jax.jit`).
    """
    replica_context = _replica_context_of_several()
    if replica_context is None or all(v is None for v in values):
        return values
    import tensorflow as tf

    return [
        None
        if v is None
        else tf.reduce_max(
            replica_context.all_gather(tf.expand_dims(v, 0), axis=0), axis=0
        )
        for v in values
    ]


def apply_aggregated(optimizer, grads, variables):
    """Applies already aggregated gradients with a plain Keras optimizer.

    Keras's TensorFlow optimizer all-reduces gradients inside `apply`; the
    wrapper has aggregated them once already in its `aggregate_gradients`
    stage, so the second sum is switched off for this call.
    """
    if _backend() != "tensorflow":
        optimizer.apply(grads, variables)
        return
    import tensorflow as tf

    if not tf.distribute.has_strategy():
        optimizer.apply(grads, variables)
        return
    # `_all_reduce_sum_gradients` is the TensorFlow optimizer's hook for this
    # sum (keras 3.0 - 3.15); an instance attribute shadows it for one call.
    # MirroredStrategy runs its replicas in threads that interleave at each
    # `merge_call`: a replica may leave `apply` while another is still inside
    # it, so the shadow counts its users and the last one removes it.
    with _shadow_lock:
        if not _shadow_users[id(optimizer)]:
            optimizer._all_reduce_sum_gradients = _already_aggregated
        _shadow_users[id(optimizer)] += 1
    try:
        optimizer.apply(grads, variables)
    finally:
        with _shadow_lock:
            _shadow_users[id(optimizer)] -= 1
            if not _shadow_users[id(optimizer)]:
                del _shadow_users[id(optimizer)]
                del optimizer._all_reduce_sum_gradients


def _already_aggregated(grads_and_vars):
    return grads_and_vars


# Per optimizer id: the replica threads inside `apply_aggregated`.
_shadow_users = collections.Counter()
_shadow_lock = threading.Lock()


def cond_update(condition, update, grads_and_vars):
    """Runs `update(grads_and_vars)` only where the bool `condition` holds.

    TensorFlow only. `condition` must be the same on every replica (it is
    computed from aggregated gradients). In a tf.distribute replica context
    a `tf.cond` branch cannot contain a `merge_call`, and a Keras optimizer's
    update makes one: always to increment its "only_first_replica"
    `iterations` (TensorFlow broadcasts such assignments through a
    `merge_call` even where the strategy otherwise avoids them, as under XLA
    on GPUs, keras-team/keras#21366), and to update mirrored variables where
    the strategy synchronizes with `merge_call`. So in a replica context the
    cond runs in cross-replica context, and each replica runs `update` with
    its own `grads_and_vars` inside the taken branch.
    """
    import tensorflow as tf

    if (
        not tf.distribute.has_strategy()
        or tf.distribute.in_cross_replica_context()
    ):
        tf.cond(condition, lambda: update(grads_and_vars), lambda: None)
        return

    def cross_replica(strategy, condition, grads_and_vars):
        # Every replica computed the same condition; the first local one
        # decides, as the "only_first_replica" loss scale variables do.
        condition = strategy.experimental_local_results(condition)[0]

        def apply():
            strategy.extended.call_for_each_replica(
                update, args=(grads_and_vars,)
            )

        tf.cond(condition, apply, lambda: None)

    tf.distribute.get_replica_context().merge_call(
        cross_replica, args=(condition, grads_and_vars)
    )


def update_in_place_unless_skipped(
    condition, update, grads_and_vars, targets, backups
):
    """Runs `update(grads_and_vars)` in place; `targets` keep their values
    bit for bit where the bool tensor `condition` is False.

    PyTorch only, for `LossScaleOptimizer(..., skip_on_device=True)`. Each
    target's value is saved, the update runs in place whatever `condition`
    is, then each target is selected with `torch.where` between its new and
    its saved value. The decision never leaves the device: no tensor becomes
    a Python bool, and a GPU step never waits for the host (the default
    skip, like torch AMP's GradScaler, reads the flag on the host every
    step). The price is one copy of the targets (weights and optimizer
    state) and one select per step. `targets` must hold every variable
    `update` may write.

    `backups`, a `SkipBackups` kept by the caller, holds the saved values
    from one step to the next: copied into in one multi-tensor call, not
    allocated afresh each step (fresh allocations of the size of the whole
    state are returned to the system and fault their pages in again every
    step, which made the copy cost three times as much inside `fit`).
    """
    import torch

    with torch.no_grad():
        values = [target.value for target in targets]
        saved = backups.like(values)
        torch._foreach_copy_(saved, values)
        update(grads_and_vars)
        for target, old in zip(targets, saved):
            # Read again: the update may have replaced a variable's tensor.
            new = target.value
            torch.where(condition.to(new.device), new, old, out=new)


def unscale_and_check_finite(grads, variables, factor, unscale):
    """The gradients unscaled, and whether every value of every one is finite.

    PyTorch only: the check-and-unscale pass of `torch.amp.GradScaler`, one
    `torch._amp_foreach_non_finite_check_and_unscale_` call per group of
    gradients of one device and dtype (float16, bfloat16 and float32 alike).
    Each (scaled) value is checked, then multiplied by the float32 scalar
    `factor` where `unscale` says so, in float32 arithmetic. A gradient
    that is its variable's `.grad` (as `fit` and loops of `backward()` then
    `apply` pass them) is unscaled in place, as GradScaler's `unscale_`
    does; any other tensor is copied first, so that the caller's tensors
    keep their values.

    Args:
        grads: A list of gradients; None entries pass through.
        variables: Their Keras variables, one per gradient.
        factor: A float32 scalar tensor, the reciprocal of the loss scale,
            or None where `unscale` is False for every gradient.
        unscale: One bool per gradient: whether it is multiplied by
            `factor` (else only checked, as a variable that overwrites
            itself with its gradient is).

    Returns:
        `(grads, is_finite)`: the gradients, and a bool scalar tensor on
        the device of the first gradient (True when there is none).
    """
    import torch

    result = list(grads)
    groups = collections.defaultdict(list)
    for i, grad in enumerate(grads):
        if grad is not None:
            groups[(grad.device, grad.dtype, bool(unscale[i]))].append(i)
    found_inf = {}
    for (device, _, scaled), indices in groups.items():
        tensors = [grads[i] for i in indices]
        copied = [
            k
            for k, i in enumerate(indices)
            if not _is_grad_attribute(tensors[k], variables[i])
        ]
        if copied:
            copies = torch._foreach_mul([tensors[k] for k in copied], 1.0)
            for k, copy in zip(copied, copies):
                tensors[k] = copy
        if device not in found_inf:
            found_inf[device] = torch.zeros(1, device=device)
        if scaled:
            inverse = factor.to(device=device, dtype=torch.float32).reshape(1)
        else:
            inverse = _torch_one(device)
        torch._amp_foreach_non_finite_check_and_unscale_(
            tensors, found_inf[device], inverse
        )
        for i, tensor in zip(indices, tensors):
            result[i] = tensor
    if not found_inf:
        return result, torch.tensor(True)
    flags = list(found_inf.values())
    total = flags[0]
    for flag in flags[1:]:
        total = total + flag.to(total.device)
    return result, total.reshape(()) == 0


# device -> the float32 tensor [1.0] the check multiplies by where it
# only checks (made once: a new one each step cost an allocation).
_TORCH_ONES = {}


def _torch_one(device):
    one = _TORCH_ONES.get(device)
    if one is None:
        import torch

        one = _TORCH_ONES[device] = torch.ones(1, device=device)
    return one


def _is_grad_attribute(grad, variable):
    """Whether `grad` is the `.grad` of the variable's tensor."""
    value = getattr(variable, "value", None)
    return (
        getattr(value, "is_leaf", False)
        and getattr(value, "grad", None) is grad
    )


class SkipBackups:
    """Buffers for `update_in_place_unless_skipped` to save values into,
    reused while the values keep their shapes, dtypes and devices."""

    def __init__(self):
        self._buffers = []

    def like(self, values):
        """Buffers matching `values` one for one (new ones if they do not)."""
        import torch

        buffers = self._buffers
        if len(buffers) != len(values) or any(
            b.shape != v.shape or b.dtype != v.dtype or b.device != v.device
            for b, v in zip(buffers, values)
        ):
            buffers = [torch.empty_like(v) for v in values]
            self._buffers = buffers
        return buffers


def all_finite(grads):
    """Whether every value of every gradient is finite: a bool scalar tensor.

    One reduction per gradient and one check of their results, instead of
    an elementwise `isfinite` and a reduction per gradient (on PyTorch's
    CPU kernels the sum is also 15x faster than `all(isfinite(g))`): a
    gradient holding an inf or a NaN has a non-finite sum (inf - inf is
    NaN). See `gradient_sum` for the one approximation.

    Args:
        grads: A list of gradients; None entries are ignored.

    Returns:
        A bool scalar tensor, True when there is no gradient.
    """
    from keras import ops

    sums = [gradient_sum(g) for g in grads if g is not None]
    if not sums:
        return ops.convert_to_tensor(True)
    return ops.all(ops.isfinite(ops.stack(sums)))


def gradient_sum(grad):
    """The sum of a gradient's values, in float32 at least.

    Finite exactly when every value is, with one exception: values that
    are all finite but sum beyond float32's range (about 3.4e38, a loss
    scale one doubling from overflowing) give a non-finite sum too. float16
    values are summed in float32, so that finite ones summing beyond
    float16's range (65504) are no false alarm.
    """
    from keras import ops

    values = gradient_values(grad)
    if keras.backend.standardize_dtype(values.dtype) not in _WIDE_FLOATS:
        values = ops.cast(values, "float32")
    return ops.sum(values)


_WIDE_FLOATS = ("float32", "float64")


def multiply_all(grads, factor):
    """Each gradient times the float32 scalar `factor`, in its own dtype.

    None passes through; sparse gradients stay sparse. On PyTorch the dense
    gradients of each dtype are multiplied by one multi-tensor kernel.
    """
    from keras import ops

    if _backend() == "torch":
        import torch

        result = list(grads)
        by_dtype = collections.defaultdict(list)
        for i, g in enumerate(grads):
            if g is not None:
                by_dtype[g.dtype].append(i)
        for dtype, indices in by_dtype.items():
            products = torch._foreach_mul(
                [grads[i] for i in indices], factor.to(dtype)
            )
            for i, product in zip(indices, products):
                result[i] = product
        return result
    return [
        None
        if g is None
        else map_gradient(
            lambda values: ops.multiply(values, ops.cast(factor, values.dtype)),
            g,
        )
        for g in grads
    ]


def copies_for_update(values):
    """`values` for an update that must not change them: copies on PyTorch.

    Keras's PyTorch optimizers update the tensors they are given in place,
    even inside a `StatelessScope`; the other backends' never do.
    """
    if _backend() == "torch":
        return [value.clone() for value in values]
    return values


def gradient_values(grad):
    """The dense values of a gradient (a `tf.IndexedSlices`'s `values`)."""
    return getattr(grad, "values", grad) if _is_indexed_slices(grad) else grad


def map_gradient(fn, grad):
    """Applies `fn` to a gradient's values, keeping sparse gradients sparse."""
    if _is_indexed_slices(grad):
        import tensorflow as tf

        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


def _is_indexed_slices(grad):
    return type(grad).__name__ == "IndexedSlices" and hasattr(grad, "indices")


def custom_gradient(f):
    """`keras.ops.custom_gradient(f)`, except on PyTorch, where the
    arguments are not saved for the backward: Keras's PyTorch version
    saves them all (`ctx.save_for_backward(*args)`), so an FP8 layer kept
    its bfloat16 input beside the codes its gradient reads, where JAX's
    and TensorFlow's graphs keep only what the gradient function uses.
    `f`'s gradient function is called with the output gradient alone, by
    name (`upstream=`), as Keras's PyTorch version also passes it."""
    if keras.backend.backend() != "torch":
        return keras.ops.custom_gradient(f)

    def wrapped(*args):
        return _torch_function().apply(f, *args)

    return wrapped


@functools.cache
def _torch_function():
    import torch

    class WithoutSavedInputs(torch.autograd.Function):
        """`f(*args)` returns `(output, gradient function)`; the gradient
        function holds what the backward needs (closures)."""

        @staticmethod
        def forward(ctx, f, *args):
            output, ctx.gradient = f(*args)
            return output

        @staticmethod
        def backward(ctx, upstream):
            grads = ctx.gradient(upstream=upstream)
            if not isinstance(grads, tuple):
                grads = (grads,)
            return (None, *grads)

    return WithoutSavedInputs

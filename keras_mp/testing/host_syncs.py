"""Counters of a step's host syncs (tensors read on the host) and host
copies (tensors keras_mp makes from host data on PyTorch)."""

import collections
import contextlib
import pathlib
import sys
import threading
import weakref

import numpy as np

# The torch.Tensor methods through which a whole tensor reaches the host
# without a scalar read (`item()`, `bool(t)`, `float(t)`, `int(t)` and
# `t.__index__()` all dispatch to `aten._local_scalar_dense`, counted by a
# dispatch mode instead): each one waits for the device to finish the work
# queued before it.
_TORCH_HOST_CONVERSIONS = ("tolist", "numpy", "cpu")


@contextlib.contextmanager
def count_host_syncs():
    """Counts tensor-to-host conversions (host syncs) on the active backend.

    A conversion of a tensor to a Python or NumPy value makes the host wait
    for the device to finish the work queued before it. Inside the context
    every such conversion is counted, on any device, so the count taken on
    a CPU is the one a GPU would see:

    - torch: every scalar read, `aten._local_scalar_dense` (what `item()`,
      `bool(t)`, `int(t)`, `float(t)` and `t.__index__()` dispatch to, from
      Python or from torch's own C++), seen by a `TorchDispatchMode` and
      counted as `"_local_scalar_dense"`; a copy from an accelerator to the
      CPU (`"device_to_host"`); and the `torch.Tensor` methods `tolist()`,
      `numpy()` and `cpu()`;
    - TensorFlow: an eager tensor's Python-level read into NumPy
      (`numpy()`, `bool(t)`, `float(t)`, `int(t)`), counted as `"numpy"`;
    - JAX: a `jax.Array`'s (`bool(x)`, `x.item()`, `float(x)`, ... all
      go through its `_value`), counted as `"_value"`;
    - every backend: `np.asarray` and `np.array` of a tensor or a Keras
      variable (`keras.ops.convert_to_numpy` included), counted as
      `"numpy.asarray"` and `"numpy.array"`: NumPy reads CPU tensors
      through the buffer protocol, which no Python method sees.

    Work inside a compiled step (a `tf.function`, `jax.jit`) cannot convert
    a tensor to a Python value at all; what this counts is the host code
    between and around compiled steps, and every eager torch step.

    Yields:
        A `collections.Counter` of the method names called, filled in as
        the context runs.
    """
    import keras

    backend = keras.backend.backend()
    counts = collections.Counter()
    if backend == "torch":
        import torch

        owner = torch.Tensor
        names = [(name, name) for name in _TORCH_HOST_CONVERSIONS]
        tensor_types = (torch.Tensor,)
    elif backend == "tensorflow":
        import tensorflow as tf

        eager_tensor = type(tf.constant(0))
        owner = _defining_class(eager_tensor, "_numpy")
        names = [("_numpy", "numpy")]
        tensor_types = (eager_tensor, tf.Variable)
    elif backend == "jax":
        import jax.numpy as jnp

        owner = type(jnp.zeros(()))
        names = [("_value", "_value")]
        tensor_types = (owner,)
    else:
        raise ValueError(
            "count_host_syncs supports the torch, tensorflow and jax "
            f"backends. Received: backend={backend!r}."
        )
    # NumPy reads CPU tensors through the buffer protocol, past every
    # Python method; its entry points are counted for tensor arguments.
    patches = [
        (owner, name, getattr(owner, name), label, False)
        for name, label in names
    ]
    patches += [
        (np, name, getattr(np, name), f"numpy.{name}", True)
        for name in ("asarray", "array")
    ]
    # A conversion that goes through several counted entry points (NumPy,
    # then the tensor's own method) counts once; so does a copy to the host
    # that is then read: Keras's PyTorch `convert_to_numpy` calls `cpu()`
    # on a device tensor, then `np.array` on the copy it returned, one sync
    # (a CPU's `cpu()` returns the tensor itself, and its next read counts).
    depth = threading.local()
    # id -> weak reference of each host copy a counted `cpu()` made.
    fetched = {}
    mode = (
        _torch_scalar_read_counter(counts, depth)
        if backend == "torch"
        else contextlib.nullcontext()
    )

    def counted(original, label, only_tensors, self, args, kwargs):
        outermost = not getattr(depth, "value", 0)
        if (
            outermost
            and (
                not only_tensors
                or isinstance(self, (*tensor_types, keras.Variable))
            )
            and not _in(self, fetched)
        ):
            counts[label] += 1
        depth.value = getattr(depth, "value", 0) + 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            depth.value -= 1
        if outermost and label == "cpu" and result is not self:
            fetched[id(result)] = weakref.ref(result)
        return result

    def counting(original, label, only_tensors):
        if isinstance(original, property):
            return property(
                lambda self: counted(
                    original.fget, label, only_tensors, self, (), {}
                )
            )

        def method(self, *args, **kwargs):
            return counted(original, label, only_tensors, self, args, kwargs)

        return method

    for target, name, original, label, only_tensors in patches:
        setattr(target, name, counting(original, label, only_tensors))
    try:
        with mode:
            yield counts
    finally:
        for target, name, original, _, _ in patches:
            setattr(target, name, original)


@contextlib.contextmanager
def count_host_copies():
    """Counts the tensors keras_mp's own code makes from host data on
    PyTorch (`torch.as_tensor` and `torch.tensor` of Python numbers,
    lists or NumPy arrays, which `keras.ops` calls for every Python number
    it is given), by the keras_mp line that asked for them.

    On a GPU each one is a copy from pageable host memory that waits for
    every kernel queued before it (PyTorch's sync debug mode reports them
    as synchronizing): the copies that `count_host_syncs` does not see. A
    CPU makes the same calls, so the count taken here is the one a GPU
    would see. Host data that Keras's own code (its optimizers, losses,
    metrics) or `keras_mp.testing` hands over is not counted. Elsewhere
    than PyTorch the counter stays empty (a compiled step's numbers are
    constants of its graph).

    Yields:
        A `collections.Counter` of `"module.py:line"` of the keras_mp
        line nearest the call, filled in as the context runs.
    """
    import keras

    counts = collections.Counter()
    if keras.backend.backend() != "torch":
        yield counts
        return
    import torch

    package = pathlib.Path(__file__).resolve().parents[1]
    testing = pathlib.Path(__file__).resolve().parent
    # The frames of torch and of Keras's ops and backend are passed over:
    # the first frame outside them handed over the host data (Keras's own
    # optimizers, losses and metrics are not keras_mp's).
    keras_src = pathlib.Path(keras.__file__).resolve().parent / "src"
    libraries = [
        pathlib.Path(torch.__file__).resolve().parent,
        keras_src / "backend",
        keras_src / "ops",
    ]
    originals = {name: getattr(torch, name) for name in ("as_tensor", "tensor")}

    def asker():
        frame = sys._getframe(2)
        while frame is not None:
            path = pathlib.Path(frame.f_code.co_filename).resolve()
            if not any(library in path.parents for library in libraries):
                if package in path.parents and testing not in path.parents:
                    where = path.relative_to(package.parent)
                    return f"{where}:{frame.f_lineno}"
                return None
            frame = frame.f_back
        return None

    def counting(original):
        def make(data, *args, **kwargs):
            if not isinstance(data, torch.Tensor):
                where = asker()
                if where is not None:
                    counts[where] += 1
            return original(data, *args, **kwargs)

        return make

    for name, original in originals.items():
        setattr(torch, name, counting(original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


def _in(value, fetched):
    """Whether `value` is one of the host copies in `fetched` (by identity:
    tensors compare element by element, and some cannot be hashed)."""
    reference = fetched.get(id(value))
    return reference is not None and reference() is value


def _torch_scalar_read_counter(counts, depth):
    """A `TorchDispatchMode` counting scalar reads and device-to-host copies
    into `counts`, except inside a counted method (see `count_host_syncs`)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    scalar_read = torch.ops.aten._local_scalar_dense.default
    # Where each copy's source is among its arguments.
    copies = {
        torch.ops.aten._to_copy.default: 0,
        torch.ops.aten.copy_.default: 1,
    }

    class ScalarReadCounter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if not getattr(depth, "value", 0):
                if func is scalar_read:
                    counts["_local_scalar_dense"] += 1
                elif func in copies and _device_to_host(
                    args[copies[func]], result
                ):
                    counts["device_to_host"] += 1
            return result

    return ScalarReadCounter()


def _device_to_host(source, result):
    return (
        getattr(source, "device", None) is not None
        and getattr(result, "device", None) is not None
        and source.device.type != "cpu"
        and result.device.type == "cpu"
    )


def _defining_class(cls, name):
    """The class of `cls`'s MRO whose own namespace defines `name`."""
    return next(c for c in cls.__mro__ if name in c.__dict__)

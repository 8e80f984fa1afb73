"""Counters of the device work a PyTorch step queues: ATen operations that
launch a kernel, and Triton kernel launches (issue 46)."""

import collections
import contextlib
import sys
import threading

# ATen operations that queue no kernel on a CUDA device: allocation without
# a fill, metadata changes, and the scalar read (a host sync, counted by
# `count_host_syncs`). Views (`OpOverload.is_view`) are left out as well.
_NO_KERNEL = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::resize_",
        "aten::set_",
        "aten::lift_fresh",
        "aten::_unsafe_view",
        "aten::_local_scalar_dense",
        "aten::is_nonzero",
        "aten::sym_size",
        "aten::sym_stride",
        "aten::sym_numel",
        "aten::sym_storage_offset",
    }
)


class LaunchCount:
    """What `count_torch_launches` counted, filled in as its context runs.

    Attributes:
        ops: a `collections.Counter` of the ATen operations that queue a
            kernel, by name (`"aten::mul"`), across overloads.
        views: how many views and other operations that queue no kernel
            (`aten::view`, `aten::empty`, ...) were dispatched.
        triton: a `collections.Counter` of the Triton kernels launched, by
            the kernel function's name.
    """

    def __init__(self):
        self.ops = collections.Counter()
        self.views = 0
        self.triton = collections.Counter()

    @property
    def launches(self):
        """The kernel launches a CUDA device would see: one per counted
        ATen operation and one per Triton launch."""
        return sum(self.ops.values()) + sum(self.triton.values())

    def __repr__(self):
        top = ", ".join(f"{name}: {n}" for name, n in self.ops.most_common(8))
        return (
            f"LaunchCount(launches={self.launches}, "
            f"triton={sum(self.triton.values())}, views={self.views}, "
            f"top ops: {top})"
        )


@contextlib.contextmanager
def count_torch_launches():
    """Counts the kernel launches a PyTorch step queues, on any device.

    On a CUDA device an eager step pays about 20 us of host time per kernel
    launch (`shared/research/torch_gpu_overheads.md`), so the launches of a
    step are a budget a CPU can check: each ATen operation dispatched inside
    the context (seen by a `TorchDispatchMode`) is counted as one launch,
    except views and the operations that queue no kernel (allocations
    without a fill, metadata changes, scalar reads); each Triton kernel
    launch (through `triton.runtime.jit.JITFunction.run`, or the
    interpreter's `InterpretedFunction.run` under `TRITON_INTERPRET=1`) is
    counted as one launch, and the operations Triton's launcher or its
    interpreter dispatch are not counted. Triton is never imported here: a
    launch is counted where the process imported it already.

    On a CPU, keras_mp's PyTorch code takes the branches a CUDA device
    takes only where it chooses by the device (FP8 tensors, `_scaled_mm`
    and the Triton kernels run on CUDA alone); a test that counts the CUDA
    path forces it (`torch_fp8_operands.FORCED = "triton"` with the
    interpreter). A compiled function (`torch.compile`) is not counted
    operation by operation.

    Yields:
        A `LaunchCount`.

    Example:

    >>> import keras
    >>> from keras_mp.testing import count_torch_launches
    >>> if keras.backend.backend() == "torch":
    ...     import torch
    ...     x = torch.ones(4, 4)
    ...     with count_torch_launches() as count:
    ...         y = (x * 2).reshape(16).sum()
    ...     assert count.launches == 2 and count.views == 1, count
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    count = LaunchCount()
    inside_triton = threading.local()

    class LaunchCounter(TorchDispatchMode):
        # torch 2.13 bumps no version counter for a `torch._foreach_*`
        # in-place operation under a dispatch mode; this mode bumps them,
        # so that `backend/torch/versions.reuse` caches as it does outside
        # it and the count is the one of a step run without the counter.
        BUMPS_VERSIONS = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not getattr(inside_triton, "depth", 0):
                name = func._schema.name
                if func.is_view or name in _NO_KERNEL:
                    count.views += 1
                else:
                    count.ops[name] += 1
            written = _written_tensors(func, args, kwargs)
            versions = [t._version for t in written]
            result = func(*args, **kwargs)
            for tensor, version in zip(written, versions):
                if tensor._version == version:
                    torch.autograd.graph.increment_version(tensor)
            return result

    restore = []
    for owner in _triton_launchers():
        original = owner.run

        def run(self, *args, _original=original, **kwargs):
            count.triton[getattr(self.fn, "__name__", repr(self.fn))] += 1
            inside_triton.depth = getattr(inside_triton, "depth", 0) + 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                inside_triton.depth -= 1

        owner.run = run
        restore.append((owner, original))
    try:
        with LaunchCounter():
            yield count
    finally:
        for owner, original in restore:
            owner.run = original


def _written_tensors(func, args, kwargs):
    """The tensors an ATen operation writes in place (its schema's
    arguments marked `(a!)`), lists of tensors flattened."""
    import torch

    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if index < len(args):
            value = args[index]
        else:
            value = kwargs.get(argument.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        written.extend(v for v in values if isinstance(v, torch.Tensor))
    return written


def _triton_launchers():
    """The classes whose `run` launches a Triton kernel, where Triton is
    imported already."""
    launchers = []
    jit = sys.modules.get("triton.runtime.jit")
    if jit is not None:
        launchers.append(jit.JITFunction)
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is not None:
        launchers.append(interpreter.InterpretedFunction)
    return launchers

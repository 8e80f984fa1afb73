"""What a torch tensor's version counter tells: values computed from it
once, while it holds the same values (`reuse`)."""

import keras


def reuse(tensor, key, compute):
    """`compute()`, or what it gave for `tensor` and `key` before, while
    `tensor` holds the same values.

    PyTorch only (elsewhere `compute()` every call: XLA and TensorFlow's
    graphs already compute a value once per step): a tensor holds the same
    values while its storage and version counter are unchanged, and every
    in-place write (an optimizer's update, `Variable.assign`) bumps the
    counter. So a kernel's FP8 codes are computed once per optimizer step,
    whatever the number of calls and micro-steps before the update.
    Not while `torch.compile` traces (the compiled graph decides). A write
    through `tensor.data` bumps no counter (PyTorch's `.data` escapes
    version tracking): Keras's and keras_mp's updates never write so, and
    code that does must assign the variable instead. Two writes bump no
    counter either (torch 2.13), and are handled: `torch._fused_adamw_`
    (`fused_adam.py` bumps the weights' counters after it), and every
    `torch._foreach_*` in-place operation while a `TorchDispatchMode` is
    active (`FlopCounterMode`, say), so nothing is cached while one is (an
    update inside a mode after a forward outside it is the one case left to
    the caller), except under modes that bump what they write themselves
    (a true `BUMPS_VERSIONS` attribute: `testing.count_torch_launches`).

    Args:
        tensor: A tensor that `compute` reads.
        key: A hashable naming what `compute` makes of it.
        compute: A function of no arguments.
    """
    if keras.backend.backend() != "torch":
        return compute()
    import torch

    if (
        torch.compiler.is_compiling()
        or not isinstance(tensor, torch.Tensor)
        or not _modes_bump_versions()
    ):
        return compute()
    owner, stamp = _owner_and_stamp(tensor)
    key = (tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), key)
    cache = getattr(owner, "_keras_mp_fp8_operands", None)
    if cache is None or cache[0] != stamp:
        cache = (stamp, {})
        owner._keras_mp_fp8_operands = cache
    if key not in cache[1]:
        cache[1][key] = compute()
    return cache[1][key]


def forget_stale(variables):
    """Drops what `reuse` computed from `variables` before their last
    write.

    A kernel's FP8 codes (on a GPU its row- and column-major E4M3 operands,
    2 bytes a parameter in all) are of no use once the optimizer has
    written the kernel: the next call computes them again. Kept until then,
    they are a 2-byte copy of every FP8 kernel held between steps, which
    bfloat16 training does not hold. Called after each optimizer update;
    codes still current (a micro-step of gradient accumulation, a skipped
    step) are kept. PyTorch only; elsewhere nothing is cached.
    """
    if keras.backend.backend() != "torch":
        return
    for variable in variables:
        owner, stamp = _owner_and_stamp(getattr(variable, "value", variable))
        cache = getattr(owner, "_keras_mp_fp8_operands", None)
        if cache is not None and cache[0] != stamp:
            del owner._keras_mp_fp8_operands


def _owner_and_stamp(tensor):
    """The tensor that holds `reuse`'s cache for `tensor`, and the stamp of
    its values: a view (`fp8.einsum`'s reshaped kernel, new at each call)
    keeps the cache on the tensor it views, which shares its version
    counter."""
    owner = tensor if tensor._base is None else tensor._base
    return owner, (owner.data_ptr(), owner._version)


def _modes_bump_versions():
    """Whether every active `TorchDispatchMode` bumps the version counters
    of what an operation writes (see `reuse`)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return all(
        getattr(mode, "BUMPS_VERSIONS", False)
        for mode in _get_current_dispatch_mode_stack()
    )

"""What the accelerator can do, asked of the active Keras backend.

Imports nothing from keras_mp.
"""

import platform
import sys
import warnings

import keras

_checked_policies = set()


def _cpu_details():
    name = platform.processor() or platform.machine() or "CPU"
    flags = set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key = line.split(":", 1)[0].strip()
                if key == "model name":
                    name = line.split(":", 1)[1].strip()
                elif key in ("flags", "Features"):
                    flags.update(line.split(":", 1)[1].split())
    except OSError:
        pass
    native = bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    return {
        "kind": "cpu",
        "name": name,
        "compute_capability": None,
        "native_bfloat16": native,
    }


def _gpu_details(name, compute_capability):
    return {
        "kind": "gpu",
        "name": name,
        "compute_capability": compute_capability,
        # Tensor cores handle bfloat16 from Ampere (compute capability 8.0).
        "native_bfloat16": compute_capability is not None
        and compute_capability >= (8, 0),
    }


def _parse_capability(value):
    if value is None:
        return None
    try:
        if isinstance(value, str):
            major, _, minor = value.partition(".")
            return (int(major), int(minor or 0))
        return tuple(int(v) for v in value)
    except (TypeError, ValueError):
        # Not an NVIDIA compute capability (ROCm reports e.g. "gfx90a"): the
        # check must warn, never crash set_global_policy.
        return None


def _tensorflow_accelerators():
    import tensorflow as tf

    details = []
    for device in tf.config.list_physical_devices("GPU"):
        info = tf.config.experimental.get_device_details(device)
        details.append(
            _gpu_details(
                info.get("device_name", device.name),
                _parse_capability(info.get("compute_capability")),
            )
        )
    for device in tf.config.list_logical_devices("TPU"):
        details.append(_tpu_details(device.name))
    return details


def _tpu_details(name):
    return {
        "kind": "tpu",
        "name": name,
        "compute_capability": None,
        "native_bfloat16": True,
    }


def _jax_accelerators():
    import jax

    details = []
    for device in jax.devices():
        if device.platform in ("gpu", "cuda", "rocm"):
            details.append(
                _gpu_details(
                    device.device_kind,
                    _parse_capability(
                        getattr(device, "compute_capability", None)
                    ),
                )
            )
        elif device.platform == "tpu":
            details.append(_tpu_details(device.device_kind))
    return details


def _torch_accelerators():
    import torch

    return [
        _gpu_details(
            torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)
        )
        for i in range(torch.cuda.device_count())
    ]


def device_details():
    """Describes the devices the active backend computes on.

    Returns:
        A list of dicts with keys `kind` (`"gpu"`, `"tpu"` or `"cpu"`),
        `name`, `compute_capability` (a `(major, minor)` tuple for GPUs) and
        `native_bfloat16`. The CPU is listed only when there is no
        accelerator.
    """
    backend = keras.backend.backend()
    lookups = {
        "tensorflow": _tensorflow_accelerators,
        "jax": _jax_accelerators,
        "torch": _torch_accelerators,
    }
    details = lookups[backend]() if backend in lookups else []
    return details or [_cpu_details()]


def _describe(details):
    return ", ".join(f"{d['kind'].upper()} {d['name']!r}" for d in details)


def compatibility_warning(policy_name, details):
    """The warning text for a mixed policy on these devices, or None.

    Args:
        policy_name: `"mixed_float16"` or `"mixed_bfloat16"`.
        details: A list as `device_details()` returns it.
    """
    found = _describe(details)
    if policy_name == "mixed_float16":
        gpus = [d for d in details if d["kind"] == "gpu"]
        if gpus and all(
            d["compute_capability"] is not None
            and d["compute_capability"] >= (7, 0)
            for d in gpus
        ):
            return None
        better = (
            "'mixed_bfloat16'"
            if all(d["native_bfloat16"] for d in details)
            else "'float32'"
        )
        return _lines(
            "Mixed precision compatibility check (mixed_float16):",
            "float16 runs fast only on NVIDIA GPUs of compute capability 7.0 "
            f"or higher, and this process has {found}.",
            f"It may run slower than float32 here; {better} is the better "
            "choice on these devices.",
            "keras_mp.recommend_policy() measures which is fastest.",
        )
    if policy_name == "mixed_bfloat16":
        if all(d["native_bfloat16"] for d in details):
            return None
        return _lines(
            "Mixed precision compatibility check (mixed_bfloat16):",
            f"the devices of this process ({found}) have no native bfloat16 "
            "support, so bfloat16 is emulated and may run slower than float32.",
            "'float32' is the better choice here (or 'mixed_float16' on an "
            "NVIDIA GPU of compute capability 7.0 or higher).",
            "keras_mp.recommend_policy() measures which is fastest.",
        )
    return None


# FP8 tensor cores: NVIDIA Ada (compute capability 8.9), Hopper (9.0) and
# later GPUs.
_FP8_CAPABILITY = (8, 9)


# Block-scaled tensor cores (MXFP8, NVFP4): NVIDIA Blackwell (10.0) and
# later; Transformer Engine's `is_mxfp8_available` / `is_nvfp4_available`.
_BLOCK_SCALED_CAPABILITY = (10, 0)


def _all_gpus_from(details, capability):
    return bool(details) and all(
        d["kind"] == "gpu"
        and d["compute_capability"] is not None
        and d["compute_capability"] >= capability
        for d in details
    )


def fp8_unsupported_reason(details):
    """Why FP8 GEMMs cannot pay on these devices, or None where they can.

    Args:
        details: A list as `device_details()` returns it.

    Returns:
        None when every device is an NVIDIA GPU of compute capability 8.9
        or higher (FP8 tensor cores), otherwise a sentence naming the
        devices found.
    """
    if _all_gpus_from(details, _FP8_CAPABILITY):
        return None
    return (
        f"no FP8 tensor cores on {_describe(details)} (they need an NVIDIA "
        "GPU of compute capability 8.9 or higher: Ada, Hopper, Blackwell); "
        "elsewhere keras_mp computes FP8 GEMMs on 16- or 32-bit units, "
        "slower than bfloat16"
    )


def block_scaled_unsupported_reason(details, format_name):
    """Why `format_name`'s (MXFP8's, NVFP4's) GEMMs run emulated here, or
    None where every device is a Blackwell GPU (compute capability 10.0+),
    whose tensor cores take the block scales."""
    if _all_gpus_from(details, _BLOCK_SCALED_CAPABILITY):
        return None
    return (
        f"no {format_name} tensor cores on {_describe(details)} (they need "
        "an NVIDIA GPU of compute capability 10.0 or higher: Blackwell); "
        f"elsewhere keras_mp computes {format_name} GEMMs emulated: the "
        "operands dequantized (exactly) and multiplied on 16- or 32-bit "
        "units, bit for bit the same and slower"
    )


def check_block_scaled_once(format_name):
    """Warns once per process and format where a GPU lacks `format_name`'s
    tensor cores (Ada, Hopper): its GEMMs run emulated there. Silent on a
    machine without GPUs, where every FP8 GEMM is emulated, as
    `keras_mp.fp8.is_available` says."""
    key = ("block_scaled", format_name)
    if key in _checked_policies:
        return
    _checked_policies.add(key)
    details = device_details()
    if not any(d["kind"] == "gpu" for d in details):
        return
    reason = block_scaled_unsupported_reason(details, format_name)
    if reason is not None:
        warnings.warn(
            _lines(
                f"FP8 compatibility check ({format_name}):",
                reason + ".",
                "keras_mp.fp8.is_available(recipe, return_reason=True) "
                "answers per format.",
            ),
            UserWarning,
            stacklevel=_caller_stacklevel(),
        )


def _lines(*lines):
    # One short line each: a warning is read in a terminal or a notebook.
    return "\n  ".join(lines)


def check_hardware_once(policy_name):
    """Warns once per process and policy if the devices suit it poorly.

    Called when the first layer of a mixed policy creates its weights, not
    when the policy is set: asking for the devices initializes the runtime
    (TensorFlow's devices, JAX's backend), which a policy call must leave to
    the program (`tf.config.set_logical_device_configuration`,
    `jax.distributed.initialize`).
    """
    if policy_name in _checked_policies:
        return
    _checked_policies.add(policy_name)
    if policy_name not in ("mixed_float16", "mixed_bfloat16"):
        return
    message = compatibility_warning(policy_name, device_details())
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=_caller_stacklevel())


def _caller_stacklevel():
    # The first frame outside keras_mp, Keras and the backends: the user's
    # line that built the layer (Python 3.12's skip_file_prefixes, by hand).
    internal = {"keras_mp", "keras", "tensorflow", "jax", "torch"}
    frame, level = sys._getframe(2), 2
    while frame is not None:
        package = frame.f_globals.get("__name__", "").partition(".")[0]
        if package not in internal:
            return level
        frame, level = frame.f_back, level + 1
    return 2

"""Policy names: the mixed names, dtype names and jmp-style specs that
`keras_mp.Policy` takes, parsed into `(variable, compute, output)` dtypes.
"""

MIXED_NAMES = ("mixed_float16", "mixed_bfloat16")
VALID_NAMES_TEXT = (
    "'mixed_float16', 'mixed_bfloat16', the name of a float dtype "
    "('float16', 'bfloat16', 'float32', 'float64'), or a spec such as "
    "'params=float32,compute=bfloat16,output=float32'"
)
# The spellings jmp (google-deepmind/jmp) accepts, so its policy strings work
# unchanged. "half" is resolved against the hardware, as jmp does.
SPEC_DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "f16": "float16",
    "float16": "float16",
    "full": "float32",
    "f32": "float32",
    "float32": "float32",
    "f64": "float64",
    "float64": "float64",
    "half": None,
}
_SPEC_KEYS = {
    "p": "params",
    "params": "params",
    "c": "compute",
    "compute": "compute",
    "o": "output",
    "output": "output",
}
_SPEC_HELP = (
    "A spec is 'params=D,compute=D,output=D' (keys may be shortened to "
    "p/c/o and left out: params defaults to float32, compute follows params, "
    "output follows compute), where D is one of "
    f"{sorted(SPEC_DTYPES)}"
)


def _half_dtype():
    # jmp's rule: bfloat16 on TPU, float16 elsewhere. It asks the runtime
    # which devices exist, so only "half" ever initializes it.
    from keras_mp.backend import devices

    kinds = {detail["kind"] for detail in devices.device_details()}
    return "bfloat16" if "tpu" in kinds else "float16"


def _spec_dtype(value, name):
    if value not in SPEC_DTYPES:
        raise ValueError(
            f"Unknown dtype {value!r} in the policy spec. {_SPEC_HELP}. "
            f"Received: name={name!r}"
        )
    return SPEC_DTYPES[value] or _half_dtype()


def parse_spec(name):
    """`(variable, compute, output)` dtypes of a jmp-style spec or short name."""
    if "=" not in name:
        dtype = _spec_dtype(name, name)
        return dtype, dtype, dtype
    parts = {}
    for part in name.split(","):
        key, separator, value = part.strip().partition("=")
        key = key.strip()
        if not separator or key not in _SPEC_KEYS:
            raise ValueError(
                f"Unknown key {key!r} in the policy spec: expected "
                f"{sorted(_SPEC_KEYS)}. {_SPEC_HELP}. Received: name={name!r}"
            )
        if _SPEC_KEYS[key] in parts:
            raise ValueError(
                f"The policy spec gives {_SPEC_KEYS[key]!r} twice. "
                f"{_SPEC_HELP}. Received: name={name!r}"
            )
        parts[_SPEC_KEYS[key]] = _spec_dtype(value.strip(), name)
    variable = parts.get("params", "float32")
    compute = parts.get("compute", variable)
    return variable, compute, parts.get("output", compute)


def canonical_name(variable, compute, output):
    """The shortest name that parses back to these dtypes."""
    if output == compute:
        if variable == compute:
            return compute
        if variable == "float32" and f"mixed_{compute}" in MIXED_NAMES:
            return f"mixed_{compute}"
    return f"params={variable},compute={compute},output={output}"

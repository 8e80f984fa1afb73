"""Checks of the configs `from_config` receives (hand-written ones included).

Imports nothing from keras_mp.
"""

import inspect


def check_config(cls, config, required=None, allowed=None):
    """Raises ValueError naming what a config of `cls` lacks or has too many.

    Args:
        cls: The class being restored.
        config: What `from_config` received.
        required: Keys the config must have. Defaults to the arguments of
            `cls.__init__` without a default.
        allowed: Keys it may have. Defaults to the arguments of
            `cls.__init__` (all of them when it takes `**kwargs`).
    """
    name = cls.__name__
    if not isinstance(config, dict):
        raise ValueError(
            f"The {name} config is a dict, as `get_config()` returns it. "
            f"Received: config={config!r}"
        )
    parameters = inspect.signature(cls.__init__).parameters
    if allowed is None:
        takes_any = any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
        )
        allowed = None if takes_any else set(parameters) - {"self"}
    if required is None:
        required = [
            key
            for key, p in parameters.items()
            if key != "self"
            and p.default is inspect.Parameter.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    missing = [key for key in required if key not in config]
    if missing:
        raise ValueError(
            f"The {name} config needs the keys {missing}. Received: "
            f"config={config!r}. Use the dict that `get_config()` returns."
        )
    if allowed is not None:
        unknown = sorted(set(config) - set(allowed))
        if unknown:
            raise ValueError(
                f"The {name} config takes only {sorted(allowed)}. Received "
                f"unknown keys {unknown} in config={config!r}"
            )

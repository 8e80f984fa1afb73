"""Refuses, at import, a Keras backend keras_mp is not tested on."""

import keras

# The backends CI runs the whole suite on; README.md and pyproject.toml name
# the same ones.
SUPPORTED_BACKENDS = ("tensorflow", "jax", "torch")

if keras.backend.backend() not in SUPPORTED_BACKENDS:
    raise ImportError(
        "keras_mp supports the Keras backends "
        f"{', '.join(SUPPORTED_BACKENDS)}. Received: KERAS_BACKEND="
        f"{keras.backend.backend()!r}. Set KERAS_BACKEND to one of them "
        "before keras is first imported (e.g. KERAS_BACKEND=torch)."
    )

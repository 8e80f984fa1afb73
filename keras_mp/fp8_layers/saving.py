"""Saving and loading an FP8 layer's variables (the `save_own_variables`
and `load_own_variables` hooks): the statistics carrier last, the delayed
state and LoRA's W, A and B by name, a frozen layer's codes and scales by
name; a checkpoint saved under other recipes loads with one warning
naming what migrated (`one_migration_warning`).
"""

import contextlib
import functools
import threading
import warnings

import keras
import numpy as np

from keras_mp import _keras_internals
from keras_mp._fp8 import delayed as delayed_module
from keras_mp._fp8 import stats as stats_module
from keras_mp.fp8_layers.lora import LORA_ENTRIES
from keras_mp.fp8_layers.lora import has_lora
from keras_mp.fp8_layers.lora import lora_variables
from keras_mp.fp8_layers.lora import saves_lora
from keras_mp.fp8_layers.state import STATE_SHAPES
from keras_mp.fp8_layers.state import delayed_state
from keras_mp.fp8_layers.state import static_state


# Dense and EinsumDense save and load their variables by a list of names
# (kernel, bias, quantization state) and check that the file holds as many
# entries as the layer has variables: the carrier goes last.
def save_hook(original):
    @functools.wraps(original)
    def save_own_variables(self, store):
        static = static_state(self)
        if static:
            # A frozen layer has no float kernel: its bias by index, its
            # codes and scales by name.
            if self.bias is not None:
                store["0"] = self.bias
            for name, variable in static.items():
                store[name] = variable
            return
        original(self, store)
        carrier = stats_module.layer_carrier(self)
        if carrier is not None:
            store[str(len(store.keys()))] = carrier
        for name, variable in delayed_state(self).items():
            store[name] = variable
        if saves_lora(self):
            # Keras saves `W + A @ B` as the kernel (what a layer without
            # LoRA loads). An FP8 layer with LoRA reloads W, A and B as
            # they were: its GEMM rounds W alone to FP8.
            for name, variable in zip(LORA_ENTRIES, lora_variables(self)):
                store[name] = variable

    return save_own_variables


class _StoreView:
    """Some entries of a weights store, as Dense's loader reads it: a file
    saved with or without statistics loads into a layer with or without
    them (a carrier missing from the file keeps its value)."""

    def __init__(self, store, keys):
        self._store = store
        self._keys = list(keys)

    def keys(self):
        return list(self._keys)

    def __len__(self):
        return len(self._keys)

    def __getitem__(self, key):
        return self._store[key]


def load_hook(original):
    @functools.wraps(original)
    def load_own_variables(self, store):
        names = set(store.keys())
        static = static_state(self)
        if static:
            _load_static(self, store, names, static)
            return
        entries = [name for name in LORA_ENTRIES if name in names]
        named = set(LORA_ENTRIES) | set(STATE_SHAPES)
        full = store
        if names & named:
            # Keras's loader counts the entries: it sees the others only.
            store = _StoreView(store, sorted(names - named, key=int))
        _load_carrier(self, store, original)
        _load_delayed_state(self, full, names)
        if entries and saves_lora(self):
            # Read only here: a layer without LoRA keeps the merged kernel.
            lora = [full[name] for name in entries]
            variables = lora_variables(self)
            shapes = [tuple(v.shape) for v in variables]
            if [tuple(value.shape) for value in lora] == shapes:
                for variable, value in zip(variables, lora):
                    variable.assign(value)

    return load_own_variables


def _load_carrier(layer, store, original):
    """Dense's loader, around the statistics carrier the file or the layer
    may have."""
    carrier = stats_module.layer_carrier(layer)
    keys = [str(i) for i in range(len(store.keys()))]
    own = len(_keras_internals.own_variables(layer))
    if has_lora(layer):
        own -= 2  # Keras saves the merged kernel, not A and B
    own -= len(delayed_state(layer))  # saved by name
    last = keys[-1] if keys else None
    saved = last is not None and tuple(getattr(store[last], "shape", ())) in (
        stats_module.SHAPE,
        delayed_module.CARRIER_SHAPE,
    )
    # Keras's check counts the layer's variables, the state saved by name
    # among them (never read: Dense reads its own entries by index).
    state = list(delayed_state(layer))

    def load(view):
        original(layer, _StoreView(store, [*view, *state]))

    if carrier is not None and saved and len(keys) == own:
        load(keys)
        carrier.assign(_carrier_value(store[last], tuple(carrier.shape)))
    elif carrier is not None and len(keys) == own - 1:
        load([*keys, "fp8_stats"])
    elif carrier is None and saved and len(keys) == own + 1:
        load(keys[:-1])
    else:
        load(keys)


def _load_static(layer, store, names, static):
    if not set(static) <= names:
        raise ValueError(
            f"Layer {layer.name!r} is frozen (`keras_mp.fp8.freeze`) and "
            "loads FP8 kernel codes and scales, which this file does not "
            f"hold for it. Received entries: {sorted(names)}. Load the "
            "file into the model before freezing it, then call "
            "`keras_mp.fp8.freeze` again."
        )
    values = {name: store[name] for name in static}
    if layer.bias is not None:
        values["bias"] = store["0"]
    for name, variable in static.items():
        variable.assign(values[name])
    if layer.bias is not None:
        layer.bias.assign(values["bias"])


def _carrier_value(value, shape):
    """A saved carrier as the layer's: the statistics columns, and the
    delayed columns where both have them (zeros, a carrier not to fold,
    where the file has none)."""
    value = keras.ops.convert_to_numpy(value)
    width = min(value.shape[1], shape[1])
    result = np.zeros(shape, "float32")
    result[:, :width] = value[:, :width]
    return result


def _load_delayed_state(layer, store, names):
    """Restores the delayed state saved by name; a history of another
    length keeps its newest entries, or is padded with zeros (older
    steps that never were). A file without it leaves the layer to seed
    its state at its first step; a layer without it ignores the file's.
    Each such case is noted for the one warning of the load."""
    state = delayed_state(layer)
    saved = set(STATE_SHAPES) <= names
    path = layer.path or layer.name
    if not state:
        if saved:
            _note_migration("ignored", path)
        return
    if not saved:
        _note_migration("seeded", path)
        return
    values = {name: keras.ops.convert_to_numpy(store[name]) for name in state}
    history = values["fp8_amax_history"]
    length = state["fp8_amax_history"].shape[1]
    if history.shape[1] != length:
        _note_migration("resized", f"{path} ({history.shape[1]} -> {length})")
    padded = np.zeros((history.shape[0], length), "float32")
    kept = min(length, history.shape[1])
    padded[:, :kept] = history[:, :kept]
    values["fp8_amax_history"] = padded
    for name, variable in state.items():
        variable.assign(values[name])


_MIGRATIONS = {
    "seeded": (
        "have delayed FP8 scaling but the file has no state for them: "
        "they run current scaling at their first step and start their "
        "histories there"
    ),
    "ignored": (
        "have no delayed FP8 scaling and ignored the file's state for them"
    ),
    "resized": (
        "have an amax history of another length than the file's: it kept "
        "its newest entries, padded with zeros"
    ),
}
_loading = threading.local()


def _note_migration(kind, where):
    notes = getattr(_loading, "notes", None)
    if notes is None:
        # A layer loaded outside Keras's loaders: its own warning.
        warnings.warn(_migration_message([(kind, where)]), stacklevel=3)
    else:
        notes.append((kind, where))


def _migration_message(notes):
    parts = []
    for kind, text in _MIGRATIONS.items():
        where = [w for k, w in notes if k == kind]
        if where:
            parts.append(f"{len(where)} layer(s) {text}: {', '.join(where)}")
    return (
        "Loaded a checkpoint saved with other FP8 recipes: "
        + "; ".join(parts)
        + ". Nothing else changed. Save again under the new recipes to "
        "silence this."
    )


@contextlib.contextmanager
def one_migration_warning():
    """Collects the FP8 state migrations of one Keras load and warns once
    at its end, if there were any (nothing when the load fails)."""
    if getattr(_loading, "notes", None) is not None:
        yield  # a load inside a load: the outer one warns
        return
    _loading.notes = []
    try:
        yield
        notes = _loading.notes
    finally:
        _loading.notes = None
    if notes:
        warnings.warn(_migration_message(notes), stacklevel=4)

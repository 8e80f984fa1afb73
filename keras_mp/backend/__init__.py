"""Backend-specific code: only what `keras.ops` cannot express."""

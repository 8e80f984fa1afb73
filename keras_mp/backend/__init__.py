"""Backend-specific code: only what `keras.ops` cannot express.

Imports nothing from keras_mp.
"""

"""PyTorch's fast paths: torch's own operations where `keras.ops` costs an
eager step host time, memory passes or host syncs, bit for bit the
`keras.ops` code they stand for (tests compare the two ways).

As Keras keeps `keras/src/backend/torch/`. Unlike Keras's, these modules
load on every backend (the code that calls them asks the backend first),
so torch, and Triton, are imported only inside their functions: keras_mp
imports with torch absent.
"""

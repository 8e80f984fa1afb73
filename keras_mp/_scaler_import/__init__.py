"""Loss scaler state of other libraries, as a keras_mp `DynamicLossScale`.

`from_torch.py` (torch.amp, Lightning, apex) and `from_deepspeed.py` (the
bodies of `DynamicLossScale.from_torch` / `.from_deepspeed`), `checks.py`.
Imports nothing from keras_mp outside this package.
"""

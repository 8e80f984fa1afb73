"""FP8's numeric core (private): recipes, formats, quantizers and the FP8
GEMMs on every backend, below the layers. Users reach it through
`keras_mp.fp8` (`keras_mp/fp8.py`), which adds `adopt` and `freeze`; the
rest of keras_mp imports its modules. It re-exports nothing itself:
`dot`, `einsum`, `quantize` and `report` name modules here.
"""

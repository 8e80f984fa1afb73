"""The FP8 formats' numerics, one file per family: the codes of a tensor,
their scales and the bit operations that make them, exact on every
backend. `e4m3_e5m2.py`: E4M3 and E5M2 codes and their power-of-two
scales; `mxfp8.py`: OCP MXFP8's blocks of 32 with E8M0 scales;
`nvfp4.py`: NVFP4's E2M1 codes, E4M3 block scales and tensor scale.

What a GEMM role does with them (the axis each operand is quantized
along, the rounding of each role) is `keras_mp/_fp8/quantizers/`.
"""

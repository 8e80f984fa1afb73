"""Helpers shared by the keras_mp test suite (not imported by the library).

One module per concept: `asserts.py` (comparisons and NumPy conversions),
`optimizer_steps.py` (a step as `fit` runs it, bytes per parameter),
`fp8_helpers.py` (the FP8 tests' fixtures and checks), `host_syncs.py`
(host sync and host copy counters), `launches.py` (the kernel launches
of a PyTorch step), `saved_tensors.py` (what a step keeps for its
backward, and what a process holds between steps), `processes.py` (child
processes, Triton's interpreter in one, hidden modules, the machine's
description); `fp8_reference.py`
is the FP8 tests' oracle and `pytest_plugin.py` the suite's plugin.
Every helper is imported from here.
"""

from keras_mp.testing.asserts import assert_bitwise_equal
from keras_mp.testing.asserts import assert_close
from keras_mp.testing.asserts import to_numpy
from keras_mp.testing.asserts import tolerance
from keras_mp.testing.fp8_helpers import assert_fp8_codes_equal
from keras_mp.testing.fp8_helpers import backend_einsum
from keras_mp.testing.fp8_helpers import block_spread_operands
from keras_mp.testing.fp8_helpers import branched_fp8_model
from keras_mp.testing.fp8_helpers import fp8_code_bits
from keras_mp.testing.fp8_helpers import fp8_mlp_fit_and_reload
from keras_mp.testing.fp8_helpers import gemm_and_gradients
from keras_mp.testing.host_syncs import count_host_copies
from keras_mp.testing.host_syncs import count_host_syncs
from keras_mp.testing.launches import LaunchCount
from keras_mp.testing.launches import count_torch_launches
from keras_mp.testing.optimizer_steps import apply_as_fit
from keras_mp.testing.optimizer_steps import bytes_per_parameter
from keras_mp.testing.processes import describe_machine
from keras_mp.testing.processes import run_python
from keras_mp.testing.processes import run_script
from keras_mp.testing.processes import run_triton_interpreted
from keras_mp.testing.processes import script_backend
from keras_mp.testing.processes import without_modules
from keras_mp.testing.saved_tensors import held_torch_bytes
from keras_mp.testing.saved_tensors import saved_activation_bytes
from keras_mp.testing.saved_tensors import tf_saved_tensors
from keras_mp.testing.saved_tensors import torch_saved_tensors

__all__ = [
    "LaunchCount",
    "apply_as_fit",
    "assert_bitwise_equal",
    "assert_close",
    "assert_fp8_codes_equal",
    "backend_einsum",
    "block_spread_operands",
    "branched_fp8_model",
    "bytes_per_parameter",
    "count_host_copies",
    "count_host_syncs",
    "count_torch_launches",
    "describe_machine",
    "fp8_code_bits",
    "fp8_mlp_fit_and_reload",
    "gemm_and_gradients",
    "held_torch_bytes",
    "run_python",
    "run_triton_interpreted",
    "run_script",
    "saved_activation_bytes",
    "script_backend",
    "tf_saved_tensors",
    "tolerance",
    "to_numpy",
    "torch_saved_tensors",
    "without_modules",
]

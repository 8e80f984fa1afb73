"""Helpers shared by the keras_mp test suite (not imported by the library)."""

import atexit
import collections
import contextlib
import functools
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import weakref

import numpy as np

__all__ = [
    "apply_as_fit",
    "assert_bitwise_equal",
    "assert_close",
    "assert_fp8_codes_equal",
    "backend_einsum",
    "block_spread_operands",
    "bytes_per_parameter",
    "count_host_copies",
    "count_host_syncs",
    "describe_machine",
    "fp8_code_bits",
    "fp8_mlp_fit_and_reload",
    "gemm_and_gradients",
    "run_python",
    "run_script",
    "saved_activation_bytes",
    "script_backend",
    "tf_saved_tensors",
    "tolerance",
    "to_numpy",
    "torch_saved_tensors",
    "without_modules",
]

_TOLERANCES = {
    "float16": 1e-2,
    "bfloat16": 4e-2,
    "float32": 1e-5,
    "float64": 1e-9,
}


def apply_as_fit(optimizer, grads, variables, scale_loss=False):
    """One optimizer step on `grads` as `Model.fit` runs it.

    Stateless on JAX (`stateless_apply` on the variables' values, then the
    results assigned back, as the JAX trainer does), stateful `apply`
    elsewhere. The optimizer is built for `variables` first if it is not.

    Args:
        optimizer: The optimizer.
        grads: One gradient per variable.
        variables: The variables to update.
        scale_loss: Whether `optimizer.scale_loss` runs first, which marks
            `grads` as the gradients of a scaled loss (a LossScaleOptimizer
            then unscales them). Defaults to `False`.
    """
    import keras

    if scale_loss:
        optimizer.scale_loss(1.0)
    if keras.backend.backend() != "jax":
        optimizer.apply(grads, variables)
        return
    if not optimizer.built:
        optimizer.build(variables)
    new_values, new_optimizer_values = optimizer.stateless_apply(
        [v.value for v in optimizer.variables],
        grads,
        [v.value for v in variables],
    )
    for variable, value in zip(variables, new_values):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, new_optimizer_values):
        variable.assign(value)


_GEMMS_JITTED = {}


def gemm_and_gradients(function, x, kernel, g, jit=True):
    """`function(x, kernel)` and its gradients for output gradient `g`
    (on JAX in one `jax.jit`, unless `jit=False`: op by op, JAX compiles
    each op for each new shape, ten times slower here)."""
    import keras
    from keras import ops

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        def step(x, kernel, g):
            out, vjp = jax.vjp(function, x, kernel)
            return (out, *vjp(ops.cast(g, out.dtype)))

        if not jit:
            return step(x, kernel, g)
        if function not in _GEMMS_JITTED:
            _GEMMS_JITTED[function] = jax.jit(step)
        return _GEMMS_JITTED[function](x, kernel, g)
    if backend == "tensorflow":
        import tensorflow as tf

        x, kernel = tf.convert_to_tensor(x), tf.convert_to_tensor(kernel)
        with tf.GradientTape() as tape:
            tape.watch([x, kernel])
            out = function(x, kernel)
        g = tf.cast(tf.convert_to_tensor(g), out.dtype)
        return (out, *tape.gradient(out, [x, kernel], output_gradients=g))
    x = ops.convert_to_tensor(x).detach().clone().requires_grad_(True)
    kernel = ops.convert_to_tensor(kernel).detach().clone().requires_grad_(True)
    out = function(x, kernel)
    out.backward(ops.convert_to_tensor(g).to(out.dtype))
    return out.detach(), x.grad, kernel.grad


def fp8_mlp_fit_and_reload(recipe, path, outputs):
    """A 64-64-`outputs` MLP trained for 3 epochs under
    `set_global_policy("mixed_bfloat16", fp8=recipe)`, saved to `path`
    (`.keras`) and loaded back.

    Returns:
        A dict: `"losses"` (the epochs' losses), `"fp8"` (the Dense
        layers' FP8 column of `explain_precision`), `"restored_recipe"`
        (the loaded first layer's recipe), and `"predictions"` (the
        trained and the loaded model's, NumPy).
    """
    import keras

    import keras_mp

    keras_mp.set_global_policy("mixed_bfloat16", fp8=recipe)
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(outputs),
            ]
        )
        x = np.random.default_rng(0).normal(size=(64, 64)).astype("float32")
        model.compile(keras.optimizers.Adam(1e-2), loss="mse")
        history = model.fit(
            x, x[:, :outputs], batch_size=16, epochs=3, verbose=0
        )
        rows = keras_mp.explain_precision(model, print_fn=None)
    finally:
        keras_mp.set_global_policy(None)
    model.save(path)
    restored = keras.saving.load_model(path)
    return {
        "losses": history.history["loss"],
        "fp8": [row["fp8"] for row in rows if row["class_name"] == "Dense"],
        "restored_recipe": restored.layers[0].dtype_policy.fp8,
        "predictions": [
            to_numpy(m.predict(x, verbose=0)) for m in (model, restored)
        ],
    }


def block_spread_operands(m, k, n, seed=0):
    """`x [m, k]`, a kernel `[k, n]` and an output gradient `[m, n]` in
    float32 whose rows (x, g) and columns (the kernel) span very different
    magnitudes (2**-6 to 2**6), so each block's scale of a block format
    matters."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, k)) * np.exp2(rng.uniform(-6, 6, (m, 1)))
    w = rng.normal(size=(k, n)) * np.exp2(rng.uniform(-6, 6, (1, n)))
    g = rng.normal(size=(m, n)) * np.exp2(rng.uniform(-6, 6, (m, 1)))
    return x.astype("float32"), w.astype("float32"), g.astype("float32")


def backend_einsum(equation, a, b):
    """The backend's own float32 GEMM of NumPy operands, as `fp8.dot`
    writes its GEMMs, as a NumPy array."""
    from keras import ops

    return to_numpy(
        ops.einsum(equation, ops.convert_to_tensor(a), ops.convert_to_tensor(b))
    )


def fp8_code_bits(codes):
    """The uint8 bit patterns of FP8 codes (a tensor), as NumPy."""
    import keras
    from keras import ops

    if keras.backend.backend() == "torch":
        return to_numpy(ops.view(codes, "uint8"))
    # Flattened first: TensorFlow cannot convert a 0-d FP8 tensor.
    flat = np.asarray(ops.convert_to_numpy(ops.reshape(codes, (-1,))))
    return flat.view(np.uint8).reshape(tuple(codes.shape))


def assert_fp8_codes_equal(codes, expected):
    """FP8 `codes` (a tensor) hold `expected`'s (an `ml_dtypes` array)
    bits, NaN payloads aside: where `expected` is NaN, NaN-ness alone."""
    from keras import ops

    bits, expected_bits = fp8_code_bits(codes), expected.view(np.uint8)
    assert bits.shape == expected_bits.shape
    expected_nan = np.isnan(expected.astype(np.float32))
    nan = np.isnan(to_numpy(ops.cast(codes, "float32")))
    np.testing.assert_array_equal(nan, expected_nan)
    mismatch = (bits != expected_bits) & ~expected_nan
    assert not mismatch.any(), (
        f"{mismatch.sum()} codes differ, e.g. got {bits[mismatch][:5]}, "
        f"expected {expected_bits[mismatch][:5]}"
    )


def describe_machine():
    """The CPU's model name and core count, for a benchmark's header."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def bytes_per_parameter(variables, optimizer):
    """Bytes of weights, optimizer state and master weights per parameter.

    Read from the variables themselves (element count times the size of
    their dtype): `variables` (a model's `weights`, say) for the weights;
    `optimizer.variables` for the state (slots, float8 codes and their
    block scales, step counter, seed state), less the float32 master copies
    of `master_weights` (the optimizer variables named `..._master`),
    counted apart. The parameters are the trainable ones among `variables`.

    Args:
        variables: The model's variables (e.g. `model.weights`).
        optimizer: The optimizer, built.

    Returns:
        A dict with float values for `"weights"`, `"state"` and
        `"masters"`.
    """
    import keras

    def nbytes(group):
        total = 0
        for variable in group:
            dtype = keras.backend.standardize_dtype(variable.dtype)
            itemsize = 2 if dtype in ("bfloat16", "float16") else None
            if itemsize is None:
                itemsize = np.dtype(dtype).itemsize
            total += int(np.prod(variable.shape)) * itemsize
        return total

    params = sum(int(np.prod(v.shape)) for v in variables if v.trainable)
    masters = [v for v in optimizer.variables if v.path.endswith("_master")]
    state = [v for v in optimizer.variables if not v.path.endswith("_master")]
    return {
        "weights": nbytes(variables) / params,
        "state": nbytes(state) / params,
        "masters": nbytes(masters) / params,
    }


def to_numpy(value):
    """A NumPy array of a tensor or variable of any backend."""
    import keras

    if isinstance(value, keras.Variable):
        value = value.value
    return np.asarray(keras.ops.convert_to_numpy(value))


def tolerance(dtype):
    """Relative and absolute tolerance that fits a dtype's precision."""
    return _TOLERANCES[str(dtype)]


def assert_close(actual, expected, dtype="float32", msg=""):
    """Asserts two numeric structures agree within the dtype's tolerance."""
    tol = tolerance(dtype)
    np.testing.assert_allclose(
        to_numpy(actual).astype("float64"),
        to_numpy(expected).astype("float64"),
        rtol=tol,
        atol=tol,
        err_msg=msg,
    )


def assert_bitwise_equal(actual, expected, msg=""):
    """Asserts two arrays hold identical bits (NaNs included)."""
    a, e = to_numpy(actual), to_numpy(expected)
    assert a.dtype == e.dtype, f"{msg} dtype {a.dtype} != {e.dtype}"
    assert a.shape == e.shape, f"{msg} shape {a.shape} != {e.shape}"
    assert a.tobytes() == e.tobytes(), f"{msg} bits differ:\n{a}\n!=\n{e}"


# The torch.Tensor methods through which a whole tensor reaches the host
# without a scalar read (`item()`, `bool(t)`, `float(t)`, `int(t)` and
# `t.__index__()` all dispatch to `aten._local_scalar_dense`, counted by a
# dispatch mode instead): each one waits for the device to finish the work
# queued before it.
_TORCH_HOST_CONVERSIONS = ("tolist", "numpy", "cpu")


@contextlib.contextmanager
def count_host_syncs():
    """Counts tensor-to-host conversions (host syncs) on the active backend.

    A conversion of a tensor to a Python or NumPy value makes the host wait
    for the device to finish the work queued before it. Inside the context
    every such conversion is counted, on any device, so the count taken on
    a CPU is the one a GPU would see:

    - torch: every scalar read, `aten._local_scalar_dense` (what `item()`,
      `bool(t)`, `int(t)`, `float(t)` and `t.__index__()` dispatch to, from
      Python or from torch's own C++), seen by a `TorchDispatchMode` and
      counted as `"_local_scalar_dense"`; a copy from an accelerator to the
      CPU (`"device_to_host"`); and the `torch.Tensor` methods `tolist()`,
      `numpy()` and `cpu()`;
    - TensorFlow: an eager tensor's Python-level read into NumPy
      (`numpy()`, `bool(t)`, `float(t)`, `int(t)`), counted as `"numpy"`;
    - JAX: a `jax.Array`'s (`bool(x)`, `x.item()`, `float(x)`, ... all
      go through its `_value`), counted as `"_value"`;
    - every backend: `np.asarray` and `np.array` of a tensor or a Keras
      variable (`keras.ops.convert_to_numpy` included), counted as
      `"numpy.asarray"` and `"numpy.array"`: NumPy reads CPU tensors
      through the buffer protocol, which no Python method sees.

    Work inside a compiled step (a `tf.function`, `jax.jit`) cannot convert
    a tensor to a Python value at all; what this counts is the host code
    between and around compiled steps, and every eager torch step.

    Yields:
        A `collections.Counter` of the method names called, filled in as
        the context runs.
    """
    import keras

    backend = keras.backend.backend()
    counts = collections.Counter()
    if backend == "torch":
        import torch

        owner = torch.Tensor
        names = [(name, name) for name in _TORCH_HOST_CONVERSIONS]
        tensor_types = (torch.Tensor,)
    elif backend == "tensorflow":
        import tensorflow as tf

        eager_tensor = type(tf.constant(0))
        owner = _defining_class(eager_tensor, "_numpy")
        names = [("_numpy", "numpy")]
        tensor_types = (eager_tensor, tf.Variable)
    elif backend == "jax":
        import jax.numpy as jnp

        owner = type(jnp.zeros(()))
        names = [("_value", "_value")]
        tensor_types = (owner,)
    else:
        raise ValueError(
            "count_host_syncs supports the torch, tensorflow and jax "
            f"backends. Received: backend={backend!r}."
        )
    # NumPy reads CPU tensors through the buffer protocol, past every
    # Python method; its entry points are counted for tensor arguments.
    patches = [
        (owner, name, getattr(owner, name), label, False)
        for name, label in names
    ]
    patches += [
        (np, name, getattr(np, name), f"numpy.{name}", True)
        for name in ("asarray", "array")
    ]
    # A conversion that goes through several counted entry points (NumPy,
    # then the tensor's own method) counts once; so does a copy to the host
    # that is then read: Keras's PyTorch `convert_to_numpy` calls `cpu()`
    # on a device tensor, then `np.array` on the copy it returned, one sync
    # (a CPU's `cpu()` returns the tensor itself, and its next read counts).
    depth = threading.local()
    # id -> weak reference of each host copy a counted `cpu()` made.
    fetched = {}
    mode = (
        _torch_scalar_read_counter(counts, depth)
        if backend == "torch"
        else contextlib.nullcontext()
    )

    def counted(original, label, only_tensors, self, args, kwargs):
        outermost = not getattr(depth, "value", 0)
        if (
            outermost
            and (
                not only_tensors
                or isinstance(self, (*tensor_types, keras.Variable))
            )
            and not _in(self, fetched)
        ):
            counts[label] += 1
        depth.value = getattr(depth, "value", 0) + 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            depth.value -= 1
        if outermost and label == "cpu" and result is not self:
            fetched[id(result)] = weakref.ref(result)
        return result

    def counting(original, label, only_tensors):
        if isinstance(original, property):
            return property(
                lambda self: counted(
                    original.fget, label, only_tensors, self, (), {}
                )
            )

        def method(self, *args, **kwargs):
            return counted(original, label, only_tensors, self, args, kwargs)

        return method

    for target, name, original, label, only_tensors in patches:
        setattr(target, name, counting(original, label, only_tensors))
    try:
        with mode:
            yield counts
    finally:
        for target, name, original, _, _ in patches:
            setattr(target, name, original)


def saved_activation_bytes(model, x, y, loss):
    """Bytes one training step of `model` keeps between its forward and
    its backward pass: the saved activations, weights and batch left out.

    Read from the step itself: on JAX the residuals of the loss's
    gradient with respect to the trainable variables (`saved_residuals`);
    on PyTorch the tensors the autograd graph keeps (`torch_saved_tensors`,
    which also reads keras_mp's FP8 closures); on TensorFlow, whose
    `GradientTape` lists none, the forward tensors that the gradient's ops
    read in the traced step (`tf_saved_tensors`).

    Args:
        model: A built Keras model.
        x: A batch of inputs.
        y: Its targets.
        loss: A Keras loss (callable as `loss(y, y_pred)`).

    Returns:
        An int: bytes.
    """
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        from jax._src.ad_checkpoint import saved_residuals

        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        x, y = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y)

        def step_loss(trainable):
            y_pred, _ = model.stateless_call(
                trainable, non_trainable, x, training=True
            )
            return loss(y, y_pred)

        total = 0
        for aval, description in saved_residuals(step_loss, trainable):
            # The weights (the argument) and the batch (constants) stay in
            # memory whatever the step keeps.
            if description.startswith(("from the argument", "from a constant")):
                continue
            total += int(np.prod(aval.shape)) * aval.dtype.itemsize
        return total
    if backend == "torch":
        x, y = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y)
        value = loss(y, model(x, training=True))
        weights = [keras.ops.convert_to_tensor(v) for v in model.variables]
        saved = torch_saved_tensors(value, exclude=[*weights, x, y])
        return sum(nbytes for _, _, nbytes in saved)
    saved = tf_saved_tensors(model, x, y, loss)
    return sum(nbytes for _, _, _, nbytes in saved)


def tf_saved_tensors(model, x, y, loss):
    """The tensors one TensorFlow training step of `model` keeps for its
    backward: in the step traced as a `tf.function` (a `GradientTape` of
    the loss, then its gradient with respect to the trainable variables),
    every tensor made by the forward's ops that an op of the gradient
    reads, each once. The weights' reads, the batch and constants are left
    out, as JAX's and PyTorch's measures leave them out. TensorFlow's
    executor keeps a tensor until the last op that reads it has run, so
    these are what the step holds between its forward and its backward
    (before Grappler's rewrites).

    Args:
        model: A built Keras model.
        x: A batch of inputs.
        y: Its targets.
        loss: A Keras loss (callable as `loss(y, y_pred)`).

    Returns:
        A list of `(name, shape, dtype name, bytes)`, one per tensor.
    """
    import tensorflow as tf

    marks = {}
    x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)

    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        graph = tf.compat.v1.get_default_graph()
        marks["forward"] = len(graph.get_operations())
        return tape.gradient(value, model.trainable_variables)

    graph = tf.function(step).get_concrete_function(x, y).graph
    operations = graph.get_operations()
    forward = set(operations[: marks["forward"]])
    left_out = ("ReadVariableOp", "Placeholder", "Const", "VarHandleOp")
    saved = {}
    for operation in operations[marks["forward"] :]:
        for tensor in operation.inputs:
            if tensor.op not in forward or tensor.dtype in (
                tf.resource,
                tf.variant,
            ):
                continue
            # An identity's output is its input's buffer: counted once.
            source = tensor
            while source.op.type == "Identity":
                source = source.op.inputs[0]
            if source.op.type not in left_out:
                saved[source.name] = source
    result = []
    for name, tensor in saved.items():
        count = tensor.shape.num_elements()
        if count is None:
            raise ValueError(
                f"tf_saved_tensors needs static shapes; {name} has shape "
                f"{tensor.shape}. Received: x of shape {tuple(x.shape)}. "
                "Pass a batch of a fixed shape (NumPy or a tensor)."
            )
        shape = tuple(tensor.shape.as_list())
        result.append(
            (name, shape, tensor.dtype.name, count * tensor.dtype.size)
        )
    return result


def torch_saved_tensors(output, exclude=()):
    """The tensors a PyTorch autograd graph keeps for its backward, from
    `output` back: what its nodes saved (`_saved_*`), and the tensors a
    custom function's context holds in Python (keras_mp's FP8 GEMMs keep
    their codes in the gradient function's closures, which autograd's
    saved-tensor hooks never see), each storage counted once.

    The measure of "saved activations" on PyTorch, as JAX's
    `saved_residuals` is on JAX. The tensors of `exclude` (e.g. the
    weights, which stay in memory anyway) are left out.

    Args:
        output: A tensor with a `grad_fn`.
        exclude: Tensors not to count (their storages).

    Returns:
        A list of `(shape, dtype name, bytes)`, one per storage.
    """
    import types

    import torch

    def storage(t):
        return (t.untyped_storage().data_ptr(), t.device)

    skipped = {storage(t) for t in exclude}
    found, seen_objects = {}, set()

    def keep(t):
        key = storage(t)
        if key in skipped or key in found:
            return
        nbytes = t.untyped_storage().nbytes()
        found[key] = (
            tuple(t.shape),
            str(t.dtype).replace("torch.", ""),
            nbytes,
        )

    def walk(value, depth=0):
        if depth > 12 or id(value) in seen_objects:
            return
        seen_objects.add(id(value))
        if isinstance(value, torch.Tensor):
            keep(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item, depth + 1)
        elif isinstance(value, (list, tuple, set)):
            for item in value:
                walk(item, depth + 1)
        elif isinstance(value, (types.FunctionType, functools.partial)):
            function = (
                value.func if isinstance(value, functools.partial) else value
            )
            for cell in function.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    walk(cell.cell_contents, depth + 1)
            if isinstance(value, functools.partial):
                walk(value.args, depth + 1)
        elif isinstance(value, types.MethodType):
            walk(value.__self__, depth + 1)
        elif hasattr(value, "__dict__") and type(value).__module__.startswith(
            "keras_mp."
        ):
            walk(vars(value), depth + 1)

    nodes, visited = [output.grad_fn], set()
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        for name in dir(node):
            if name.startswith("_saved_"):
                with contextlib.suppress(RuntimeError):  # freed already
                    walk(getattr(node, name))
        # A custom `torch.autograd.Function`'s node is its context.
        walk(getattr(node, "__dict__", {}))
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())


@contextlib.contextmanager
def count_host_copies():
    """Counts the tensors keras_mp's own code makes from host data on
    PyTorch (`torch.as_tensor` and `torch.tensor` of Python numbers,
    lists or NumPy arrays, which `keras.ops` calls for every Python number
    it is given), by the keras_mp line that asked for them.

    On a GPU each one is a copy from pageable host memory that waits for
    every kernel queued before it (PyTorch's sync debug mode reports them
    as synchronizing): the copies that `count_host_syncs` does not see. A
    CPU makes the same calls, so the count taken here is the one a GPU
    would see. Host data that Keras's own code (its optimizers, losses,
    metrics) or `keras_mp.testing` hands over is not counted. Elsewhere
    than PyTorch the counter stays empty (a compiled step's numbers are
    constants of its graph).

    Yields:
        A `collections.Counter` of `"module.py:line"` of the keras_mp
        line nearest the call, filled in as the context runs.
    """
    import keras

    counts = collections.Counter()
    if keras.backend.backend() != "torch":
        yield counts
        return
    import torch

    package = pathlib.Path(__file__).resolve().parents[1]
    testing = pathlib.Path(__file__).resolve().parent
    # The frames of torch and of Keras's ops and backend are passed over:
    # the first frame outside them handed over the host data (Keras's own
    # optimizers, losses and metrics are not keras_mp's).
    keras_src = pathlib.Path(keras.__file__).resolve().parent / "src"
    libraries = [
        pathlib.Path(torch.__file__).resolve().parent,
        keras_src / "backend",
        keras_src / "ops",
    ]
    originals = {name: getattr(torch, name) for name in ("as_tensor", "tensor")}

    def asker():
        frame = sys._getframe(2)
        while frame is not None:
            path = pathlib.Path(frame.f_code.co_filename).resolve()
            if not any(library in path.parents for library in libraries):
                if package in path.parents and testing not in path.parents:
                    where = path.relative_to(package.parent)
                    return f"{where}:{frame.f_lineno}"
                return None
            frame = frame.f_back
        return None

    def counting(original):
        def make(data, *args, **kwargs):
            if not isinstance(data, torch.Tensor):
                where = asker()
                if where is not None:
                    counts[where] += 1
            return original(data, *args, **kwargs)

        return make

    for name, original in originals.items():
        setattr(torch, name, counting(original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


def _in(value, fetched):
    """Whether `value` is one of the host copies in `fetched` (by identity:
    tensors compare element by element, and some cannot be hashed)."""
    reference = fetched.get(id(value))
    return reference is not None and reference() is value


def _torch_scalar_read_counter(counts, depth):
    """A `TorchDispatchMode` counting scalar reads and device-to-host copies
    into `counts`, except inside a counted method (see `count_host_syncs`)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    scalar_read = torch.ops.aten._local_scalar_dense.default
    # Where each copy's source is among its arguments.
    copies = {
        torch.ops.aten._to_copy.default: 0,
        torch.ops.aten.copy_.default: 1,
    }

    class ScalarReadCounter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if not getattr(depth, "value", 0):
                if func is scalar_read:
                    counts["_local_scalar_dense"] += 1
                elif func in copies and _device_to_host(
                    args[copies[func]], result
                ):
                    counts["device_to_host"] += 1
            return result

    return ScalarReadCounter()


def _device_to_host(source, result):
    return (
        getattr(source, "device", None) is not None
        and getattr(result, "device", None) is not None
        and source.device.type != "cpu"
        and result.device.type == "cpu"
    )


def _defining_class(cls, name):
    """The class of `cls`'s MRO whose own namespace defines `name`."""
    return next(c for c in cls.__mro__ if name in c.__dict__)


def run_python(code, env=None, timeout=600):
    """Runs Python code in a fresh interpreter and returns its stdout.

    Needed where state must be set before a backend is imported (JAX's host
    device count, TensorFlow's logical devices) or where a fresh process is
    the point (loading a saved model with no global policy set).

    Raises:
        AssertionError: with the child's output, if it exits non-zero.
    """
    return _run_child(["-c", textwrap.dedent(code)], env, timeout, None)


def run_script(path, *args, env=None, timeout=600):
    """Runs a script (a guide, an example, a benchmark) on the active backend.

    The child runs from the repository root with the same `KERAS_BACKEND`,
    the repository on `PYTHONPATH` and `env` on top. On a backend other
    than TensorFlow, TensorFlow cannot be imported there (as on most
    machines of JAX and PyTorch users): Keras would import it, 2 s a script.

    Returns:
        The child's stdout.

    Raises:
        AssertionError: with the child's output, if it exits non-zero.
    """
    import keras

    path = pathlib.Path(path).resolve()
    root = path.parent.parent
    backend = keras.backend.backend()
    paths = [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    if backend != "tensorflow":
        paths.insert(0, without_modules("tensorflow"))
    full_env = {"KERAS_BACKEND": backend, "PYTHONPATH": os.pathsep.join(paths)}
    full_env.update(env or {})
    return _run_child([str(path), *args], full_env, timeout, root)


_HIDDEN_MODULE = """\
# Stands in for {name} in a child process that keras_mp.testing runs as on a
# machine without it: `run_script` runs guides, examples and benchmarks on
# JAX and PyTorch without TensorFlow, where most users of those backends
# are (TensorFlow is installed for the suite's TensorFlow run, and Keras
# imports it whenever it can: 2 s of every script); the tests of imports
# hide the other backends' frameworks.
raise ImportError(
    "{name} is hidden from this process by keras_mp.testing, to run as on "
    "a machine without it."
)
"""


@functools.cache
def without_modules(*names):
    """A folder whose modules `names` (e.g. `"tensorflow"`) fail to import
    with an ImportError: put it first on a child process's `PYTHONPATH`
    (`run_python`'s `env`) to run as on a machine without them. Made once
    per process for each `names` (and removed at exit)."""
    folder = tempfile.mkdtemp(prefix="keras_mp_without_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    for name in names:
        text = _HIDDEN_MODULE.format(name=name)
        pathlib.Path(folder, f"{name}.py").write_text(text)
    return folder


_BACKENDS = ("tensorflow", "jax", "torch", "numpy", "openvino")


def script_backend(path):
    """The backend a script is for (`*_jax.py`, ...), or None for any."""
    stem = pathlib.Path(path).stem
    for backend in _BACKENDS:
        if stem.endswith(f"_{backend}"):
            return backend
    return None


def _run_child(argv, env, timeout, cwd):
    full_env = dict(os.environ)
    full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    full_env.update(env or {})
    result = subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, (
        f"{' '.join(argv[:1] if argv[0] == '-c' else argv)} exited "
        f"{result.returncode}\nstdout:\n{result.stdout[-4000:]}\n"
        f"stderr:\n{result.stderr[-6000:]}"
    )
    return result.stdout

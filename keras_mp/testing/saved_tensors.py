"""What a training step keeps between its forward and its backward pass,
read from the step itself on each backend, and what a PyTorch process
holds between two steps."""

import contextlib
import functools

import numpy as np


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
        x, y = keras.tree.map_structure(keras.ops.convert_to_tensor, (x, y))

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
        x, y = keras.tree.map_structure(keras.ops.convert_to_tensor, (x, y))
        value = loss(y, model(x, training=True))
        weights = [keras.ops.convert_to_tensor(v) for v in model.variables]
        batch = keras.tree.flatten((x, y))
        saved = torch_saved_tensors(value, exclude=[*weights, *batch])
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
    x, y = tf.nest.map_structure(tf.convert_to_tensor, (x, y))

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


def held_torch_bytes(*owners):
    """Bytes of the PyTorch tensors alive now beyond the variables of
    `owners`: what a process holds between two training steps besides its
    models' and optimizers' variables (gradients Keras leaves in `.grad`,
    cached FP8 codes, statistics, scratch buffers).

    Read from the garbage collector's objects: every `torch.Tensor` alive
    in this process, counted once per storage, except the storages of the
    variables of each owner (anything with `variables`: a model, an
    optimizer). On a CPU this is what a GPU's allocator would report as
    held beyond the weights, without one.

    Args:
        *owners: Models, optimizers or layers whose variables are left out.

    Returns:
        An int: bytes.
    """
    import gc
    import warnings

    import torch

    gc.collect()
    left_out = {
        variable.value.untyped_storage().data_ptr()
        for owner in owners
        for variable in owner.variables
    }
    seen = set()
    total = 0
    with warnings.catch_warnings():
        # Lazy modules among the objects warn when `isinstance` asks them.
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if not isinstance(obj, torch.Tensor) or obj.device.type == "meta":
                continue
            try:
                storage = obj.untyped_storage()
                pointer = storage.data_ptr()
            except (RuntimeError, NotImplementedError):
                # Tensors without data: `torch.compile`'s fake and
                # functional tensors, alive after a compilation.
                continue
            if not pointer or pointer in seen or pointer in left_out:
                continue
            seen.add(pointer)
            total += storage.nbytes()
    return total
